"""Reclaim: take over the jobs of consumers whose lease expired.

Every ``reclaim_interval`` (jittered), or at once when a peer hands its jobs back on the control
channel, the reclaimer lists the group's consumers, checks their lease keys, and moves the
pending entries of dead ones to this replica with one RECLAIM script call per stream
(``lua/reclaim.lua``: re-checks the lease, then claims); the entries then go through the usual
admission, which dead-letters those delivered more than ``max_deliveries`` times. It also
notices when Redis holds more of this replica's entries than it has in hand (a lost read
reply) and recovers them.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable

from ..connection import RECLAIM
from ..keys import GROUP
from ..replicas import heartbeating
from .context import ReplicaContext, guarded
from .jobs import Jobs
from .puller import entry_payload

log = logging.getLogger(__name__)


class Reclaimer:
    """The reclaim task (:meth:`run`); :attr:`now` wakes it early."""

    def __init__(self, ctx: ReplicaContext, jobs: Jobs, recover_own: Callable[[], Awaitable[int]]) -> None:
        self._ctx = ctx
        self._jobs = jobs
        self._recover_own = recover_own
        #: Set to reclaim at once (a peer handed its jobs back).
        self.now = asyncio.Event()

    async def run(self) -> None:
        ctx = self._ctx
        while not ctx.closed:
            await ctx.wait_any(self.now.wait(), timeout=ctx.settings.reclaim_interval * (0.75 + random.random() / 2))
            self.now.clear()
            if ctx.stopping.is_set():
                await asyncio.sleep(0.05)
                continue
            await guarded(log, "reclaim", self.reclaim_once)

    async def reclaim_once(self) -> int:
        """Take over jobs of consumers whose lease expired. Returns how many were taken."""
        ctx = self._ctx
        consumers = await ctx.redis.xinfo_consumers(ctx.keys.jobs, GROUP)
        names = []
        for c in consumers:
            name = c.get("name") or c.get(b"name")
            name = name.decode() if isinstance(name, bytes) else name
            if name != ctx.id:
                names.append(name)
            elif int(c.get("pending") or 0) > len(self._jobs.known_eids()) and not ctx.stopping.is_set():
                # Redis holds more of our entries than we run: a read reply was lost.
                await self._recover_own()
        if not names:
            return 0
        alive = await heartbeating(ctx.redis, ctx.keys, names)
        taken = 0
        for name, is_alive in zip(names, alive):
            if not is_alive:
                taken += await self._take_over(name)
        return taken

    async def _take_over(self, name: str) -> int:
        """Claim the pending jobs of dead consumer ``name`` from both streams it read."""
        ctx = self._ctx
        keys = ctx.keys
        taken = 0
        for stream in (keys.jobs, keys.replica_jobs(name)):
            # A dead replica's jobs are the oldest work in the queue: take them even past
            # our cap (they wait in the engine's own queue), at most one batch per turn.
            free = max(self._jobs.free_slots(), ctx.settings.batch)
            claimed, ids, counts = await RECLAIM(
                ctx.redis,
                [stream, keys.heartbeat(name), keys.consumers, keys.replica_jobs(name)],
                [GROUP, name, ctx.id, free, "1" if stream == keys.jobs else "0"],
            )
            deliveries = {i: int(c) for i, c in zip(ids, counts)}
            for entry in claimed:
                if not entry:
                    continue
                eid, flat = entry[0], entry[1]
                taken += 1
                ctx.counters.reclaimed += 1
                self._jobs.admit(stream, eid, entry_payload(flat), deliveries.get(eid, 2))
            if claimed:
                log.warning("reclaimed %d jobs of dead consumer %s from %s", len(claimed), name, stream)
        return taken
