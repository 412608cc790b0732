"""Reclaim: take over the jobs of consumers whose lease expired.

Every ``reclaim_interval`` (jittered), or at once when a peer hands its jobs back on the control
channel, each replica takes one reclaim turn:

- once every ``lease_ttl``, it recovers entries pending under its own name that it is not
  running (:meth:`~rollq.consumer._puller.Puller.recover_own`, two ``XPENDING`` of its own
  entries): a read reply lost without an error (the puller recovers at once after a failed
  read; this is the backstop);
- it holds, or tries to take, the queue's *reclaimer role*: a key
  (``QueueKeys.reclaimer``) holding one replica's id with a TTL of ``lease_ttl`` (at least
  two reclaim intervals), renewed by its holder every turn and taken with ``SET NX`` by
  whichever replica finds it gone;
- the holder of shard 0's role on a sharded queue also mirrors the committed policy version
  into the shards whose mirror lags it (:func:`~rollq.weightsync.versions.heal_mirrors`: a
  publisher that died between its commit and its mirror), two reads a turn when none lags;
- only the holder lists the group's consumers, checks their lease keys, and moves the pending
  entries of dead ones to itself with one RECLAIM script call per stream
  (``lua/reclaim.lua``: re-checks the lease, then claims); the entries then go through the
  usual admission, which dead-letters those delivered more than ``max_deliveries`` times.

On a sharded queue each shard has its own role (``QueueKeys.reclaimer`` of that shard), and its
holder scans that shard's group and claims with that shard's keys (each RECLAIM call stays in
one slot); a dead consumer's targeted stream is claimed from in its home shard (and shard 0,
its home before the queue grew, if it started on an unsharded record).

So a fleet of N replicas scans its N consumers once per interval (O(N) in all; per replica a
``GET`` per turn and shard and the own-entry check), not N times (O(N^2)). The role is an optimisation,
not a lock: two replicas that both think they hold it for a turn only scan twice (RECLAIM
claims each entry once). A holder that dies stops renewing: the key expires within
``lease_ttl``, about when the holder's own lease does, and the next replica to take a turn
takes the role and its jobs. A stopping replica gives the role up at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable

from redis.exceptions import ResponseError

from ..connection import RECLAIM
from ..keys import GROUP, QueueKeys
from ..replicas import heartbeating
from ..shards import home_shard
from ..weightsync.versions import heal_mirrors
from ._context import ReplicaContext, guarded, wrong_type
from ._jobs import Jobs
from ._puller import entry_payload

log = logging.getLogger(__name__)


class Reclaimer:
    """The reclaim task (:meth:`run`); :attr:`now` wakes it early."""

    def __init__(self, ctx: ReplicaContext, jobs: Jobs, recover_own: Callable[[], Awaitable[int]]) -> None:
        self._ctx = ctx
        self._jobs = jobs
        self._recover_own = recover_own
        #: Set to reclaim at once (a peer handed its jobs back).
        self.now = asyncio.Event()
        #: This replica held a reclaimer role at its last turn.
        self.holding = False
        self._roles: set[int] = set()  # the shards whose role it held then
        self._own_due = 0.0  # time.monotonic() of the next check of our own pending entries

    async def run(self) -> None:
        ctx = self._ctx
        while not ctx.closed:
            await ctx.wait_any(self.now.wait(), timeout=ctx.settings.reclaim_interval * (0.75 + random.random() / 2))
            self.now.clear()
            if ctx.stopping.is_set():
                if self.holding:  # a stopping replica takes over nothing more: let a peer scan
                    await guarded(log, "reclaim", self.resign)
                await asyncio.sleep(0.05)
                continue
            await guarded(log, "reclaim", self.reclaim_once)

    async def reclaim_once(self) -> int:
        """One reclaim turn (see the module docstring). Returns how many jobs of dead
        consumers were taken (0 unless this replica holds a reclaimer role)."""
        ctx = self._ctx
        now = time.monotonic()
        if now >= self._own_due and not ctx.stopping.is_set():
            self._own_due = now + ctx.settings.lease_ttl
            await self._recover_own()
        taken = 0
        for shard in list(ctx.shards):
            if await self._elect(shard):
                self._roles.add(shard.shard_index)
                try:
                    taken += await self._scan(shard)
                except ResponseError as e:  # a stray value at the shard's stream: the others go on
                    if not wrong_type(e):
                        raise
                    await ctx.stream_is_bad(shard.jobs)
            else:
                self._roles.discard(shard.shard_index)
        self.holding = bool(self._roles)
        if 0 in self._roles and len(ctx.shards) > 1 and await heal_mirrors(ctx.redis, ctx.keys, len(ctx.shards)):
            log.warning("queue %r: a shard's mirror of the policy version lagged its record (a publisher died "
                        "between commit and mirror); mirrored it", ctx.queue)
        return taken

    async def _elect(self, shard: QueueKeys) -> bool:
        """Renew the reclaimer role of ``shard`` if this replica holds it, else take it if
        nobody does.

        Plain commands (Redis 6.2 has no ``SET NX GET``): a ``GET``, then a ``PEXPIRE`` by the
        holder or a ``SET NX PX`` when the key is gone. If the key expires and a peer takes
        it between our ``GET`` and ``PEXPIRE``, both scan for one turn: harmless."""
        ctx = self._ctx
        r, key, me = ctx.redis, shard.reclaimer, ctx.id.encode()
        ttl_ms = int(1000 * max(ctx.settings.lease_ttl, 2 * ctx.settings.reclaim_interval))
        holder = await r.get(key)
        if holder == me:
            return bool(await r.pexpire(key, ttl_ms))  # 0: it expired meanwhile
        if holder is None and await r.set(key, me, nx=True, px=ttl_ms):
            where = f" shard {shard.shard_index}" if len(ctx.shards) > 1 else ""
            log.info("consumer %s holds the reclaimer role of queue %r%s", ctx.id, ctx.queue, where)
            return True
        return False

    async def resign(self) -> None:
        """Give the reclaimer roles up that this replica holds (a stop), so that a peer takes
        them at its next turn instead of after ``lease_ttl``. A peer that took one meanwhile
        keeps it unless it changes hands between our ``GET`` and ``DEL`` (then it is taken
        again at the next turn)."""
        ctx = self._ctx
        self.holding = False
        roles, self._roles = self._roles, set()
        for shard in ctx.shards:
            if len(ctx.shards) > 1 and shard.shard_index not in roles:
                continue
            if await ctx.redis.get(shard.reclaimer) == ctx.id.encode():
                await ctx.redis.delete(shard.reclaimer)

    async def _scan(self, shard: QueueKeys) -> int:
        """The holder's scan of ``shard``: take over the jobs of every consumer of its group
        whose lease expired. Returns how many were taken."""
        ctx = self._ctx
        consumers = await ctx.redis.xinfo_consumers(shard.jobs, GROUP)
        names = []
        for c in consumers:
            name = c.get("name") or c.get(b"name")
            name = name.decode() if isinstance(name, bytes) else name
            if name != ctx.id:
                names.append(name)
        if not names:
            return 0
        alive = await heartbeating(ctx.redis, shard, names)
        taken = 0
        for name, is_alive in zip(names, alive):
            if not is_alive:
                taken += await self._take_over(shard, name)
        return taken

    async def _take_over(self, shard: QueueKeys, name: str) -> int:
        """Claim the pending jobs of dead consumer ``name`` in ``shard``: from its shared
        stream, and from the consumer's targeted stream where that lives here."""
        ctx = self._ctx
        k = len(ctx.shards)
        streams = [shard.jobs]
        i = shard.shard_index
        if i == home_shard(name, k) or i == 0:  # shard 0: its home if it started unsharded
            streams.append(shard.replica_jobs(name))
        taken = 0
        for stream in streams:
            # A dead replica's jobs are the oldest work in the queue: take them even past
            # our cap (they wait in the engine's own queue), at most one batch per turn.
            free = max(self._jobs.free_slots(), ctx.settings.batch)
            claimed, ids, counts = await RECLAIM(
                ctx.redis,
                [stream, shard.heartbeat(name), shard.consumers, shard.replica_jobs(name)],
                [GROUP, name, ctx.id, free, "1" if stream == shard.jobs else "0"],
            )
            deliveries = {e: int(c) for e, c in zip(ids, counts)}
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
