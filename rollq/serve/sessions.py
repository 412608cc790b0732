"""Sticky sessions: a session's jobs go to the replica that served it before, for its prefix cache.

A request names its session with the ``X-Session-ID`` header (prime-rl's orchestrator) or
OpenAI's ``user`` field. :meth:`Sessions.pick` returns the replica that served the session's
last job, and the job is targeted at it (``replica=``: that replica's own stream), unless:

- the replica is gone: no entry in the queue's free-slots hash younger than the lease TTL;
- it holds more than ``margin`` jobs above the least loaded live replica (in flight: its
  in-flight cap less its free slots, as of its last heartbeat, rollq/consumer/_share.py);
  the session then escapes to the queue, which gives the job to whichever replica reads it.

:meth:`Sessions.served` records the replica of each result. The map lives in Redis (one key
per session, ``QueueKeys.session``, expiring ``ttl`` seconds after its last use), so it
survives a restart of ``rollq serve`` and every ``rollq serve`` of a queue shares it.

>>> Sessions.least_loaded({"a": (3, 64), "b": (10, 64)}) , Sessions.escapes("b", {"a": (3, 64), "b": (10, 64)}, 8)
('a', False)
>>> Sessions.escapes("b", {"a": (3, 64), "b": (12, 64)}, 8)
True
"""

from __future__ import annotations

import logging
import time
from typing import Any


from ..connection import text
from ..keys import QueueKeys
from ..protocol.replica import read_free_slots

log = logging.getLogger(__name__)



class Sessions:
    """The session -> replica map of one queue, in Redis.

    Args:
        client: an asyncio Redis client (:func:`rollq.connection.connect`).
        keys: the queue's keys.
        margin: jobs a session's replica may hold above the least loaded one before the
            session escapes to the queue.
        ttl: seconds a session is remembered after its last job.
        lease_ttl: the replicas' lease TTL (``ConsumerSettings.lease_ttl``): an older
            free-slots entry is a replica gone.
    """

    def __init__(self, client: Any, keys: QueueKeys, *, margin: int = 8, ttl: float = 3600.0, lease_ttl: float = 5.0):
        if margin < 0 or ttl <= 0:
            raise ValueError("Sessions needs margin >= 0 and ttl > 0")
        self.client = client
        self.keys = keys.base
        self.margin = margin
        self.ttl = ttl
        self.lease_ttl = lease_ttl
        #: Jobs pinned to the session's replica, and sessions that escaped (overloaded or gone).
        self.pinned = 0
        self.escaped = 0

    async def pick(self, session: str | None) -> str | None:
        """The replica to target the session's next job at, or None (any replica)."""
        if not session:
            return None
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.session(session))
        pipe.hgetall(self.keys.free)
        last, table = await pipe.execute()
        if last is None:
            return None
        replica = text(last)
        loads = self.loads(table, time.time() * 1000)
        if replica not in loads or self.escapes(replica, loads, self.margin):
            self.escaped += 1
            log.debug("session escapes replica %s (%s)", replica[:64], "gone" if replica not in loads else "overloaded")
            return None
        self.pinned += 1
        return replica

    async def served(self, session: str | None, replica: str | None) -> None:
        """The session's job ran on ``replica``: pin its next one there."""
        if session and replica:
            await self.client.set(self.keys.session(session), replica, ex=max(1, int(self.ttl)))

    def loads(self, table: dict[Any, Any], now_ms: float) -> dict[str, tuple[int, int]]:
        """``{replica: (jobs in flight, in-flight cap)}`` of the live replicas in the
        free-slots hash (malformed or stale entries left out)."""
        out: dict[str, tuple[int, int]] = {}
        for name, slots in read_free_slots(table):
            if slots is None or now_ms - slots.at_ms > self.lease_ttl * 1000:
                continue
            out[name] = (max(0, slots.cap - slots.free), max(0, slots.cap))
        return out

    @staticmethod
    def least_loaded(loads: dict[str, tuple[int, int]]) -> str | None:
        """The live replica with the fewest jobs in flight among those serving (cap > 0)."""
        serving = {r: n for r, (n, cap) in loads.items() if cap > 0}
        return min(serving, key=lambda r: (serving[r], r)) if serving else None

    @staticmethod
    def escapes(replica: str, loads: dict[str, tuple[int, int]], margin: int) -> bool:
        """Whether ``replica`` holds more than ``margin`` jobs above the least loaded one. A
        replica paused for a weight update (cap 0) keeps its sessions: it serves again soon."""
        n, cap = loads[replica]
        least = Sessions.least_loaded(loads)
        if cap == 0 or least is None:
            return False
        return n - loads[least][0] > margin
