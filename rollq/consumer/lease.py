"""Heartbeat: this replica's lease, its registry entry, and what it checks each beat.

Every ``heartbeat_interval`` one pipeline renews the lease key (``lease_ttl``; peers reclaim the
jobs of a replica whose lease expired), writes the registry entry
(:class:`~rollq.protocol.ReplicaInfo`), refreshes the queue in the registry of queues,
adds the latency and lag histograms gathered since the last beat, and reads the cancel keys
of running jobs. The same beat feeds the capacity controller and ends running jobs that
were cancelled or whose deadline passed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

import msgspec
from redis.exceptions import ResponseError

from ..connection import DROP_EMPTY, RETRYABLE
from ..keys import GROUP
from ..protocol import Control, ReplicaInfo, control_message
from ..registry import add_registration, register_queue
from .context import ReplicaContext, guarded
from .jobs import Jobs

log = logging.getLogger(__name__)


class Lease:
    """The heartbeat task (:meth:`run`) and the lease's start (:meth:`register`) and end
    (:meth:`release`)."""

    def __init__(self, ctx: ReplicaContext, jobs: Jobs) -> None:
        self._ctx = ctx
        self._jobs = jobs
        #: Generated tokens per second over the last beat (at least a second apart).
        self.tokens_per_s = 0.0
        self._tok_window: tuple[float, int] = (time.monotonic(), 0)
        self._leased = False
        self._registered = False  # the queue is in the registry of queues (refreshed each beat)

    async def register(self) -> None:
        """Add the queue to the registry of queues (pruning stale names), then beat once."""
        self._registered = await register_queue(self._ctx.redis, self._ctx.queue)
        await self.beat()

    async def run(self) -> None:
        ctx = self._ctx
        while not ctx.closed:
            await asyncio.sleep(ctx.settings.heartbeat_interval)
            await guarded(log, "heartbeat", self.beat)

    async def beat(self) -> None:
        """One heartbeat (see the module docstring)."""
        ctx, jobs = self._ctx, self._jobs
        keys = ctx.keys
        st = ctx.engine.stats()
        t, n = self._tok_window
        now = time.monotonic()
        if now - t >= 1.0:
            self.tokens_per_s = (st.generated_tokens - n) / (now - t)
            self._tok_window = (now, st.generated_tokens)
        ctx.capacity.update(st, inflight=len(jobs.running))
        pipe = ctx.redis.pipeline(transaction=False)
        pipe.set(keys.heartbeat(ctx.id), b"1", px=int(ctx.settings.lease_ttl * 1000), get=True)
        pipe.hset(keys.consumers, ctx.id, msgspec.msgpack.encode(self.entry()))
        if self._registered:  # refreshed here, so a long-lived queue stays listed
            add_registration(pipe, ctx.queue, prune=False)
        self._queue_stats(pipe)
        job_ids = list(jobs.by_job)
        if job_ids:
            # execute_command: redis-py's cluster pipeline refuses pipe.mget (the keys share one slot)
            pipe.execute_command("MGET", *[keys.cancel(j) for j in job_ids])
        res = await pipe.execute()
        if res[0] is None and self._leased:
            # Our lease lapsed (a stall or partition longer than lease_ttl): peers may have
            # taken over some of our jobs. Keep only those still ours.
            log.warning("consumer %s: lease had expired; checking which jobs are still ours", ctx.id)
            await self._drop_taken_over()
        self._leased = True
        jobs.heartbeat_checks(zip(job_ids, res[-1]) if job_ids else ())
        ctx.room.set()

    def entry(self) -> ReplicaInfo:
        """This replica's registry entry as of now."""
        ctx, engine = self._ctx, self._ctx.engine
        st = engine.stats()
        return ReplicaInfo(
            id=ctx.id, host=socket.gethostname(), pid=os.getpid(), engine=engine.name,
            model=engine.model, device=engine.device, version=ctx.version,
            inflight=len(self._jobs.running), cap=ctx.capacity.cap, kv_usage=st.kv_usage,
            tokens_per_s=round(self.tokens_per_s, 1), completed=ctx.counters.completed,
            failed=ctx.counters.failed, started_at=ctx.started_at, heartbeat_at=time.time(),
            state=ctx.state, labels=dict(ctx.settings.labels), paused_s_total=round(ctx.paused_s_total, 4),
            tp_size=engine.tp_size,
            **ctx.update_info,
        )

    async def announce(self) -> None:
        """Write the registry entry now, not at the next beat."""
        ctx = self._ctx
        try:
            await ctx.redis.hset(ctx.keys.consumers, ctx.id, msgspec.msgpack.encode(self.entry()))
        except RETRYABLE as e:
            log.debug("registry update failed: %s", e)

    async def release(self, leave_group: bool) -> None:
        """End the lease at shutdown: flush the histograms, delete the lease key (peers reclaim
        our unfinished jobs at once), drop our targeted stream if empty, leave the consumer
        group (with ``leave_group``, if nothing is pending under us there), remove the
        registry entry and say so on the control channel. A Redis outage skips the rest."""
        ctx = self._ctx
        r, keys = ctx.redis, ctx.keys
        try:
            await self.flush_stats()
            await r.delete(keys.heartbeat(ctx.id))
            await DROP_EMPTY(r, [ctx.streams[0]], [])
            if leave_group:
                try:  # our own stream is gone; leave the shared stream's group too
                    if not await r.xpending_range(keys.jobs, GROUP, min="-", max="+", count=1, consumername=ctx.id):
                        await r.xgroup_delconsumer(keys.jobs, GROUP, ctx.id)
                except ResponseError:
                    pass
            await r.hdel(keys.consumers, ctx.id)
            await r.publish(keys.control, control_message(Control.HANDBACK, ctx.id))
        except RETRYABLE:
            pass

    def _queue_stats(self, pipe: Any) -> None:
        c = self._ctx.counters
        keys = self._ctx.keys
        buckets = c.latency_buckets
        if any(buckets):
            for i, v in enumerate(buckets):
                if v:
                    pipe.hincrby(keys.latency, str(i), v)
            c.latency_buckets = [0] * len(buckets)
        if c.lag:
            for lag, n in c.lag.items():
                pipe.hincrby(keys.lag, str(lag), n)
            c.lag = {}

    async def flush_stats(self) -> None:
        """Add the histograms gathered since the last beat to the queue's now."""
        pipe = self._ctx.redis.pipeline(transaction=False)
        self._queue_stats(pipe)
        if len(pipe):
            await pipe.execute()

    async def _drop_taken_over(self) -> None:
        """Abort our copy of running jobs that are no longer pending under this consumer."""
        ctx = self._ctx
        owned: set[bytes] = set()
        for stream in ctx.streams:
            try:
                rows = await ctx.redis.xpending_range(
                    stream, GROUP, min="-", max="+", count=len(self._jobs.running) + 1000, consumername=ctx.id
                )
            except ResponseError:
                continue
            owned.update(r["message_id"] for r in rows)
        self._jobs.drop_not_owned(owned)
