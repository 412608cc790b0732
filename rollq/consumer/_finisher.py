"""Outcomes to Redis, exactly once: results, error results and dead letters in FINISH batches.

Every outcome of a job in hand (a result, an error result, a dead letter) becomes one row.
The finisher sends the rows in one FINISH call per flush (``lua/finish.lua``: for each row,
record the result, XACK, delete the entry and forget the job id, each refused if the entry is
no longer pending under this consumer), at most :data:`FINISH_BATCH_BYTES` per call. A call
is shielded from cancellation, so no half batch is left, and retried until Redis takes it.

On a sharded queue one call covers the rows of one shard (every key of a call is in that
shard's slot): its ids, stats and dead-letter keys, and the result stream of each producer
in that shard (``QueueKeys.results`` of the job's shard), so a flush makes one call per
shard that has rows.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import msgpack
from redis.exceptions import ResponseError

from ..connection import FINISH, RETRYABLE, deadline
from ..errors import ResultTooLarge
from ..keys import GROUP, QueueKeys
from ..protocol import DeadLetter, ErrorInfo, Result, cut, encode_dead_letter, encode_result, latency_bucket, short
from ._context import ReplicaContext
from ._in_hand import Failure, JobInHand, mark_versions

if TYPE_CHECKING:
    from .engine import EngineOutput

log = logging.getLogger(__name__)

#: Most bytes of results and dead letters in one FINISH call (Redis takes values up to
#: 512 MiB; smaller calls also keep one huge result from delaying many small ones).
FINISH_BATCH_BYTES = 64 << 20

# Redis' Lua cmsgpack reads str, not bin: pack bytes as str.
_pack = msgpack.Packer(use_bin_type=False).pack


def batch_rows(sizes: list[int], max_bytes: int) -> int:
    """How many of the next rows (of ``sizes`` bytes) one FINISH call takes: as many as fit in
    ``max_bytes``, and the first row always.

    >>> batch_rows([10, 10, 10], 25), batch_rows([100, 1], 25), batch_rows([], 25)
    (2, 1, 0)
    """
    total = 0
    for n, size in enumerate(sizes):
        total += size
        if n and total > max_bytes:
            return n
    return len(sizes)


class _Finish(NamedTuple):
    """One pending FINISH: a result and/or a dead letter for one stream entry."""

    stream: str
    eid: bytes
    job_id: str  # '' unless the id is recorded (caller-chosen): FINISH forgets it
    reply: str | None
    result: bytes
    dead_letter: bytes
    counter: str
    latency_ms: float | None = None
    for_job: str = ""  # the job's id, whether recorded or not (to tell its submitter)


class Finisher:
    """Turns outcomes into FINISH rows (:meth:`complete`, :meth:`fail`, :meth:`fail_entry`)
    and sends them (:meth:`run`, one task)."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self._ctx = ctx
        #: Rows not recorded yet, oldest first.
        self.rows: list[_Finish] = []
        self._wakeup = asyncio.Event()
        self._result_keys: dict[tuple[int, str], str] = {}  # (shard, producer id) -> its result stream

    def __len__(self) -> int:
        return len(self.rows)

    def eids(self) -> Iterator[bytes]:
        """Entries whose outcome is not recorded yet."""
        return (f.eid for f in self.rows)

    # -- outcomes -> rows --------------------------------------------------------------------
    def complete(self, held: JobInHand, out: EngineOutput) -> None:
        """Record the result of a job that ran; one over ``max_result_bytes`` fails it with
        :class:`~rollq.errors.ResultTooLarge` instead."""
        ctx, job = self._ctx, held.job
        now = time.time()
        # The last version that made a token: a version swapped in after the last token of
        # every sample made none, and the result does not claim it.
        end = mark_versions(out.samples, held.version_start, held.swaps) if held.swaps else held.version_start
        data = encode_result(Result(
            id=job.id, samples=out.samples, prompt_tokens=out.prompt_tokens,
            version_start=held.version_start, version_end=end, replica=ctx.id,
            submitted=job.submitted, started=held.started, finished=now,
            deliveries=held.deliveries, meta=job.meta,
            prompt_ids=out.prompt_ids, prompt_lps=out.prompt_logprobs,
        ))
        limit = ctx.settings.max_result_bytes
        if len(data) > limit:
            n_tok = sum(len(s.tokens) // 4 for s in out.samples)
            self.fail(held, Failure(
                ResultTooLarge,
                f"the result ({len(out.samples)} samples, {n_tok} tokens) is {len(data)} bytes encoded, over "
                f"ConsumerSettings.max_result_bytes={limit}; lower n, max_tokens or logprobs"))
            return
        self._queue(_Finish(held.stream, held.eid, job.id if job.tracked else "", job.reply, data, b"", "completed",
                            (now - job.submitted) * 1000, job.id))
        lag = ctx.counters.lag
        n = ctx.version - held.version_start
        lag[n] = lag.get(n, 0) + 1

    def fail(self, held: JobInHand, failure: Failure) -> None:
        """Finish a job in hand with an error result (and a dead letter, if ``failure`` says so)."""
        job, now = held.job, time.time()
        result = self._error_result(failure, job.id, held.deliveries, now, job.submitted, held.started, job.meta)
        dead = self._dead_letter(held.stream, held.eid, held.deliveries, job.id, failure, now) if failure.dead_letter else b""
        self._queue(_Finish(held.stream, held.eid, job.id if job.tracked else "", job.reply, result, dead, "failed",
                            None, job.id))

    def fail_entry(self, stream: str, eid: bytes, deliveries: int, failure: Failure,
                   job_id: str | None = None, reply: str | None = None) -> None:
        """Finish a stream entry that holds no decodable job: an error result where its id and
        reply could still be read, and the dead letter if ``failure`` asks for one. A recorded
        id under ``job_id`` is forgotten (whether it was recorded cannot be read)."""
        now = time.time()
        result = self._error_result(failure, job_id, deliveries, now) if job_id is not None and reply is not None else b""
        dead = self._dead_letter(stream, eid, deliveries, job_id, failure, now) if failure.dead_letter else b""
        self._queue(_Finish(stream, eid, job_id or "", reply, result, dead, "failed", None, job_id or ""))

    def _error_result(self, failure: Failure, job_id: str, deliveries: int, now: float, submitted: float = 0.0,
                      started: float = 0.0, meta: Any = None) -> bytes:
        ctx = self._ctx
        return encode_result(Result(
            id=job_id, error=ErrorInfo(type=failure.error.__name__, message=failure.message), replica=ctx.id,
            version_start=ctx.version, version_end=ctx.version, submitted=submitted, started=started,
            finished=now, deliveries=deliveries, meta=meta,
        ))

    def _dead_letter(self, stream: str, eid: bytes, deliveries: int, job_id: str | None, failure: Failure,
                     now: float) -> bytes:
        ctx = self._ctx
        payload = failure.payload
        log.warning("dead-lettered entry %s of %s (job %s): %s", eid, stream, short(job_id), cut(failure.message))
        return encode_dead_letter(DeadLetter(
            job_id=job_id, reason=failure.message, error_type=failure.error.__name__, consumer=ctx.id,
            deliveries=deliveries, at=now, source=stream,
            payload=payload[: ctx.settings.dlq_payload_bytes], payload_bytes=len(payload),
        ))

    def _queue(self, row: _Finish) -> None:
        self.rows.append(row)
        self._wakeup.set()

    # -- rows -> Redis -----------------------------------------------------------------------
    async def run(self) -> None:
        """Write outcomes in batches: one FINISH call per flush, retried until Redis takes it."""
        ctx = self._ctx
        s = ctx.settings
        backoff = s.backoff_initial
        while not ctx.closed:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.rows:
                batch = self._next_batch()
                try:
                    flags = await asyncio.shield(self._call(batch))
                    backoff = s.backoff_initial
                except RETRYABLE as e:
                    ctx.counters.reconnects += 1
                    log.warning("could not record %d results (%s); retrying in %.2fs", len(batch), e, backoff)
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, s.backoff_max)
                    continue
                except ResponseError as e:
                    # Redis refused the call (a value over its limits, out of memory): record
                    # the rows one at a time, so only the one it refuses fails.
                    sent = batch
                    batch, flags = await self._one_by_one(batch, e)
                    self._drop(sent)
                    self._account(batch, flags)
                    ctx.room.set()
                    continue
                self._drop(batch)
                self._account(batch, flags)
                ctx.room.set()

    async def drain(self, timeout: float) -> None:
        """Wake the sender and wait (at most ``timeout``) until every row is recorded."""
        self._wakeup.set()
        until = time.monotonic() + timeout
        while self.rows and time.monotonic() < until:
            await asyncio.sleep(0.02)

    def _next_batch(self) -> list[_Finish]:
        """The rows of the next FINISH call: the oldest ones, all of the oldest row's shard."""
        ctx = self._ctx
        rows = self.rows[: max(ctx.settings.batch, 256)]
        if len(ctx.shards) > 1:
            shard_of = ctx.shards.of_key
            shard = shard_of(rows[0].stream)
            rows = [f for f in rows if shard_of(f.stream) is shard]
        n = batch_rows([len(f.result) + len(f.dead_letter) for f in rows], FINISH_BATCH_BYTES)
        return rows[:n]

    def _drop(self, batch: list[_Finish]) -> None:
        """Forget the rows of ``batch`` (recorded or refused): the oldest rows, unless the
        batch was picked from one shard among several."""
        rows = self.rows
        n = len(batch)
        if n and rows[n - 1] is batch[-1] and rows[0] is batch[0]:
            del rows[:n]  # a prefix (one shard's rows are in order, so first and last suffice)
        else:
            sent = {id(f) for f in batch}
            self.rows = [f for f in rows if id(f) not in sent]

    async def _one_by_one(self, batch: list[_Finish], error: Exception) -> tuple[list[_Finish], list[int]]:
        """Record ``batch`` row by row after Redis refused it whole. A row it refuses alone
        is recorded as an error result instead (``ResultTooLarge``, with Redis' reply), so
        no result waits behind it. Returns the rows as recorded and their FINISH flags."""
        rows, flags = [], []
        for f in batch:
            row, flag = await self._finish_row(f)
            rows.append(row)
            flags.append(flag)
        log.warning("recorded %d of %d results one by one after Redis refused them together: %s",
                    sum(flags), len(batch), cut(str(error)))
        return rows, flags

    async def _finish_row(self, f: _Finish) -> tuple[_Finish, int]:
        ctx = self._ctx
        backoff = ctx.settings.backoff_initial
        for attempt in range(2):
            while True:
                try:
                    return f, (await asyncio.shield(self._call([f])))[0]
                except RETRYABLE:
                    if ctx.closed:
                        return f, 0
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, ctx.settings.backoff_max)
                except ResponseError as e:
                    refused = e
                    break
            if attempt:
                log.error("Redis refused to finish entry %s even with an error result (%s); it stays pending",
                          f.eid, cut(str(refused)))
                return f, 0
            log.warning("Redis refused the result of job %s (%d bytes): %s", short(f.for_job), len(f.result),
                        cut(str(refused)))
            err = encode_result(Result(
                id=f.for_job, error=ErrorInfo(type=ResultTooLarge.__name__, message=cut(
                    f"Redis refused to store the result ({len(f.result)} bytes): {refused}")),
                replica=ctx.id, version_start=ctx.version, version_end=ctx.version, finished=time.time(),
            )) if f.result and f.for_job else b""
            f = f._replace(result=err, dead_letter=b"", counter="failed", latency_ms=None)
        return f, 0

    def _result_key(self, shard: QueueKeys, reply: str) -> str:
        k = self._result_keys.get((shard.shard_index, reply))
        if k is None:
            if len(self._result_keys) > 10_000:
                self._result_keys.clear()
            k = self._result_keys[shard.shard_index, reply] = shard.results(reply)
        return k

    async def _call(self, batch: list[_Finish]) -> list[int]:
        """One FINISH call for ``batch`` (rows of one shard): the rows in one msgpack argument,
        and the results of each producer packed here as the value of its one result entry
        (see finish.lua)."""
        ctx = self._ctx
        shard = ctx.shards.of_key(batch[0].stream) if len(ctx.shards) > 1 else ctx.keys
        keys = [shard.ids, shard.stats, shard.dlq]
        index: dict[str, int] = {}
        packs: dict[int, list[bytes]] = {}
        rows = []
        for stream, eid, job_id, reply, result, dead, counter, _, _ in batch:
            si = index.get(stream)
            if si is None:
                keys.append(stream)
                si = index[stream] = len(keys)
            ri = 0
            if reply and result:
                rk = self._result_key(shard, reply)
                ri = index.get(rk)
                if ri is None:
                    keys.append(rk)
                    ri = index[rk] = len(keys)
                    packs[ri] = [result]
                else:
                    packs[ri].append(result)
            rows.append((si, eid, job_id, ri, "", dead, counter))
        args: list[Any] = [GROUP, int(ctx.settings.result_ttl * 1000), ctx.settings.dlq_maxlen, _pack(rows)]
        for ri, results in packs.items():
            args.append(ri)
            args.append(results[0] if len(results) == 1 else _pack(results))
        async with deadline(ctx.redis_settings.command_timeout, f"recording {len(batch)} results"):
            return await FINISH(ctx.finish_redis, keys, args)

    def _account(self, batch: list[_Finish], flags: list[int]) -> None:
        c = self._ctx.counters
        buckets = c.latency_buckets
        completed = failed = dead = 0
        for f, ok in zip(batch, flags):
            if not ok:
                c.refused_duplicates += 1
                log.info("result for job %s refused: already finished elsewhere", f.job_id or f.eid)
                continue
            if f.counter == "completed":
                completed += 1
            else:
                failed += 1
            if f.dead_letter:
                dead += 1
            if f.latency_ms is not None:
                buckets[latency_bucket(f.latency_ms)] += 1
        if completed:
            c.completed += completed
        if failed:
            c.failed += failed
        if dead:
            c.dead_lettered += dead
