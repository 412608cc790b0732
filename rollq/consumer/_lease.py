"""Heartbeat: this replica's lease, its registry entry, and what it checks each beat.

Every ``heartbeat_interval`` the beat first asks the engine whether it still serves
(:meth:`~rollq.consumer.engine.Engine.failure`; a dead one stops the replica, which hands
its jobs back and ends its lease). Then one pipeline renews the lease key (``lease_ttl``;
peers reclaim the jobs of a replica whose lease expired), writes the registry entry
(:class:`~rollq.protocol.ReplicaInfo`) and its free slots, reads the peers' free slots
(:mod:`~rollq.consumer._share`), refreshes the queue in the registry of queues,
adds the latency and lag histograms gathered since the last beat, and reads the cancel keys
of running jobs. The same beat feeds the capacity controller and ends running jobs that
were cancelled or whose deadline passed.

On a sharded queue the replica keeps a lease key in every shard (each shard's RECLAIM script
checks leases in its own slot) and reads each running job's cancel key in the job's shard;
the registry entry and the histograms stay in shard 0. A replica that follows the queue's
record (``ConsumerSettings.shards`` None) also reads the record every
:data:`SHARD_RECORD_INTERVAL` seconds and takes up the
shards added since it started.
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
from ..shards import SHARDS_FIELD, check_shards
from . import _share
from ._context import ReplicaContext, guarded
from ._jobs import Jobs

log = logging.getLogger(__name__)

#: Seconds between two reads of the queue's recorded shard count by a replica that follows
#: it: a queue grows rarely (an operator's ``rollq queue create --shards``), and a read every
#: beat would add a command per replica and second to every idle fleet.
SHARD_RECORD_INTERVAL = 10.0


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
        self._record_due = 0.0  # time.monotonic() of the next read of the queue's shard count
        self._fleet = _share.Fleet(ctx.id)  # the peers' free slots (the puller's share of a burst)

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
        dead = ctx.engine.failure()
        if dead is not None:  # no lease for a replica that cannot run its jobs
            jobs.engine_died(dead)
            return
        keys = ctx.keys
        st = ctx.engine.stats()
        t, n = self._tok_window
        now = time.monotonic()
        if now - t >= 1.0:
            self.tokens_per_s = (st.generated_tokens - n) / (now - t)
            self._tok_window = (now, st.generated_tokens)
        ctx.capacity.update(st, inflight=len(jobs.running))
        ttl_ms = int(ctx.settings.lease_ttl * 1000)
        shards = ctx.shards
        pipe = ctx.redis.pipeline(transaction=False)
        pipe.set(keys.heartbeat(ctx.id), b"1", px=ttl_ms, get=True)
        pipe.hset(keys.consumers, ctx.id, msgspec.msgpack.encode(self.entry()))
        now_ms = int(time.time() * 1000)
        open_ = ctx.intake.is_set() and not ctx.stopping.is_set()
        free, cap = (jobs.free_slots(), ctx.capacity.cap) if open_ else (0, 0)
        pipe.hset(keys.free, ctx.id, _share.entry(free, now_ms, ctx.home.shard_index, cap))
        pipe.hgetall(keys.free)
        if self._registered:  # refreshed here, so a long-lived queue stays listed
            add_registration(pipe, ctx.queue, prune=False)
        self._queue_stats(pipe)
        for shard in shards[1:]:  # a lease in every shard (on a cluster the pipeline splits by slot)
            pipe.set(shard.heartbeat(ctx.id), b"1", px=ttl_ms, get=True)
        follow = ctx.settings.shards is None and now >= self._record_due
        if follow:
            self._record_due = now + SHARD_RECORD_INTERVAL
            pipe.hget(keys.config, SHARDS_FIELD)
        marks = self._cancel_reads(pipe)
        res = await pipe.execute()
        stale = self._fleet.update(res[3], now_ms=now_ms, ttl_ms=ttl_ms, home=ctx.home.shard_index)
        ctx.peers_free, ctx.peers_cap = self._fleet.peers_free, self._fleet.peers_cap
        ctx.free_by_home = self._fleet.free_by_home
        if stale:  # replicas gone without their release (killed): not counted, and dropped
            await ctx.redis.hdel(keys.free, *stale)
        lapsed = res[0] is None
        if len(shards) > 1:
            at = len(res) - len(marks) - follow - (len(shards) - 1)
            lapsed = lapsed or any(r is None for r in res[at : at + len(shards) - 1])
        if lapsed and self._leased:
            # Our lease lapsed (a stall or partition longer than lease_ttl): peers may have
            # taken over some of our jobs. Keep only those still ours.
            log.warning("consumer %s: lease had expired; checking which jobs are still ours", ctx.id)
            await self._drop_taken_over()
        self._leased = True
        if marks:
            jobs.heartbeat_checks(
                (j, mark) for ids, got in zip(marks, res[len(res) - len(marks):]) for j, mark in zip(ids, got)
            )
        else:
            jobs.heartbeat_checks(())
        if follow:
            recorded = res[len(res) - len(marks) - 1]
            if recorded is not None and int(recorded) > len(shards):
                await ctx.take_up_shards(check_shards(int(recorded)))
        ctx.room.set()

    def _cancel_reads(self, pipe: Any) -> list[list[str]]:
        """Queue one MGET of the cancel keys of running jobs per shard (the keys of one MGET
        share a slot); returns the job ids of each, in pipeline order."""
        ctx, jobs = self._ctx, self._jobs
        if not jobs.by_job:
            return []
        if len(ctx.shards) == 1:
            by_shard = {0: (ctx.keys, list(jobs.by_job))}
        else:
            by_shard = {}
            running, shard_of = jobs.running, ctx.shards.of_key
            for j, rid in jobs.by_job.items():
                run = running.get(rid)
                if run is None:
                    continue
                shard = shard_of(run.stream)
                entry = by_shard.get(shard.shard_index)
                if entry is None:
                    entry = by_shard[shard.shard_index] = (shard, [])
                entry[1].append(j)
        out = []
        for shard, ids in by_shard.values():
            # execute_command: redis-py's cluster pipeline refuses pipe.mget (the keys share one slot)
            pipe.execute_command("MGET", *[shard.cancel(j) for j in ids])
            out.append(ids)
        return out

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
            tp_size=engine.tp_size, served_dtype=getattr(engine, "dtype", "") or "", converted_from=list(ctx.converted_from),
            progress_sent=self._jobs.progress.sent, progress_dropped=self._jobs.progress.dropped,
            progress_failed=self._jobs.progress.failed,
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
        registry entry and say so on the control channel. A Redis outage skips the rest.
        On a sharded queue: the lease key of every shard, and the group of every shard."""
        ctx = self._ctx
        r, keys = ctx.redis, ctx.keys
        try:
            await self.flush_stats()
            for shard in ctx.shards:
                await r.delete(shard.heartbeat(ctx.id))
            for stream in ctx.read_streams():
                if stream != ctx.shards.of_key(stream).jobs:  # a targeted stream of ours
                    await DROP_EMPTY(r, [stream], [])
            if leave_group:
                for shard in ctx.shards:
                    try:  # our own stream is gone; leave the shared stream's group too
                        if not await r.xpending_range(shard.jobs, GROUP, min="-", max="+", count=1, consumername=ctx.id):
                            await r.xgroup_delconsumer(shard.jobs, GROUP, ctx.id)
                    except ResponseError:
                        pass
            await r.hdel(keys.consumers, ctx.id)
            await r.hdel(keys.free, ctx.id)
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
        for stream in ctx.read_streams():
            try:
                rows = await ctx.redis.xpending_range(
                    stream, GROUP, min="-", max="+", count=len(self._jobs.running) + 1000, consumername=ctx.id
                )
            except ResponseError:
                continue
            owned.update(r["message_id"] for r in rows)
        self._jobs.drop_not_owned(owned)
