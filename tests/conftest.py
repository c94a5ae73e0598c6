import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# mpirun.py (the launcher harness) and the worker modules are imported by the tests, and so
# are the checkout's tools that are not part of the installed package (benchmarks/: the
# chaos campaign, the goodput model and the benchmark scripts).
sys.path.insert(0, str(HERE.parent / "benchmarks"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))
