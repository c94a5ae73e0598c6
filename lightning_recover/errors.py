"""The error model: one base class, and what becomes of every exception the package raises.

Role: the one place that says, for each exception class, whether the recovery protocol
handles it or it reaches the user -- the contract the strategy, the engine and the
launcher keep (where each fate arises in a running job, and when in its lifecycle:
:mod:`lightning_recover.recovery.job`). This module imports nothing of the package (every
layer may import it); the classes stay in the modules that raise them and name
:class:`RecoverError` as a base (beside their old one, so ``except ValueError`` in user
code keeps working).
``tests/inprocess/test_errors.py`` checks that every exception class of the package is listed here
with its true base.

The fates (:data:`Fate`):

``repaired``
    Handled inside the protocol: the survivors agree, shrink and redo the step in place.
    It never reaches user code.
``gate``
    Ends this rank's replica through the replica-consistency gate (the rank raises
    ``SIGUSR1`` on itself, status 138); the other replicas go on in place.
``stop``
    The job stops on purpose with a status a supervisor relaunches from
    (``lightning-recover launch --supervise``), when the script turns it into
    ``strategy.shutdown(exit_code=...)`` as ``examples/pretrain.py`` does; uncaught, it is a
    ``user`` error.
``user``
    Reaches the user. Before the first step, as a plain exception with the fix in its
    message. During training in a multi-rank job, the rank prints the traceback and dies by
    ``SIGKILL`` with a ``raised`` marker; the launcher says "the program raised ..." and
    exits non-zero, and a supervisor does not relaunch (a relaunch would fail the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ERRORS", "ErrorFate", "Fate", "RecoverError"]

Fate = Literal["repaired", "gate", "stop", "user"]


class RecoverError(Exception):
    """Base of every exception lightning-recover raises (see :data:`ERRORS` for what becomes of each)."""


@dataclass(frozen=True)
class ErrorFate:
    fate: Fate
    #: What the user sees, and what to do about it.
    meaning: str


#: Every exception class of the package (``module:Class``) and its fate.
ERRORS: dict[str, ErrorFate] = {
    "lightning_recover.comm.interface:PeerFailure": ErrorFate(
        "repaired", "a peer died during a collective; the survivors repair and redo the step in place"),
    "lightning_recover.comm.replica_plane:ReplicaPlaneError": ErrorFate(
        "gate", "a replica-local collective failed (a replica-mate died): this replica leaves, the others go on"),
    "lightning_recover.workload.step_plan:TooFewReplicasError": ErrorFate(
        "stop", "fewer live replicas than min_replicas: stop with shutdown(exit_code=3) and relaunch from the newest checkpoint"),
    "lightning_recover.config:ConfigurationError": ErrorFate(
        "user", "a setting is wrong; the message names it and the fix (raised before the first step; uncaught in a launched job: one line, exit status 2)"),
    "lightning_recover.comm.ulfm:ULFMUnavailableError": ErrorFate(
        "user", "the MPI has no working fault tolerance (a trial revoke failed): install Open MPI 5 with ULFM, launch with --with-ft ulfm"),
    "lightning_recover.workload.step_plan:PolicyError": ErrorFate(
        "user", "the workload policy was asked for something impossible (e.g. B not divisible); the message names it"),
    "lightning_recover.workload.step_plan:ReplicaNotLiveError": ErrorFate(
        "user", "a bug: the policy was asked about a replica that is not live; report it with the traceback"),
    "lightning_recover.comm.data_plane:DataPlaneError": ErrorFate(
        "user", "a data-plane transport error the control plane did not confirm as a peer failure (e.g. a network fault)"),
    "lightning_recover.callbacks.epoch_check:StaleBucketError": ErrorFate(
        "user", "a bucket reduced under an older membership was about to be committed; a bug: report it with the traceback"),
    "lightning_recover.callbacks.corruption_check:SilentDataCorruptionError": ErrorFate(
        "user", "replicas computed different results twice in a row (persistent hardware fault): relaunch without that hardware"),
    "lightning_recover.recovery.step_values:LoggedKeysMismatch": ErrorFate(
        "user", "ranks logged different keys with sync_dist=True in one step: log the same names on every rank"),
    "lightning_recover.audit.ledger:LedgerFormatError": ErrorFate(
        "user", "a ledger file is not the strategy's (check-ledger and report): the message names the line"),
    "lightning_recover.audit.report:ReportError": ErrorFate(
        "user", "lightning-recover report cannot read its input: the message names it"),
}
