"""The trainer side: submit jobs fire-and-forget, collect results exactly once.

>>> async def main():                                         # doctest: +SKIP
...     async with Producer("redis://127.0.0.1:6379/0", queue="grpo") as p:
...         h = await p.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 32, "n": 8})
...         await p.submit_many([{"prompt": "2+2=", "sampling": {"max_tokens": 4}}] * 100)
...         result = await h                     # or: async for r in p.results(): ...
...         print(result.policy_version, result.samples[0].token_ids)

Results travel through a per-producer stream (``QueueKeys.results``), read with one
blocking XREAD; the producer deletes the entries it has taken, so Redis keeps nothing once
a result is consumed. A producer that restarts with the same ``producer_id`` re-reads
results it had not yet taken.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import Counter, OrderedDict
from typing import Any, AsyncIterator, Iterable, Mapping, Sequence

import msgpack
from redis.exceptions import NoScriptError

from ..connection import CANCEL, DROP_EMPTY, SUBMIT, Client, connect
from ..connection import RETRYABLE as _RETRYABLE
from ..errors import InvalidJob, JobCancelled, JobRejected, QueueFull, StalenessBound, job_error
from ..keys import GROUP, QueueKeys, check_name
from ..protocol import (
    ErrorInfo,
    Job,
    Result,
    decode_result,
    encode_job,
    make_job,
)
from ..settings import DEFAULT_QUEUE, ProducerSettings, RedisSettings

log = logging.getLogger(__name__)

#: Seconds a cancellation mark lives (longer than any job should wait or run).
CANCEL_MARK_TTL = 24 * 3600


class JobHandle:
    """A submitted job. ``await handle`` (or :meth:`result`) gives its :class:`Result`.

    A job that failed raises its :class:`~rollq.errors.JobError` subclass when awaited;
    ``await handle.result(raise_error=False)`` returns the result with ``result.error`` set.
    """

    __slots__ = ("id", "_producer", "_future", "duplicate")

    def __init__(self, job_id: str, producer: Producer, future: asyncio.Future, duplicate: bool = False):
        self.id = job_id
        self._producer = producer
        self._future = future
        #: True when the job id was already queued or running (resubmission was a no-op).
        self.duplicate = duplicate

    def done(self) -> bool:
        return self._future.done()

    async def result(self, timeout: float | None = None, *, raise_error: bool = True) -> Result:
        """Wait for the result (at most ``timeout`` seconds; TimeoutError after that)."""
        try:
            res = await asyncio.wait_for(asyncio.shield(self._future), timeout)
        finally:
            if self._future.done():
                self._producer._consume(self.id)
        if raise_error and res.error is not None:
            raise job_error(res.error.type, res.error.message, self.id)
        return res

    def __await__(self):
        return self.result().__await__()

    async def cancel(self) -> bool:
        """Cancel the job (queued: it never runs; running: its engine request is aborted)."""
        return await self._producer.cancel(self.id)

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"JobHandle({self.id!r}, {state})"


JobSpec = Mapping[str, Any]


class Producer:
    """Submits jobs to one queue and receives their results.

    Args:
        url: Redis URL (``$ROLLQ_REDIS_URL`` if None); ``redis+cluster://`` for Redis Cluster.
        queue: queue name.
        producer_id: stable name to re-read undelivered results after a restart (random
            if None).
        settings: :class:`~rollq.settings.ProducerSettings`.
    """

    def __init__(
        self,
        url: str | RedisSettings | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        producer_id: str | None = None,
        settings: ProducerSettings | None = None,
    ):
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.keys = QueueKeys(queue)
        self.queue = queue
        self.id = check_name("producer", producer_id or f"p-{uuid.uuid4().hex[:12]}")
        self.settings = settings or ProducerSettings()
        self._result_key = self.keys.results(self.id)
        self._seq = 0
        self._prefix = f"{self.id}-{os.getpid():x}-"
        self._client: Client | None = None
        self._reader_client: Client | None = None
        self._reader: asyncio.Task | None = None
        self._futures: dict[str, asyncio.Future] = {}
        self._completed: OrderedDict[str, Result] = OrderedDict()
        self._cancelled: set[str] = set()
        self._entries: dict[str, tuple[str, bytes, bool]] = {}
        self._publisher: Any = None  # job id -> (stream, entry id, tracked)
        self._outstanding = 0
        self._room: asyncio.Condition | None = None
        self._arrived: asyncio.Event | None = None
        self._closed = False
        self._reader_error: BaseException | None = None
        #: Cumulative counters (submitted, duplicates, results).
        self.counters = {"submitted": 0, "duplicates": 0, "results": 0}

    # -- lifecycle -----------------------------------------------------------------------
    async def connect(self) -> Producer:
        if self._client is None:
            self._client = connect(self.redis_settings)
            self._reader_client = connect(self.redis_settings, socket_timeout=None)
            self._room = asyncio.Condition()
            self._arrived = asyncio.Event()
            await self._client.ping()
            self._reader = asyncio.create_task(self._read_results(), name=f"rollq-results-{self.id}")
        return self

    async def close(self) -> None:
        """Stop reading results and close connections (outstanding jobs keep running)."""
        self._closed = True
        if self._publisher is not None:
            await self._publisher.close()
        if self._client is not None and not self._futures:
            try:  # nothing more can arrive for us: leave no empty stream behind
                await DROP_EMPTY(self._client, [self._result_key], [])
            except _RETRYABLE:
                pass
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        for c in (self._client, self._reader_client):
            if c is not None:
                await c.aclose()
        self._client = self._reader_client = None

    async def __aenter__(self) -> Producer:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def outstanding(self) -> int:
        """Jobs submitted whose results have not been consumed yet."""
        return self._outstanding

    # -- submission ----------------------------------------------------------------------
    def _next_id(self) -> str:
        self._seq += 1
        return f"{self._prefix}{self._seq:x}"

    def build_job(self, spec: JobSpec | None = None, /, **kw: Any) -> Job:
        """Validate and build a :class:`~rollq.protocol.Job` from user-facing fields.

        Fields: ``prompt`` (text) | ``prompt_token_ids`` | ``messages``; ``sampling``;
        ``id``; ``replica``; ``min_version``; ``deadline`` or ``timeout``; ``meta``.
        """
        f = dict(spec or (), **kw)
        if not _SPEC_FIELDS.issuperset(f):
            raise InvalidJob(f"unknown job field(s) {sorted(set(f) - _SPEC_FIELDS)}; allowed: {sorted(_SPEC_FIELDS)}")
        given = f.pop("id", None)
        return make_job(
            id=str(given) if given is not None else self._next_id(), reply=self.id,
            max_prompt_bytes=self.settings.max_prompt_bytes, tracked=given is not None, **f,
        )

    async def submit(self, prompt: str | None = None, /, **kw: Any) -> JobHandle:
        """Submit one job; returns immediately with its handle."""
        if prompt is not None:
            kw["prompt"] = prompt
        return (await self.submit_many([kw]))[0]

    async def submit_many(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        """Submit a batch: one pipelined round trip per ``chunk_size`` jobs.

        Validation of the next chunk overlaps Redis' work on the previous one. Everything is
        validated before its chunk is sent; a chunk that fails validation raises and is not
        sent (earlier chunks were).
        """
        await self.connect()
        handles: list[JobHandle] = []
        chunk = self.settings.chunk_size
        it = iter(specs)
        inflight: asyncio.Task | None = None
        try:
            while True:
                batch = [s if isinstance(s, Job) else self.build_job(s) for s in itertools.islice(it, chunk)]
                if inflight is not None:
                    handles.extend(await inflight)
                    inflight = None
                if not batch:
                    return handles
                inflight = asyncio.ensure_future(self._submit_chunk(batch))
                await asyncio.sleep(0)  # let it write its pipeline before we build the next chunk
        finally:
            if inflight is not None and not inflight.done():
                await asyncio.shield(inflight)

    async def _reserve(self, n: int) -> None:
        cap = self.settings.max_outstanding
        if n > cap:
            raise QueueFull(f"a batch of {n} jobs exceeds max_outstanding={cap}; submit smaller batches")
        if self._outstanding + n <= cap:
            self._outstanding += n
            return
        if not self.settings.block_when_full:
            raise QueueFull(
                f"{self._outstanding} jobs outstanding, cap is {cap} (ProducerSettings.max_outstanding); "
                "consume results or set block_when_full=True"
            )
        assert self._room is not None
        async with self._room:
            await self._room.wait_for(lambda: self._outstanding + n <= cap)
            self._outstanding += n

    async def _release(self, n: int) -> None:
        self._outstanding -= n
        if self._room is not None:
            async with self._room:
                self._room.notify_all()

    async def _submit_chunk(self, jobs: list[Job]) -> list[JobHandle]:
        await self._reserve(len(jobs))
        loop = asyncio.get_running_loop()
        calls: list[tuple[list[str], list[Any], int]] = []  # (keys, args, jobs) per script call
        by_stream: dict[str, list[Any]] = {}
        order: dict[str, list[Job]] = {}
        for job in jobs:
            stream = self.keys.job_stream(job.replica)
            args = by_stream.setdefault(stream, [])
            args.append(job.id if job.tracked else "")
            args.append(encode_job(job))
            order.setdefault(stream, []).append(job)
        step = 2 * self.settings.script_batch
        call_jobs: list[list[Job]] = []
        for stream, args in by_stream.items():
            keys = self.keys.submit_keys(stream)
            for i in range(0, len(args), step):
                part = args[i : i + step]
                # One msgpack argument per call: far cheaper to send than 2 arguments per job.
                calls.append((keys, [msgpack.packb(part, use_bin_type=False), self.id], len(part) // 2))
                call_jobs.append(order[stream][i // 2 : (i + step) // 2])
        dups: list[bytes] = []
        foreign: dict[str, str] = {}  # duplicate ids queued by another producer -> its id
        sent = 0
        try:
            pending = list(zip(calls, call_jobs))
            while pending:
                results = await self._run_scripts([c for c, _ in pending])
                refused = []
                for (call, cjobs), (skipped, was_refused, limit, eids, owners) in zip(pending, results):
                    if was_refused:
                        refused.append((call, cjobs))
                    else:
                        dups.extend(skipped)
                        for jid, owner in zip(skipped, owners):
                            if owner is not None and owner.decode() != self.id:
                                foreign[jid.decode()] = owner.decode()
                        sent += call[2]
                        stream = call[0][0]
                        for job, eid in zip(cjobs, eids):
                            if eid:
                                self._entries[job.id] = (stream, eid, job.tracked)
                if refused:
                    await self._wait_for_admission(sum(c[2] for c, _ in refused), limit)
                pending = refused
        except BaseException:
            await self._release(len(jobs) - sent)  # what was enqueued runs; the rest was not sent
            raise
        # Within a call the first occurrence of an id is enqueued, repeats are skipped (and
        # all occurrences are skipped if the id was already queued): mark the last ones.
        accepted_left: dict[bytes, int] = {}
        if dups:
            skipped_left = Counter(dups)
            occurrences = Counter(job.id.encode() for job in jobs if job.tracked)
            accepted_left = {k: occurrences[k] - skipped_left[k] for k in skipped_left}
        handles = []
        for job in jobs:
            dup = False
            if accepted_left and (key := job.id.encode()) in accepted_left:
                if accepted_left[key] > 0:
                    accepted_left[key] -= 1
                else:
                    dup = True
            fut = self._futures.get(job.id)
            if fut is None:
                fut = loop.create_future()
                self._futures[job.id] = fut
            elif dup:  # resubmitted while ours is still outstanding: do not double count
                await self._release(1)
            if dup and job.id in foreign and not fut.done():
                # Queued by another producer: its result goes there, never here.
                fut.set_result(Result(id=job.id, error=ErrorInfo(
                    type=JobRejected.__name__,
                    message=f"job id {job.id!r} is already queued or running for producer {foreign[job.id]!r}, "
                            "which receives its result; this submission was a no-op",
                )))
                self._completed[job.id] = fut.result()
            handles.append(JobHandle(job.id, self, fut, duplicate=dup))
        self.counters["submitted"] += len(jobs) - len(dups)
        self.counters["duplicates"] += len(dups)
        return handles

    async def _run_scripts(self, calls: list[tuple[list[str], list[Any], int]]) -> list[Any]:
        """Run SUBMIT calls in one pipeline (one round trip), loading the script if needed."""
        for attempt in (0, 1):
            pipe = self._client.pipeline(transaction=False)
            for keys, args, _ in calls:
                pipe.evalsha(SUBMIT.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in results):
                break
            # A missing script fails every call before it runs: load it and send them again.
            await SUBMIT.ensure_loaded(self._client)
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    async def _wait_for_admission(self, n: int, limit: int) -> None:
        """The staleness bound refused ``n`` jobs: wait for a newer policy version, or raise."""
        if not self.settings.block_when_full:
            raise StalenessBound(
                f"admitting {n} more jobs would exceed the staleness bound ({limit} jobs at the current "
                "policy version; see Producer.set_staleness_bound); publish a newer version or wait"
            )
        await asyncio.sleep(self.settings.admission_poll)

    async def set_staleness_bound(self, max_lag: int | None, batch: int | None = None) -> None:
        """Bound off-policy lag for this queue: at most ``(max_lag + version + 1) * batch`` jobs
        are ever admitted (AReaL's rule), checked atomically at submission. ``None`` removes it.
        ``batch`` is the number of jobs the trainer consumes per policy version."""
        await self.connect()
        if max_lag is None:
            await self._client.hdel(self.keys.config, "max_lag", "batch")
            return
        if batch is None or batch < 1 or max_lag < 0:
            raise ValueError("set_staleness_bound needs max_lag >= 0 and batch >= 1")
        await self._client.hset(self.keys.config, mapping={"max_lag": max_lag, "batch": batch})

    async def publish_weights(self, state: Any, version: int | None = None, transport: str = "memmap", **publisher_kwargs: Any) -> Any:
        """Publish a new policy version of this queue (see
        :class:`~rollq.weightsync.publisher.WeightPublisher`; ``root=`` names the memmap store,
        ``sender=`` a broadcast sender, on the first call). Returns the committed record."""
        if self._publisher is None:
            from ..weightsync.publisher import WeightPublisher

            self._publisher = WeightPublisher(self.redis_settings, self.queue, trainer_id=self.id, **publisher_kwargs)
        return await self._publisher.publish_weights(state, version=version, transport=transport)

    async def set_update_policy(self, policy: str) -> None:
        """How replicas of this queue apply a new policy version: ``keep``, ``abort`` or ``drain``."""
        if policy not in ("keep", "abort", "drain"):
            raise ValueError("update policy must be 'keep', 'abort' or 'drain'")
        await self.connect()
        await self._client.hset(self.keys.config, "update_policy", policy)

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job by id. Returns False if it is no longer queued or running."""
        await self.connect()
        fut = self._futures.get(job_id)
        known = fut is not None and not fut.done()
        stream, eid, tracked = self._entries.get(job_id, (self.keys.jobs, b"0-0", True))
        how = await CANCEL(
            self._client, [stream, self.keys.cancel(job_id), self.keys.ids, self.keys.stats],
            [eid, job_id, self.keys.control, CANCEL_MARK_TTL, GROUP, "1" if tracked else "0"],
        )
        if how == 1:
            self._entries.pop(job_id, None)
        if fut is not None and not fut.done():
            if how != 1:  # it was delivered: a (cancelled) result is still to come; drop it then
                self._cancelled.add(job_id)
            fut.set_result(
                Result(id=job_id, error=ErrorInfo(type=JobCancelled.__name__, message="cancelled by the submitter"))
            )
            self._consume(job_id)  # the caller knows: its room is free now
        return known

    # -- results -------------------------------------------------------------------------
    async def _read_results(self) -> None:
        """Read the result stream; resolve handles; delete what was taken.

        The deletion of one batch travels in the same round trip as the next blocking read.
        """
        assert self._reader_client is not None and self._arrived is not None
        last = b"0-0"
        backoff = 0.05
        count = self.settings.result_batch
        taken: list[bytes] = []
        while not self._closed:
            try:
                pipe = self._reader_client.pipeline(transaction=False)
                if taken:
                    pipe.xdel(self._result_key, *taken)
                pipe.xread({self._result_key: last}, count=count, block=1000)
                resp = (await pipe.execute())[-1]
                taken = []
                backoff = 0.05
            except _RETRYABLE as e:
                log.warning("result stream read failed (%s); retrying in %.2fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if not resp:
                continue
            entries = resp[0][1]
            for eid, fields in entries:
                taken.append(eid)
                try:
                    one = fields.get(b"d")
                    for data in ([one] if one is not None else msgpack.unpackb(fields[b"b"], raw=True)):
                        self._deliver(decode_result(data))
                except Exception as e:  # a corrupt result must not stop the reader
                    log.error("dropping unreadable result entry %s: %s", eid, e)
            last = taken[-1]
            self._arrived.set()

    def _deliver(self, res: Result) -> None:
        self.counters["results"] += 1
        self._entries.pop(res.id, None)
        if res.id in self._cancelled:  # its handle already holds JobCancelled
            self._cancelled.discard(res.id)
            return
        fut = self._futures.get(res.id)
        if fut is not None and fut.done():
            return  # a duplicate of what we already hold (cannot happen with one finisher)
        if fut is None:  # a result of a previous incarnation of this producer
            fut = asyncio.get_running_loop().create_future()
            self._futures[res.id] = fut
            self._outstanding += 1
        fut.set_result(res)
        self._completed[res.id] = res

    def _consume(self, job_id: str, already_removed: bool = False) -> None:
        """A result was taken by its handle or by results(): forget it, free room."""
        if self._futures.pop(job_id, None) is None and not already_removed:
            return
        self._completed.pop(job_id, None)
        self._outstanding -= 1
        if self._room is not None:
            room = self._room

            async def notify() -> None:
                async with room:
                    room.notify_all()

            asyncio.get_running_loop().create_task(notify())

    async def results(self, *, timeout: float | None = None, raise_error: bool = False) -> AsyncIterator[Result]:
        """Results as they complete, each once (also ones no handle was awaited for).

        Stops after ``timeout`` seconds without a new result (never, by default). With
        ``raise_error`` a failed job raises its JobError instead of being yielded.
        """
        await self.connect()
        assert self._arrived is not None
        while True:
            while self._completed:
                job_id, res = self._completed.popitem(last=False)
                self._consume(job_id, already_removed=True)
                if raise_error and res.error is not None:
                    raise job_error(res.error.type, res.error.message, job_id)
                yield res
            self._arrived.clear()
            if self._completed:
                continue
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except asyncio.TimeoutError:
                return

    async def gather(self, handles: Sequence[JobHandle], timeout: float | None = None) -> list[Result]:
        """Results of ``handles`` in order (errors returned, not raised)."""
        return list(
            await asyncio.wait_for(
                asyncio.gather(*(h.result(raise_error=False) for h in handles)), timeout
            )
        )

    async def wait_all(self, timeout: float | None = None) -> list[Result]:
        """Every result of every outstanding job (order of completion)."""
        out: list[Result] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._outstanding > 0:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = False
            async for r in self.results(timeout=left if left is not None else 1.0):
                out.append(r)
                got = True
                if self._outstanding <= 0:
                    break
            if deadline is not None and time.monotonic() >= deadline and self._outstanding > 0:
                raise TimeoutError(f"{self._outstanding} jobs still outstanding after {timeout}s")
            if not got and deadline is None:
                continue
        return out


_SPEC_FIELDS = {"prompt", "prompt_token_ids", "messages", "sampling", "id", "replica", "min_version", "deadline", "timeout", "meta"}
