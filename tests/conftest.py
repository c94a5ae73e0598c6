import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# mpirun.py (the launcher harness) and the worker modules are imported by the tests.
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))
