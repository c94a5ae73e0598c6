"""A setting refused in a launched rank: one line naming it and the fix, exit status 2, no traceback.

A :class:`~lightning_recover.config.ConfigurationError` is the same on every rank of a job
(every rank reads the same settings), and its message already names the key and the fix: a
traceback per rank buries that line. In a rank started by a launcher, an uncaught one
(also as the cause of another exception: Hydra's ``instantiate`` wraps what a constructor
raises in its ``InstantiationException``) prints ``[lightning-recover] configuration error:
MESSAGE`` once per job (the first rank to claim it in the launcher's status directory; each
rank without one), leaves a ``raised`` marker and ends the rank:

* before MPI is initialized (a bad strategy argument) with exit status 2, which mpiexec
  passes on as the job's status;
* after (a setting that does not fit the world, a Trainer setting the strategy refuses) by
  :data:`~lightning_recover.runtime.lifecycle.CRASH_SIGNAL`, as any crash after MPI is up
  (a plain non-zero exit would leave Open MPI's runtime aborting forever); the launcher
  then reads the markers and exits with status 2 (:mod:`lightning_recover.cli.job_status`).

A plain ``python script.py`` keeps Python's own traceback and status: there the error is
the program's, and a debugger or a test wants the exception.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import NoReturn

from lightning_recover.config import ConfigurationError
from lightning_recover.runtime import lifecycle

__all__ = ["REFUSED_STATUS", "configuration_error", "install_refusal_hook", "refusal_line", "refuse"]

#: The exit status of a refused setting (a usage error, as argparse's).
REFUSED_STATUS = 2
#: What starts the one line.
PREFIX = "[lightning-recover] configuration error: "

_installed = False


def configuration_error(exc: BaseException | None) -> ConfigurationError | None:
    """``exc`` or the first exception it was raised from (``__cause__``, then ``__context__``) that is a ConfigurationError."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigurationError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def refusal_line(error: ConfigurationError) -> str:
    """The one line: the prefix and the error's message on one line."""
    return PREFIX + " ".join(str(error).split())


def _rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def _mpi_up() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        return bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())  # type: ignore[attr-defined]
    except Exception:
        return False


def refuse(error: ConfigurationError, rank: int | None = None) -> NoReturn:
    """Print the one line (once per job), leave the ``raised`` marker and end this rank; see the module docstring."""
    rank = _rank() if rank is None else rank
    line = refusal_line(error)
    # The claim and the stream the crash hook uses for a traceback (lifecycle's own helpers).
    if lifecycle._first_to_print(line):
        print(line, file=lifecycle.real_stderr(), flush=True)
    lifecycle.mark_status("raised", rank, f"ConfigurationError\nConfigurationError: {' '.join(str(error).split())}\n")
    sys.stdout.flush()
    if _mpi_up():
        time.sleep(lifecycle.OUTPUT_DRAIN_S)
        os.kill(os.getpid(), lifecycle.CRASH_SIGNAL)
    os._exit(REFUSED_STATUS)


def _refuse_if_configuration(exc: BaseException, rank: int | None) -> None:
    if (error := configuration_error(exc)) is not None:
        refuse(error, rank)


def install_refusal_hook() -> None:
    """In a launched rank, let an uncaught ConfigurationError end it with the one line (see the module docstring).

    Wraps the current ``sys.excepthook``; any other exception goes to it unchanged. Does
    nothing outside a launcher, or when called again."""
    global _installed
    if _installed or not lifecycle.launched():
        return
    # Once MPI is up the crash hook wraps this one, and would print a traceback first.
    lifecycle.before_crash(_refuse_if_configuration)
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        error = configuration_error(exc)
        if error is not None:
            refuse(error)
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    _installed = True
