"""Pull: ``XREADGROUP COUNT=free`` over this replica's targeted stream and the shared stream.

A read takes at most ``min(free slots, batch)`` entries, so jobs wait in Redis, not in a busy
replica. Each entry read is admitted at once (:meth:`~rollq.consumer._jobs.Jobs.admit`).

On a sharded queue (:mod:`rollq.shards`) the replica blocks on its home shard's streams; when
a read there leaves slots free (or a ``block`` period passed since the last look elsewhere),
it reads the other shards' shared streams without blocking, one read per shard, in turn from
a rotating start, each for the slots still free, and blocks again only once every shard was
looked at. So a job in a shard that is no replica's home waits about one ``block`` period at
most, and each read stays within one shard (one slot on Redis Cluster).

While other live replicas of the same home shard advertise free slots, a read of the home
shard takes this replica's share of what waits there, not all it has room for
(:mod:`~rollq.consumer._share`):
a burst is spread over the replicas with free capacity, in proportion to it. Alone, or
with every peer full, a replica reads as before. A read of another shard takes only what
that shard's own replicas (those at home there) have no room for: all it has room for when
they are full or absent, nothing while they can take everything waiting there, so that a
burst on a sharded queue is shared within each shard. Should the backlog there not shrink for
``SHARE_PATIENCE`` seconds although they advertise room (busy, stuck or gone since their last
beat), it takes what it has room for.

A read whose reply was lost (a dropped connection, a Redis restart) leaves entries pending
under this consumer that it never saw; :meth:`Puller.recover_own` takes them back, and a reply
that arrives late after all is then skipped.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, deque
from typing import Any

from redis.exceptions import ResponseError

from ..connection import RETRYABLE, deadline
from ..keys import FIELD, GROUP
from ._context import ReplicaContext, wrong_type
from ._finisher import Finisher
from ._jobs import Jobs
from ._share import fair_share, fill_share, waiting

log = logging.getLogger(__name__)

_FIELD = FIELD.encode()
#: Seconds a replica yields after reading its share of a burst, before it reads again.
SHARE_YIELD = 0.01
#: Seconds a replica waits in all, after reading its share of a burst, for a peer to take
#: some of the rest before it takes all it has room for.
SHARE_PATIENCE = 0.15


class Puller:
    """The read loop (:meth:`run`) and the recovery of entries it never saw."""

    def __init__(self, ctx: ReplicaContext, jobs: Jobs, finisher: Finisher) -> None:
        self._ctx = ctx
        self._jobs = jobs
        self._finisher = finisher
        self._names: dict[bytes, str] = {}  # stream names as Redis replies them
        self._lost_read = False
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # entries recover_own took back
        self._to_look: deque[int] = deque()  # other shards to read before blocking again
        self._turn = 0  # where the next look at the other shards starts
        self._looked_at = time.monotonic()  # when the last look at them ended
        #: Entries known to wait in the home shard's shared stream (see _share); None after
        #: an empty read, -1 after the read of one entry that woke it (not known yet).
        self._waiting: int | None = None
        #: The last read of the home shard took this replica's share, and more may wait.
        self._took_share = False
        #: Other shards whose own replicas had room for their backlog: shard -> (the smallest
        #: backlog seen there, since when it has not shrunk).
        self._left_to_home: dict[int, tuple[int, float]] = {}
        #: Streams holding a stray value (WRONGTYPE): stream -> (next try, current delay).
        self._skipped: dict[str, tuple[float, float]] = {}

    async def run(self) -> None:
        """Read until stop (or, in burst mode, until nothing is left); admit what is read."""
        ctx, jobs = self._ctx, self._jobs
        s = ctx.settings
        backoff = s.backoff_initial
        block_ms = max(1, int(s.block * 1000))
        read_deadline = deadline(s.block + ctx.redis_settings.command_timeout, "a blocking read of the job streams")
        while not ctx.stopping.is_set():
            if not ctx.intake.is_set():
                await ctx.wait_any(ctx.intake.wait())
                continue
            free = jobs.free_slots()
            if free <= 0 or len(self._finisher) > 4 * s.batch:
                ctx.room.clear()
                await ctx.wait_any(ctx.room.wait(), timeout=1.0)
                continue
            count = most = min(free, s.batch)
            # The other shards first while some were not looked at since the last blocking
            # read; else block on the home shard.
            shard = self._to_look.popleft() if self._to_look else None
            streams = ctx.other_reads.get(shard) if shard is not None else ctx.streams
            if streams is None:
                continue  # gone (the shard list changed)
            streams = self._usable(streams) if self._skipped else streams
            if not streams:  # every stream of this read holds a stray value for now: skipped
                if shard is not None:
                    if not self._to_look:
                        self._looked_at = time.monotonic()
                    continue
                # The home shard's turn: wait what a blocking read would, then the other shards.
                await ctx.wait_any(ctx.stopping.wait(), timeout=0.05 if ctx.burst else s.block)
                resp = None
            else:
                if shard is None and ctx.peers_free > 0:
                    try:
                        count = await self._share(free, most)
                    except RETRYABLE:
                        pass  # the read below meets the same outage and backs off
                elif shard is not None and ctx.free_by_home.get(shard, 0) > 0:
                    try:
                        count = await self._spill(shard, most, ctx.free_by_home[shard])
                    except RETRYABLE:
                        pass
                    if count == 0:  # that shard's own replicas take what waits there
                        if not self._to_look:
                            self._looked_at = time.monotonic()
                        continue
                try:
                    resp = await self._read(shard, streams, count, block_ms, read_deadline)
                    backoff = s.backoff_initial
                except ResponseError as e:
                    if wrong_type(e):
                        # A stray value at one of these keys (a SET over a job stream): name it,
                        # skip it with backoff, serve the rest. Nothing was delivered.
                        try:
                            found = await self._skip_bad(streams)
                        except RETRYABLE:
                            found = False
                        if not found:
                            await ctx.wait_any(ctx.stopping.wait(), timeout=backoff)
                            backoff = min(backoff * 2, s.backoff_max)
                        continue
                    if not _stream_gone(e):
                        raise
                    # A stream or its group is gone: Redis lost its data (no persistence), or a
                    # peer that took this replica for dead deleted its empty targeted stream
                    # (RECLAIM), which ends a read blocked on it. Nothing was delivered.
                    log.warning("consumer %s: a job stream or its group is missing (%s); recreating it", ctx.id, str(e)[:120])
                    try:
                        for stream in streams:
                            await ctx.ensure_group(stream)
                    except RETRYABLE as e2:
                        if shard is not None:
                            self._to_look.appendleft(shard)
                        log.warning("redis unavailable while recreating the group (%s); retrying in %.2fs", e2, backoff)
                        await ctx.wait_any(ctx.stopping.wait(), timeout=backoff * (0.5 + random.random()))
                        backoff = min(backoff * 2, s.backoff_max)
                    continue
                except RETRYABLE as e:
                    ctx.counters.reconnects += 1
                    log.warning("redis read failed (%s); reconnecting in %.2fs", e, backoff)
                    await ctx.wait_any(ctx.stopping.wait(), timeout=backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, s.backoff_max)
                    self._lost_read = True  # its reply may have been lost after Redis delivered
                    continue
                if self._skipped:
                    self._read_fine(streams)
            if self._lost_read:
                self._lost_read = False
                try:
                    await self.recover_own()
                except RETRYABLE:
                    self._lost_read = True
            got = self._admit_reply(resp) if resp else 0
            if shard is None:
                self._after_home_read(got)
                self._took_share = count < most and got >= count and self._waiting is not None and self._waiting >= 0
            if shard is None and ctx.other_reads and (got < free or time.monotonic() - self._looked_at >= s.block):
                self._look_elsewhere()
            if not resp:
                if not self._to_look and ctx.burst and jobs.idle() and await self._nothing_left():
                    break
                continue
            if ctx.engine_error is not None:
                break
            if self._took_share:
                # A share of a burst was read and more may wait: yield, so that the other
                # replicas with free slots take their shares before this one reads again.
                await ctx.wait_any(ctx.stopping.wait(), timeout=SHARE_YIELD)
            elif len(self._finisher):
                # Jobs that finished at once (a fast engine, rejected entries): let the
                # finisher send them before the next read, which may block.
                await asyncio.sleep(0)

    async def _share(self, free: int, most: int) -> int:
        """How many entries the next read of the home shard takes while peers have free slots
        (see :mod:`~rollq.consumer._share`): one while idle (a burst wakes every blocked
        replica with one entry each), else what fills it to the fleet's level
        (:func:`~rollq.consumer._share.fill_share`). No query while the backlog known from the last one is large enough
        that the share is the whole read.

        After a read of its share, while no peer has taken an entry since, it waits for
        them (``SHARE_YIELD``, doubling, ``SHARE_PATIENCE`` in all: a peer may still be
        waking); if none does by then, the peers' figures are stale (busy, stuck or gone)
        and it takes all it has room for."""
        ctx = self._ctx
        known = self._waiting
        if known is None:
            return 1
        peers = ctx.peers_free
        if known >= 0 and fair_share(known, mine=free, peers=peers, most=most) >= most:
            return most
        now, pending = await waiting(ctx.redis, ctx.home.jobs)
        if self._took_share and known >= 0:
            delay, waited = SHARE_YIELD, SHARE_YIELD  # run() yielded once already
            while now and now >= known:
                if waited >= SHARE_PATIENCE or ctx.stopping.is_set():
                    self._waiting = now
                    return most
                await ctx.wait_any(ctx.stopping.wait(), timeout=delay)
                waited += delay
                delay *= 2
                now, pending = await waiting(ctx.redis, ctx.home.jobs)
        if now == 0:
            self._waiting = None
            return 1
        self._waiting = now
        cap = ctx.capacity.cap
        return fill_share(now, pending=pending, mine_inflight=cap - free, mine_cap=cap, peers_cap=ctx.peers_cap, most=most)

    async def _spill(self, shard: int, most: int, room: int) -> int:
        """How many entries a read of another shard takes while that shard's own replicas
        advertise ``room`` free slots: what waits beyond their room, else nothing, unless
        the backlog there has not shrunk for ``SHARE_PATIENCE`` (see the module docstring)."""
        ctx = self._ctx
        now, _ = await waiting(ctx.redis, ctx.shards[shard].jobs)
        if now <= 0:
            self._left_to_home.pop(shard, None)
            return 0
        if now > room:
            return min(most, now - room)
        seen = self._left_to_home.get(shard)
        t = time.monotonic()
        if seen is None or now < seen[0]:
            self._left_to_home[shard] = (now, t)
            return 0
        if t - seen[1] >= SHARE_PATIENCE:
            self._left_to_home.pop(shard, None)
            return min(most, now)
        return 0

    def _after_home_read(self, got: int) -> None:
        """Track what waits in the home shard: unknown (None, idle) after an empty read;
        else the last figure less what this replica took (the peers took some too, so it
        only errs high, and is read again once it is small)."""
        if not got:
            self._waiting = None
        elif self._waiting is not None and self._waiting >= 0:
            self._waiting = max(0, self._waiting - got)
        else:
            self._waiting = -1  # woken by a burst: its size is read before the next read

    async def _read(self, shard: int | None, streams: list[str], count: int, block_ms: int, read_deadline: Any) -> Any:
        """One XREADGROUP: blocking on the home shard's streams (``shard`` None), else one
        read of another shard's."""
        ctx = self._ctx
        if shard is None:
            async with read_deadline:
                return await ctx.block_redis.xreadgroup(
                    GROUP, ctx.id, {k: ">" for k in streams}, count=count, block=50 if ctx.burst else block_ms,
                )
        async with deadline(ctx.redis_settings.command_timeout, "a read of another shard's job stream"):
            resp = await ctx.block_redis.xreadgroup(GROUP, ctx.id, {k: ">" for k in streams}, count=count)
        if not self._to_look:
            self._looked_at = time.monotonic()
        return resp

    # -- streams holding a stray value ----------------------------------------------------------
    def _usable(self, streams: list[str]) -> list[str]:
        """``streams`` less those skipped for a stray value whose next try is not due yet."""
        now = time.monotonic()
        skipped = self._skipped
        return [k for k in streams if k not in skipped or skipped[k][0] <= now]

    async def _skip_bad(self, streams: list[str]) -> bool:
        """A read of ``streams`` was refused with WRONGTYPE: skip the streams that hold another
        type, each until a delay that doubles at every refusal (``backoff_initial`` to
        ``backoff_max``). Returns whether one was found."""
        ctx, s = self._ctx, self._ctx.settings
        found = False
        for stream in streams:
            if await ctx.stream_is_bad(stream) is None:
                continue
            found = True
            last = self._skipped.get(stream)
            delay = s.backoff_initial if last is None else min(last[1] * 2, s.backoff_max)
            self._skipped[stream] = (time.monotonic() + delay, delay)
        return found

    def _read_fine(self, streams: list[str]) -> None:
        """A read of ``streams`` went through: none of them is skipped any more."""
        for stream in streams:
            if self._skipped.pop(stream, None) is not None:
                self._ctx.key_is_good(stream)

    def _look_elsewhere(self) -> None:
        """Queue one read of every other shard, starting one further along each time."""
        others = sorted(self._ctx.other_reads)
        n = len(others)
        start = self._turn % n
        self._turn += 1
        self._to_look = deque(others[start:] + others[:start])

    def _admit_reply(self, resp: Any) -> int:
        """Admit the entries of a read; returns how many it held."""
        # The block client returns XREADGROUP's reply unparsed (see Consumer._connect): a list
        # of [stream, [[entry id, [field, value, ...]], ...]] (a dict of streams on RESP3).
        seen, admit, names = self._seen, self._jobs.admit, self._names
        n = 0
        for stream, entries in resp.items() if isinstance(resp, dict) else resp:
            skey = names.get(stream)
            if skey is None:
                skey = names[stream] = _str(stream)
            n += len(entries)
            for eid, fields in entries:
                if seen and seen.pop((skey, eid), False) is None:
                    continue  # the late reply of a read whose entries recover_own took back
                admit(skey, eid, entry_payload(fields), 1)
        return n

    async def recover_own(self, min_idle: float | None = None) -> int:
        """See :meth:`rollq.consumer.loop.Consumer.recover_own`."""
        ctx = self._ctx
        if min_idle is None:
            min_idle = 2 * ctx.settings.block + 2.0
        known = self._jobs.known_eids()
        taken = 0
        for stream in ctx.read_streams():
            try:
                rows = await ctx.redis.xpending_range(
                    stream, GROUP, min="-", max="+", count=10_000, consumername=ctx.id, idle=int(min_idle * 1000)
                )
            except ResponseError:
                continue
            lost = [r["message_id"] for r in rows if r["message_id"] not in known]
            if not lost:
                continue
            # XCLAIM to ourselves re-checks the idle time atomically and returns the entries.
            claimed = await ctx.redis.xclaim(stream, GROUP, ctx.id, int(min_idle * 1000), lost)
            counts = {r["message_id"]: int(r.get("times_delivered", 1)) for r in rows}
            for eid, fields in claimed:
                if eid in self._jobs.known_eids():
                    continue
                taken += 1
                self._seen[(stream, eid)] = None  # its read reply may still arrive: skip it then
                if len(self._seen) > 100_000:
                    self._seen.popitem(last=False)
                self._jobs.admit(stream, eid, entry_payload(fields), counts.get(eid, 1) + 1)
        if taken:
            log.warning("consumer %s recovered %d of its own pending jobs it was not running", ctx.id, taken)
        return taken

    async def _nothing_left(self) -> bool:
        """Burst mode: True when no stream (of any shard) holds undelivered or reclaimable
        entries for us."""
        r = self._ctx.redis
        try:
            for stream in self._ctx.read_streams():
                try:
                    groups = await r.xinfo_groups(stream)
                except ResponseError as e:  # the stream is gone (see _stream_gone): nothing in it
                    if "no such key" not in str(e).lower() and not wrong_type(e):  # or skipped
                        raise
                    continue
                for g in groups:
                    name = g.get("name") or g.get(b"name")
                    if name in (GROUP, GROUP.encode()):
                        lag = g.get("lag", g.get(b"lag"))
                        pending = g.get("pending", g.get(b"pending")) or 0
                        if (lag is None and (await r.xlen(stream))) or (lag or 0) > 0 or pending > 0:
                            return False
        except RETRYABLE:
            return False
        return True


def _stream_gone(e: ResponseError) -> bool:
    """The read failed because a stream or its group does not exist: ``NOGROUP`` (a
    non-blocking read, or a group destroyed under a blocked one) or ``UNBLOCKED the stream
    key no longer exists`` (the stream deleted under a blocked read). An error reply to a read
    delivers nothing, so recreating what is missing and reading again loses nothing."""
    text = str(e)
    return text.startswith("NOGROUP") or text.startswith("UNBLOCKED")


def _str(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


def entry_payload(fields: Any) -> bytes | None:
    """The ``d`` field of a stream entry, given as a flat [field, value, ...] list (a raw
    reply) or as a dict; None when it has none."""
    if type(fields) is list:
        if len(fields) == 2 and fields[0] == _FIELD:
            return fields[1]
        for i in range(0, len(fields) - 1, 2):
            if fields[i] == _FIELD:
                return fields[i + 1]
        return None
    return fields.get(_FIELD) if fields else None
