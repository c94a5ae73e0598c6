"""The status markers a rank leaves for the launcher: the one channel from ranks to ``lightning-recover launch``.

The launcher (:mod:`lightning_recover.cli.launcher`) names a status directory in the ranks'
environment; the rank side (:mod:`lightning_recover.runtime.lifecycle`) writes its markers
there. Both sides read these names from here, so the ranks' runtime never imports the launch side.
"""

from __future__ import annotations

#: Ranks of a fault-tolerant job leave markers here: ``init.R`` (holding ``HOST PID``) when
#: the strategy starts the rank, before ``MPI_Init``; ``started.R`` when their communicator
#: comes up, ``ok.R`` when they end normally, ``exited.R`` when they stop on purpose with a
#: non-zero status (below min_replicas), ``raised.R`` when an uncaught exception ended them
#: (holding the exception's type name, then its last traceback line); a rank killed by a
#: signal writes none.
ENV_STATUS_DIR = "LIGHTNING_RECOVER_STATUS_DIR"
#: How an ``exited.R`` marker starts when its rank stopped because its side of a failure lost
#: the quorum (:func:`lightning_recover.runtime.lifecycle.quorum_exit`): the machines failed, not the program.
QUORUM_MARKER = "no quorum"
#: How an ``exited.R`` marker starts when its rank stopped because a peer was lost while the job
#: started, before the communicator came up (:func:`lightning_recover.runtime.lifecycle.lost_at_start`):
#: the world is fixed when MPI starts, so this launch cannot go on without that peer.
START_LOST_MARKER = "lost at start"
#: Environment variable: how long (seconds) the launcher waits, from the first rank's ``init``
#: marker, for every rank to bring its communicator up before it ends the job as lost at start.
ENV_START_TIMEOUT = "LIGHTNING_RECOVER_START_TIMEOUT"
#: Environment variable: the launch's hosts with free slots (``name:free,...``, spare hosts -- those
#: running none of the job's ranks -- first), where re-join places replacements and warm standbys
#: (:mod:`lightning_recover.membership.placement`). Set by ``lightning-recover launch`` when it places
#: the job on hosts (``--hosts``, ``--hostfile``, a Slurm allocation) and slots are left over.
ENV_SPARE_HOSTS = "LIGHTNING_RECOVER_SPARE_HOSTS"
