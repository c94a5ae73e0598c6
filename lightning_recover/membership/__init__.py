"""Membership (layer 3): who is in the world, and how a replacement becomes a member.

  admission   the re-join exchange as a running job runs it: survivors admit ready
              replacements and send the live state, a replacement waits for its GO and
              receives it (calls into lightning_recover.rejoin)

Nothing here imports Lightning: the framework's checkpoint arrives as callables.
"""
