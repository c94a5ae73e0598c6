"""``python -m lightning_recover.cli``: runs the ``lightning-recover`` command (tests, examples and
benchmarks start it this way, with the interpreter they run under)."""

import sys

from lightning_recover.cli.commands import main

if __name__ == "__main__":  # importing the module (as tests that walk the package do) runs nothing
    sys.exit(main())
