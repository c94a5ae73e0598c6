"""Import access to the checkout's benchmark scripts, for the tests that test those scripts themselves.

``benchmarks/`` is a folder of scripts, not a package (its modules import each other by file
name, as ``python benchmarks/X.py`` runs them), and it is not installed. The few test files
that test a benchmark script call :func:`benchmarks_on_path` before importing it; nothing
else in the suite sees ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmarks_on_path() -> Path:
    """Put ``benchmarks/`` first on ``sys.path`` (once) so its scripts import as modules; returns the folder."""
    if not (BENCHMARKS / "overhead.py").is_file():
        raise FileNotFoundError(f"{BENCHMARKS} holds no benchmark scripts: the benchmark tests need a source checkout")
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return BENCHMARKS
