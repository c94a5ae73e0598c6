"""Hot re-join: replacement replicas join a running job at a step boundary.

  recruiter   the survivors' side: join attempts started, admitted or dropped at step boundaries
  standby     the leader's warm standbys: spawned ahead of a loss, seated on a lost replica
  placement   where replacements and standbys go: the user's hosts, the launcher's spare hosts, or oversubscribed
  salvage     which orphans (live ranks of broken replicas) re-form which lost replicas (pure)
  orphan      an orphan's process: it waits for its seat, merges, and runs the script again as that seat
  replacement a replacement's process runs the user's script as its seat (cold spawn, standby, orphan)
  handshake   the messages between survivors and a replacement, and the replacement's half of them
  transfer    the state transfer: the donor replica's checkpoint, shard by shard, to the replacements
  seat        a replacement's seat: the logical ranks it takes over, the job settings it carries
  milestones  where a replacement's start-up time goes, from the loss to its first step
  admission_timer  how long a replacement may wait to become a member; its entry point is
              lightning_recover.cli.joiner (it runs the user's script, above the strategy)
"""
