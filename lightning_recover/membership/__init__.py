"""Hot re-join: replacement replicas join a running job at a step boundary.

  recruiter   the survivors' side: join attempts started, admitted or dropped at step boundaries
  standby     the leader's warm standbys: spawned ahead of a loss, seated on a lost replica
  handshake   the messages between survivors and a replacement, and the replacement's half of them
  transfer    the state transfer: the donor replica's checkpoint, shard by shard, to the replacements
  seat        a replacement's seat: the logical ranks it takes over, the job settings it carries
  milestones  where a replacement's start-up time goes, from the loss to its first step
  joiner      the replacement's entry point: merge, admission, then the user's script
"""
