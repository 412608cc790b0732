"""Weight sync in a replica's process (the consumer's): the follower that applies versions
(:mod:`.follower`) and the typed calls into the engine's workers (:mod:`.worker_calls`).

Modules named with a leading underscore are internal: the swap overlapped with a broadcast,
load-failure accounting, and the replica's broadcast group membership.
"""
