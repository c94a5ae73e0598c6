"""Hot re-join: replacement replicas join a running job at a step boundary.

  rejoin  the survivors' side: recruiter, standbys, admission, state transfer
  joiner  the replacement's side: merge, admission, then the user's script
"""
