"""The trainer side: submit jobs fire-and-forget, collect results exactly once.

>>> async def main():                                         # doctest: +SKIP
...     async with Producer("redis://127.0.0.1:6379/0", queue="grpo") as p:
...         h = await p.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 32, "n": 8})
...         await p.submit_many([{"prompt": "2+2=", "sampling": {"max_tokens": 4}}] * 100)
...         result = await h                     # or: async for r in p.results(): ...
...         print(result.policy_version, result.samples[0].token_ids)

Submission is idempotent: every SUBMIT call carries a per-producer call number, and Redis keeps
the reply of each call whose reply the producer has not read yet (``QueueKeys.submit_calls``), so
a call resent after a cut connection replays its reply instead of enqueuing its jobs again.

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
import struct
import time
import uuid
import weakref
from collections import Counter, OrderedDict, deque
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence

import msgpack
import msgspec
from redis.exceptions import NoScriptError, ResponseError

from ..connection import CANCEL, DROP_EMPTY, SUBMIT, Client, connect, deadline, raw_replies
from ..connection import RETRYABLE as _RETRYABLE
from ..errors import InvalidJob, JobCancelled, JobRejected, QueueFull, StalenessBound, SubmitInterrupted, job_error
from ..keys import GROUP, QueueKeys, check_name
from ..protocol import (
    ErrorInfo,
    Job,
    Result,
    decode_result,
    encode_job,
    i32_packer,
    job_from_spec,
    score_spec,
    short,
    validated_sampling,
)
from ..registry import register_queue
from ..settings import DEFAULT_QUEUE, ProducerSettings, RedisSettings

log = logging.getLogger(__name__)

#: Seconds a cancellation mark lives (longer than any job should wait or run).
CANCEL_MARK_TTL = 24 * 3600
#: Milliseconds a producer's SUBMIT call records live after its last call (a dead producer
#: leaves nothing; a live one deletes them on close).
CALL_RECORD_TTL_MS = 3600 * 1000
#: Results remembered as taken, to drop a second result for the same job id (two generations
#: of this many ids each).
DELIVERED_MEMORY = 1 << 16
#: Backoff between resends while Redis is unreachable: first delay and cap, in seconds.
RESEND_BACKOFF = (0.005, 0.5)


class JobHandle(msgspec.Struct, gc=False, eq=False):
    """A submitted job. ``await handle`` (or :meth:`result`) gives its :class:`Result`.

    A job that failed raises its :class:`~rollq.errors.JobError` subclass when awaited;
    ``await handle.result(raise_error=False)`` returns the result with ``result.error`` set.
    The handle keeps its result once it arrived (also when :meth:`Producer.results` took it).

    Handles are made by :meth:`Producer.submit_many` (a batch makes thousands). They are
    compact structs that the garbage collector does not track (``gc=False``): they refer to
    their producer weakly (one shared weakref), so they form no reference cycle, and
    thousands of live handles add nothing to every collection's work.
    """

    id: str
    #: The producer, weakly (``Producer._ref``).
    _producer: Any
    #: (stream, entry id, id recorded) while the job is queued: what cancel() removes.
    _entry: tuple[str, bytes, bool] | None = None
    #: True when the job id was already queued or running (resubmission was a no-op).
    duplicate: bool = False
    _result: Result | None = None
    #: One future per task waiting for the result.
    _waiters: list[asyncio.Future] | None = None
    #: A duplicate's handle points at the handle of the same outstanding job.
    _twin: JobHandle | None = None

    def done(self) -> bool:
        return (self._twin or self)._result is not None

    def _set(self, res: Result) -> None:
        if self._result is None:
            self._result = res
            waiters, self._waiters = self._waiters, None
            for w in waiters or ():
                if not w.done():
                    w.set_result(res)

    async def _wait(self, timeout: float | None) -> Result:
        # A future per waiting task: a wait that times out or is cancelled takes only its
        # own future with it, and the result wakes the waiter directly (no shield hops).
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            if timeout is None:
                return await waiter
            async with asyncio.timeout(timeout):
                return await waiter
        finally:
            if not waiter.done() or waiter.cancelled():
                try:
                    self._waiters.remove(waiter)  # type: ignore[union-attr]
                except (AttributeError, ValueError):
                    pass

    async def result(self, timeout: float | None = None, *, raise_error: bool = True) -> Result:
        """Wait for the result (at most ``timeout`` seconds; TimeoutError after that)."""
        target = self._twin or self
        res = target._result
        if res is None:
            res = await target._wait(timeout)
        producer = self._producer()
        if producer is not None:
            producer._consume(self.id, res)
        if raise_error and res.error is not None:
            raise job_error(res.error.type, res.error.message, self.id)
        return res

    def __await__(self):
        return self.result().__await__()

    async def cancel(self) -> bool:
        """Cancel the job (queued: it never runs; running: its engine request is aborted)."""
        producer = self._producer()
        if producer is None:
            raise RuntimeError(f"cannot cancel job {self.id!r}: its producer is gone")
        return await producer.cancel(self.id)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
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
        self._calls_key = self.keys.submit_calls(self.id)
        # SUBMIT call numbers: Redis replays the reply of a number it has run (submit.lua).
        self._incarnation = uuid.uuid4().hex[:12]  # a restart under the same id numbers anew
        self._call_no = 0
        self._unread: dict[int, None] = {}  # numbers sent (or about to be), reply not read; ordered
        self._pinned: set[int] = set()  # ... of calls in doubt, held for SubmitInterrupted.resume()
        self._delivered = _RecentIds(DELIVERED_MEMORY)  # ids whose results were taken
        self._seq = 0
        self._prefix = f"{self.id}-{os.getpid():x}-"
        self._client: Client | None = None
        self._reader_client: Client | None = None
        self._reader: asyncio.Task | None = None
        self._ref = weakref.ref(self)
        self._handles: dict[str, JobHandle] = {}  # outstanding jobs (result not consumed yet)
        self._completed: OrderedDict[str, Result] = OrderedDict()  # arrived, not consumed yet
        self._orphans: dict[str, Result] = {}  # results that arrived before any handle
        self._cancelled: set[str] = set()
        self._publisher: Any = None
        self._outstanding = 0
        self._room: asyncio.Event | None = None  # set when outstanding jobs were consumed
        self._room_waiters = 0
        self._arrived: asyncio.Event | None = None
        self._closed = False
        self._reader_error: BaseException | None = None
        #: Cumulative counters (submitted, duplicates, results, second results dropped, resends).
        self.counters = {"submitted": 0, "duplicates": 0, "results": 0, "duplicate_results": 0, "resends": 0}

    # -- lifecycle -----------------------------------------------------------------------
    async def connect(self) -> Producer:
        if self._client is None:
            # No socket timeouts: calls are bounded by deadline() (see rollq.connection). No
            # health checks either: they cost a PING before the handshake of every new
            # connection, and these clients bound every call and reconnect on errors.
            self._client = connect(self.redis_settings, socket_timeout=None, health_check_interval=0)
            self._reader_client = connect(self.redis_settings, socket_timeout=None, health_check_interval=0)
            self._room = asyncio.Event()
            self._arrived = asyncio.Event()
            raw_replies(self._reader_client, "XREAD")
            # The reader connects while the first round trip waits: two handshakes in the
            # time of one. That round trip registers the queue (rollq status and the
            # dashboard list it), once per connect, never on the submit path.
            self._reader = asyncio.create_task(self._read_results(), name=f"rollq-results-{self.id}")
            try:
                async with self._deadline("connecting (registering the queue)"):
                    await register_queue(self._client, self.queue)
            except BaseException:  # unreachable: leave nothing behind, a later connect() retries
                self._reader.cancel()
                for c in (self._client, self._reader_client):
                    await c.aclose()
                self._client = self._reader_client = self._reader = None
                raise
        return self

    async def close(self) -> None:
        """Stop reading results and close connections (outstanding jobs keep running)."""
        self._closed = True
        if self._publisher is not None:
            await self._publisher.close()
        if self._client is not None and not self._handles:
            try:  # nothing more can arrive for us: leave no empty stream behind
                async with self._deadline("removing the empty result stream"):
                    await DROP_EMPTY(self._client, [self._result_key], [])
            except _RETRYABLE:
                pass
        if self._client is not None and self._call_no and self._pinned.issuperset(self._unread):
            try:  # no call in flight: its records can go (else they expire: CALL_RECORD_TTL_MS)
                async with self._deadline("removing the submit call records"):
                    await self._client.delete(self._calls_key)
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
        f = spec if not kw else {**(spec or {}), **kw}
        if f is None:
            f = {}
        if not _SPEC_FIELDS.issuperset(f):
            raise InvalidJob(f"unknown job field(s) {sorted(set(f) - _SPEC_FIELDS)}; allowed: {sorted(_SPEC_FIELDS)}")
        given = f.get("id")
        if given is None:
            return job_from_spec(f, self._next_id(), self.id, self.settings.max_prompt_bytes)
        return job_from_spec(f, str(given), self.id, self.settings.max_prompt_bytes, tracked=True)

    def build_jobs(self, specs: Iterable[JobSpec | Job]) -> list[Job]:
        """:meth:`build_job` for each spec (a :class:`Job` is taken as it is): the same jobs and
        the same refusals, with the common shape ``{"prompt_token_ids": [...], "sampling": sp}``
        built inline (one loop, sampling params validated once per distinct object)."""
        jobs: list[Job] = []
        append = jobs.append
        build = self.build_job
        prefix, reply, limit = self._prefix, self.id, self.settings.max_prompt_bytes
        now = time.time
        sp_in: Any = _NOTHING
        sp = None
        n_last = -1
        packer: Any = None
        seq = self._seq
        try:
            for s in specs:
                if type(s) is dict and len(s) == 2 and "sampling" in s:
                    toks = s.get("prompt_token_ids")
                    if type(toks) is list and toks:
                        if s["sampling"] is not sp_in:  # as job_from_spec: sampling, size, tokens
                            sp = validated_sampling(s["sampling"])
                            sp_in = s["sampling"]
                        n = len(toks)
                        if n != n_last:
                            if limit is not None and 4 * n > limit:
                                raise InvalidJob(f"prompt of {4 * n} bytes exceeds the limit of {limit} bytes")
                            packer, n_last = i32_packer(n), n
                        try:
                            tokens = packer.pack(*toks)
                        except struct.error as e:
                            raise InvalidJob(f"token ids must be integers that fit in int32: {e}") from e
                        seq += 1
                        append(Job(id=f"{prefix}{seq:x}", reply=reply, tokens=tokens, sampling=sp, submitted=now()))
                        continue
                if isinstance(s, Job):
                    append(s)
                else:
                    self._seq = seq
                    append(build(s))
                    seq = self._seq
        finally:
            self._seq = seq
        return jobs

    async def submit(self, prompt: str | None = None, /, **kw: Any) -> JobHandle:
        """Submit one job; returns immediately with its handle.

        A resend after a connection error is idempotent (see :meth:`submit_many`); Redis
        unreachable for ``RedisSettings.command_timeout`` raises SubmitInterrupted (the job in
        ``in_doubt``; ``resume()`` sends it again without doubling it)."""
        if prompt is not None:
            kw["prompt"] = prompt
        job = self.build_job(kw)
        await self.connect()
        return (await self._submit_chunk([job]))[0]

    async def score(self, context: Sequence[int], continuation: Sequence[int], *, timeout: float | None = None, **fields: Any) -> list[float]:
        """The logprob of each token of ``continuation`` after ``context`` (token ids) under
        the weights a replica serves, without sampling it (a scoring job: vLLM's
        ``prompt_logprobs``; see :func:`~rollq.protocol.score_spec`). For many at once,
        ``submit_many(score_spec(...) for ...)`` and read ``result.prompt_logprobs``.

        >>> await p.score([1, 2, 3], [4, 5])            # doctest: +SKIP
        [-6.91, -6.87]
        """
        r = await (await self.submit(**score_spec(context, continuation, **fields))).result(timeout=timeout)
        lps = r.prompt_logprobs or []
        return [float("nan") if x is None else x for x in lps[len(context):]]

    async def submit_many(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        """Submit a batch, pipelined: script calls of ``script_batch`` jobs stream to Redis
        while the next ones are built, ``chunk_size`` jobs in flight at most.

        On one server the batch holds one connection of the pool and writes each call as soon
        as its jobs are built (so Redis runs one call while the next is built and encoded) and
        reads the replies in order; on a cluster, chunks start at ``script_batch`` jobs and
        double up to ``chunk_size``, one pipelined round trip each. Everything is validated
        before its call is sent; a spec that fails validation raises and is not sent (the
        jobs before it were).

        Resends are idempotent (every call is numbered; Redis replays the reply of a number it
        has run), so a connection that fails is replaced and every call whose reply was not
        read is written again, in order, with backoff. If Redis stays unreachable for
        ``RedisSettings.command_timeout`` seconds, :class:`~rollq.errors.SubmitInterrupted`
        says which jobs are enqueued (their handles), which are in doubt and which were never
        sent; its ``resume()`` finishes the batch without doubling any job.
        """
        await self.connect()
        if self.redis_settings.cluster:
            return await self._submit_many_chunks(specs)
        return await self._submit_many_stream(specs)

    async def _submit_many_stream(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        step = max(1, self.settings.script_batch)
        window = max(1, self.settings.chunk_size // step)  # calls whose replies are not read yet
        size = min(step, _FIRST_CALL)  # small first calls: Redis starts while the rest is built
        it = iter(specs)
        build = self.build_jobs
        handles: list[JobHandle] = []
        # Calls written (or about to be) whose replies were not read: their jobs hold room.
        inflight: deque[tuple[list[Job], list[Any], list[bytes]]] = deque()
        reran: list[bool] = []
        pool = self._client.connection_pool
        conn = await pool.get_connection()
        sha = SUBMIT.sha
        outage = _Outage(self.redis_settings.command_timeout)

        async def resend(error: BaseException) -> None:
            # The connection failed: which calls in flight ran is not known. A call that ran
            # replays its reply (call numbers), so write them all again, in order, on a new
            # connection, until Redis has been unreachable for command_timeout (_GaveUp).
            while True:
                await conn.disconnect()
                await outage.wait(error, f"submitting {sum(len(j) for j, _, _ in inflight)} jobs")
                self.counters["resends"] += 1
                try:
                    for _, _, packed in inflight:
                        await conn.send_packed_command(packed, check_health=False)
                    return
                except _RETRYABLE as e:
                    error = e

        async def take() -> None:
            jobs, calls, _ = inflight[0]
            while True:
                try:
                    results = await self._read_replies(conn, calls, reran)
                    break
                except _RETRYABLE as e:
                    await resend(e)
            outage.reset()
            inflight.popleft()
            handles.extend(await self._finish_chunk(jobs, calls, results))

        try:
            while True:
                try:
                    jobs = build(itertools.islice(it, size))
                    if jobs:
                        if inflight and self._outstanding + len(jobs) > self.settings.max_outstanding:
                            # Room comes back as results are consumed, which counts only for
                            # jobs whose replies were read: read them all before waiting.
                            while inflight:
                                await take()
                        await self._reserve(len(jobs))
                except (SubmitInterrupted, _GaveUp):
                    raise
                except Exception:
                    # A spec failed validation, or QueueFull: the jobs before were sent, their
                    # handles are made (the caller gets the error, the jobs run as submitted).
                    while inflight:
                        await take()
                    raise
                if not jobs:
                    break
                size = min(2 * size, step)
                try:
                    calls = self._submit_calls(jobs)
                    packed = conn.pack_commands([("EVALSHA", sha, len(keys), *keys, *args) for keys, args, _ in calls])
                except BaseException:
                    self._release(len(jobs))
                    raise
                inflight.append((jobs, calls, packed))
                try:
                    await conn.send_packed_command(packed, check_health=False)
                except _RETRYABLE as e:
                    await resend(e)
                await asyncio.sleep(0)  # the loop flushes what the socket did not take at once
                if len(inflight) >= window:
                    await take()
                    while reran and inflight:  # NOSCRIPT: the reruns go before anything new
                        await take()
                    reran.clear()
            while inflight:
                await take()
            return handles
        except _GaveUp as e:
            doubt = [(jobs, calls) for jobs, calls, _ in inflight]
            raise self._interrupted(str(e), handles, doubt, [], it) from e.__cause__
        except SubmitInterrupted as e:  # a rerun of refused calls in take() gave up
            e._unpin.detach()  # the new error holds its calls
            doubt = [*e._doubt, *((jobs, calls) for jobs, calls, _ in inflight)]
            raise self._interrupted(str(e), handles + e.enqueued, doubt, e.not_sent, it) from e.__cause__
        finally:
            if inflight:
                for jobs, calls, _ in inflight:  # no reply read: whether Redis ran them is not known
                    self._release(len(jobs))
                    for _, args, _ in calls:
                        if args[3] not in self._pinned:  # nobody resends it: its record may go
                            self._unread.pop(args[3], None)
                await conn.disconnect()  # replies may be left unread: start clean
            await pool.release(conn)

    async def _read_replies(self, conn: Any, calls: list[Any], reran: list[bool]) -> list[Any]:
        """The replies of ``calls``, written on ``conn`` (in order).

        A call that met NOSCRIPT did nothing: it runs again (loading the script) and ``reran``
        says so, for the caller to read every reply in flight before it writes more (the calls
        written after it met NOSCRIPT too, and their reruns keep the submission order)."""
        results = []
        async with self._deadline(f"reading the replies of {sum(len(c[2]) for c in calls)} submitted jobs"):
            for keys, args, _ in calls:
                try:
                    results.append(await conn.read_response())
                except NoScriptError:
                    results.append(await SUBMIT(self._client, keys, args))
                    reran.append(True)
        return results

    async def _submit_many_chunks(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        handles: list[JobHandle] = []
        chunk = min(self.settings.script_batch, self.settings.chunk_size)
        it = iter(specs)
        build = self.build_jobs
        inflight: asyncio.Task | None = None
        batch: list[Job] = []
        try:
            while True:
                batch = build(itertools.islice(it, chunk))
                if inflight is not None:
                    handles.extend(await inflight)
                    inflight = None
                if not batch:
                    return handles
                if len(batch) < chunk and not handles:  # the only chunk: no overlap to gain
                    only, batch = batch, []
                    handles.extend(await self._submit_chunk(only))
                    return handles
                inflight = asyncio.ensure_future(self._submit_chunk(batch))
                batch = []
                await asyncio.sleep(0)  # let it write its pipeline before we build the next chunk
                chunk = min(2 * chunk, self.settings.chunk_size)
        except SubmitInterrupted as e:  # the chunk in flight gave up; ``batch`` was built, not sent
            e._unpin.detach()  # the new error holds its calls
            raise self._interrupted(str(e), handles + e.enqueued, e._doubt, e.not_sent + batch, it) from e.__cause__
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
        self._room_waiters += 1
        try:
            while self._outstanding + n > cap:
                self._room.clear()
                await self._room.wait()
        finally:
            self._room_waiters -= 1
        self._outstanding += n

    def _release(self, n: int) -> None:
        self._outstanding -= n
        if self._room_waiters and self._room is not None:
            self._room.set()

    def _number(self, args: list[Any]) -> None:
        """Give a SUBMIT call (its ``args``) the next call number and the lowest unread one."""
        self._call_no += 1
        unread = self._unread
        unread[self._call_no] = None
        args[3] = self._call_no
        args[4] = next(iter(unread))  # numbers are inserted in order: the first is the lowest

    def _submit_calls(self, jobs: list[Job]) -> list[tuple[list[str], list[Any], list[int] | range]]:
        """SUBMIT calls for ``jobs``: (keys, args, positions of their jobs in ``jobs``), each
        numbered (see submit.lua: args are payloads, producer, incarnation, call number,
        lowest unread call number, TTL of the records)."""
        step = self.settings.script_batch
        number, rec, inc = self._number, self._calls_key, self._incarnation
        if all(job.replica is None and not job.tracked for job in jobs):  # the common case
            keys = [*self.keys.submit_keys(self.keys.jobs), rec]
            payloads = list(map(encode_job, jobs))
            calls = []
            for i in range(0, len(jobs), step):
                part = payloads[i : i + step]
                args: list[Any] = [""] * (2 * len(part))  # '': a generated id, nothing to record
                args[1::2] = part
                call_args = [_pack(args), self.id, inc, 0, 0, CALL_RECORD_TTL_MS]
                number(call_args)
                calls.append((keys, call_args, range(i, i + len(part))))
            return calls
        by_stream: dict[str | None, list[int]] = {}
        delivered = self._delivered
        for i, job in enumerate(jobs):
            pos = by_stream.get(job.replica)
            if pos is None:
                pos = by_stream[job.replica] = []
            pos.append(i)
            if job.tracked and delivered:  # a caller-chosen id may run again: its next result counts
                delivered.discard(job.id)
        calls = []
        for replica, positions in by_stream.items():
            keys = [*self.keys.submit_keys(self.keys.job_stream(replica)), rec]
            for i in range(0, len(positions), step):
                part = positions[i : i + step]
                args: list[Any] = []
                for k in part:
                    job = jobs[k]
                    args.append(job.id if job.tracked else "")
                    args.append(encode_job(job))
                # One msgpack argument per call: far cheaper to send than 2 arguments per job.
                call_args = [_pack(args), self.id, inc, 0, 0, CALL_RECORD_TTL_MS]
                number(call_args)
                calls.append((keys, call_args, part))
        return calls

    async def _submit_chunk(self, jobs: list[Job]) -> list[JobHandle]:
        await self._reserve(len(jobs))
        try:
            calls = self._submit_calls(jobs)
        except BaseException:
            self._release(len(jobs))
            raise
        return await self._finish_chunk(jobs, calls, None)

    async def _finish_chunk(self, jobs: list[Job], pending: list[Any], results: list[Any] | None) -> list[JobHandle]:
        """Run the SUBMIT calls of ``jobs`` (``results``: the replies of a first round already
        sent), again for calls the staleness bound refused, and make the handles. The
        ``len(jobs)`` reserved places are released for jobs that are not sent.

        Raises SubmitInterrupted if Redis stays unreachable (see :meth:`_run_scripts`)."""
        unread = self._unread
        if results is not None and len(pending) == 1 and not self._orphans:
            unread.pop(pending[0][1][3], None)
            skipped, was_refused, _, eids, _ = results[0]
            if not skipped and not was_refused and len(eids) == len(jobs):
                # The common reply: one call (its jobs in order), every job enqueued.
                stream, ref, known = pending[0][0][0], self._ref, self._handles
                handles = [JobHandle(job.id, ref, (stream, eid, job.tracked)) for job, eid in zip(jobs, eids)]
                for h in handles:
                    known[h.id] = h
                self.counters["submitted"] += len(jobs)
                return handles
        entries: list[tuple[str, bytes, bool] | None] = [None] * len(jobs)
        dups: list[bytes] = []
        foreign: dict[str, str] = {}  # duplicate ids queued by another producer -> its id
        read: list[int] = []  # positions of the jobs whose calls' replies were read (not refused)
        try:
            while pending:
                if results is None:
                    results = await self._run_scripts(pending)
                refused = []
                for call, (skipped, was_refused, limit, eids, owners) in zip(pending, results):
                    keys, args, part = call
                    unread.pop(args[3], None)
                    self._pinned.discard(args[3])
                    if was_refused:
                        refused.append(call)
                        continue
                    if skipped:
                        dups.extend(skipped)
                        for jid, owner in zip(skipped, owners):
                            if owner is not None and owner.decode() != self.id:
                                foreign[jid.decode()] = owner.decode()
                    read.extend(part)
                    stream = keys[0]
                    for k, eid in zip(part, eids):
                        if eid:
                            entries[k] = (stream, eid, jobs[k].tracked)
                results = None
                if refused:
                    await self._wait_for_admission(sum(len(c[2]) for c in refused), limit)
                    for _, args, _ in refused:  # a refusal is not recorded: a new number
                        self._number(args)
                pending = refused
        except _GaveUp as e:
            self._release(len(jobs) - len(read))  # what was enqueued runs; the rest is in doubt
            read.sort()
            done = self._make_handles([jobs[k] for k in read], [entries[k] for k in read], dups, foreign)
            raise self._interrupted(str(e), done, [_subset(jobs, pending)], [], None) from e.__cause__
        except BaseException:
            self._release(len(jobs) - len(read))  # what was enqueued runs; the rest was not sent
            for _, args, _ in pending:
                unread.pop(args[3], None)
            raise
        return self._make_handles(jobs, entries, dups, foreign)

    def _make_handles(
        self, jobs: list[Job], entries: list[tuple[str, bytes, bool] | None], dups: list[bytes], foreign: dict[str, str],
    ) -> list[JobHandle]:
        known = self._handles
        if not dups:  # the common case: every job was enqueued
            handles = [JobHandle(job.id, self._ref, entry) for job, entry in zip(jobs, entries)]
            if self._orphans:
                for h in handles:
                    self._register(h)
            else:
                for h in handles:
                    known[h.id] = h
            self.counters["submitted"] += len(jobs)
            return handles
        return self._handles_with_duplicates(jobs, entries, dups, foreign)

    def _interrupted(
        self, message: str, enqueued: list[JobHandle], doubt: list[tuple[list[Job], list[Any]]],
        not_sent: list[Job], remaining: Iterator[Any] | None,
    ) -> SubmitInterrupted:
        """A SubmitInterrupted whose resume() resends the ``doubt`` calls under their numbers
        (held unread until then, so their records stay), then submits the rest."""
        doubt = [(jobs, calls) for jobs, calls in doubt if jobs]
        numbers = [args[3] for _, calls in doubt for _, args, _ in calls]
        self._pinned.update(numbers)
        ref = self._ref
        unpin: list[weakref.finalize] = []

        async def resume() -> list[JobHandle]:
            producer = ref()
            if producer is None:
                raise RuntimeError("cannot resume the submission: its producer is gone")
            unpin[0].detach()  # from here on, what is not read is held by the next error, if any
            out: list[JobHandle] = []
            for i, (jobs, calls) in enumerate(doubt):
                await producer._reserve(len(jobs))
                try:
                    out += await producer._finish_chunk(jobs, calls, None)
                except SubmitInterrupted as e:
                    e._unpin.detach()
                    rest = [*e._doubt, *doubt[i + 1 :]]
                    raise producer._interrupted(str(e), out + e.enqueued, rest, not_sent, remaining) from e.__cause__
            if not_sent or remaining is not None:
                rest_specs = itertools.chain(not_sent, remaining or ())
                try:
                    out += await producer.submit_many(rest_specs)
                except SubmitInterrupted as e:
                    e.enqueued[:0] = out
                    raise
            return out

        err = SubmitInterrupted(
            message + "; jobs enqueued: {}, in doubt (sent, reply lost): {}, not sent: {}{}; "
            "resume() finishes the batch without doubling any job".format(
                len(enqueued), sum(len(j) for j, _ in doubt), len(not_sent),
                " (and the specs not read yet)" if remaining is not None else "",
            ),
            enqueued=enqueued, in_doubt=[job for jobs, _ in doubt for job in jobs], not_sent=not_sent,
            remaining=remaining, resume=resume,
        )
        err._doubt = doubt
        # The records of the calls in doubt are kept until resume() reads them, or until the
        # error is gone (then nothing can resend them).
        err._unpin = weakref.finalize(err, _unpin, ref, numbers)
        unpin.append(err._unpin)
        return err

    def _handles_with_duplicates(
        self, jobs: list[Job], entries: list[tuple[str, bytes, bool] | None], dups: list[bytes], foreign: dict[str, str],
    ) -> list[JobHandle]:
        # Within a call the first occurrence of an id is enqueued, repeats are skipped (and
        # all occurrences are skipped if the id was already queued): mark the last ones.
        skipped_left = Counter(dups)
        occurrences = Counter(job.id.encode() for job in jobs if job.tracked)
        accepted_left = {k: occurrences[k] - skipped_left[k] for k in skipped_left}
        handles = []
        for job, entry in zip(jobs, entries):
            dup = False
            if (key := job.id.encode()) in accepted_left:
                if accepted_left[key] > 0:
                    accepted_left[key] -= 1
                else:
                    dup = True
            first = self._handles.get(job.id)
            h = JobHandle(job.id, self._ref, entry, duplicate=dup)
            if first is None or (not dup and job.id in self._orphans):
                self._register(h)
            elif dup:  # resubmitted while ours is still outstanding: one result, shared
                self._release(1)
                h._twin = first._twin or first
            else:
                self._handles[job.id] = h
            if dup and job.id in foreign and not h.done():
                # Queued by another producer: its result goes there, never here.
                res = Result(id=job.id, error=ErrorInfo(
                    type=JobRejected.__name__,
                    message=f"job id {job.id!r} is already queued or running for producer {foreign[job.id]!r}, "
                            "which receives its result; this submission was a no-op",
                ))
                h._set(res)
                self._completed[job.id] = res
            handles.append(h)
        self.counters["submitted"] += len(jobs) - len(dups)
        self.counters["duplicates"] += len(dups)
        return handles

    def _deadline(self, what: str) -> deadline:
        return deadline(self.redis_settings.command_timeout, what)

    async def _run_scripts(self, calls: list[tuple[list[str], list[Any], list[int]]]) -> list[Any]:
        """Run SUBMIT calls in one pipeline (one round trip), loading the script if needed.

        A connection error sends them again (a call that ran replays its reply) with backoff,
        until Redis has been unreachable for ``RedisSettings.command_timeout`` (_GaveUp)."""
        what = f"submitting {sum(len(c[2]) for c in calls)} jobs"
        outage = None
        while True:
            try:
                async with self._deadline(what):
                    return await self._run_scripts_now(calls)
            except _RETRYABLE as e:
                if outage is None:
                    outage = _Outage(self.redis_settings.command_timeout)
                await outage.wait(e, what)
                self.counters["resends"] += 1

    async def _run_scripts_now(self, calls: list[tuple[list[str], list[Any], list[int]]]) -> list[Any]:
        if len(calls) == 1:  # one call: no pipeline machinery
            keys, args, _ = calls[0]
            return [await SUBMIT(self._client, keys, args)]
        for attempt in (0, 1):
            pipe = self._client.pipeline(transaction=False)
            for keys, args, _ in calls:
                # execute_command: redis-py's cluster pipeline refuses pipe.evalsha
                pipe.execute_command("EVALSHA", SUBMIT.sha, len(keys), *keys, *args)
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
            async with self._deadline("removing the staleness bound"):
                await self._client.hdel(self.keys.config, "max_lag", "batch")
            return
        if batch is None or batch < 1 or max_lag < 0:
            raise ValueError("set_staleness_bound needs max_lag >= 0 and batch >= 1")
        async with self._deadline("setting the staleness bound"):
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
        async with self._deadline("setting the update policy"):
            await self._client.hset(self.keys.config, "update_policy", policy)

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job by id. Returns False if it is no longer queued or running."""
        await self.connect()
        h = self._handles.get(job_id)
        known = h is not None and not h.done()
        entry = h._entry if h is not None else None
        stream, eid, tracked = entry or (self.keys.jobs, b"0-0", True)
        async with self._deadline(f"cancelling job {job_id!r}"):
            how = await CANCEL(
                self._client, [stream, self.keys.cancel(job_id), self.keys.ids, self.keys.stats],
                [eid, job_id, self.keys.control, CANCEL_MARK_TTL, GROUP, "1" if tracked else "0"],
            )
        if how == 1 and h is not None:
            h._entry = None
        if h is not None and not h.done():
            if how != 1:  # it was delivered: a (cancelled) result is still to come; drop it then
                self._cancelled.add(job_id)
            res = Result(id=job_id, error=ErrorInfo(type=JobCancelled.__name__, message="cancelled by the submitter"))
            h._set(res)
            self._consume(job_id, res)  # the caller knows: its room is free now
        return known

    # -- results -------------------------------------------------------------------------
    async def _read_results(self) -> None:
        """Read the result stream; resolve handles; delete what was taken.

        The deletion of one batch travels in the same round trip as the next blocking read.
        The reader client returns XREAD's reply unparsed (``raw_replies``): a list of
        ``[stream, [[entry id, [field, value, ...]], ...]]`` (a dict of streams on RESP3).
        """
        assert self._reader_client is not None and self._arrived is not None
        last = b"0-0"
        backoff = 0.05
        count = self.settings.result_batch
        taken: list[bytes] = []
        client = self._reader_client
        key = self._result_key
        read_deadline = deadline(1.0 + self.redis_settings.command_timeout, "a blocking read of the result stream")
        # On one server the reader keeps a connection of its own and writes XDEL + XREAD as
        # one packet (a redis-py pipeline costs twice the CPU); a cluster client pipelines.
        single = not self.redis_settings.cluster
        conn = None
        try:
            while not self._closed:
                try:
                    async with read_deadline:
                        if single:
                            if conn is None:
                                conn = await client.connection_pool.get_connection()
                            resp = await self._read_once(conn, key, last, count, taken)
                        elif taken:
                            pipe = client.pipeline(transaction=False)
                            pipe.xdel(key, *taken)
                            pipe.xread({key: last}, count=count, block=1000)
                            resp = (await pipe.execute())[-1]
                        else:
                            resp = await client.xread({key: last}, count=count, block=1000)
                    taken = []
                    backoff = 0.05
                except (*_RETRYABLE, ResponseError) as e:
                    log.warning("result stream read failed (%s); retrying in %.2fs", e, backoff)
                    if conn is not None:
                        await conn.disconnect()  # replies may be left unread: start clean
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                last = self._take(resp, taken) or last
                if resp:
                    # Let the tasks waiting for these results run before the next read is
                    # sent: they are the latency that counts; the read can go a moment later.
                    await asyncio.sleep(0)
        finally:
            if conn is not None:
                await client.connection_pool.release(conn)

    @staticmethod
    async def _read_once(conn: Any, key: str, last: bytes, count: int, taken: list[bytes]) -> Any:
        """XDEL what was taken (if any) and a blocking XREAD, in one write; the XREAD's reply."""
        cmds: list[tuple[Any, ...]] = [("XDEL", key, *taken)] if taken else []
        cmds.append(("XREAD", "COUNT", count, "BLOCK", 1000, "STREAMS", key, last))
        await conn.send_packed_command(conn.pack_commands(cmds))
        if taken:
            await conn.read_response()
        return await conn.read_response()

    def _take(self, resp: Any, taken: list[bytes]) -> bytes | None:
        """Deliver the results of an XREAD reply; returns the last entry id read."""
        if not resp:
            return None
        for _, entries in resp.items() if isinstance(resp, dict) else resp:
            for eid, fields in entries:
                taken.append(eid)
                try:
                    if type(fields) is dict:  # a client that parsed the reply anyway
                        fields = [x for kv in fields.items() for x in kv]
                    if fields[0] == b"d":
                        self._deliver(decode_result(fields[1]))
                    else:
                        for data in msgpack.unpackb(fields[1], raw=True):
                            self._deliver(decode_result(data))
                except Exception as e:  # a corrupt result must not stop the reader
                    log.error("dropping unreadable result entry %s: %s", eid, e)
        assert self._arrived is not None
        self._arrived.set()
        return taken[-1] if taken else None

    def _deliver(self, res: Result) -> None:
        """Resolve the handle of ``res``; a second result for a job id is dropped (held, or
        taken not long ago: ``DELIVERED_MEMORY``), so the trainer never sees one id twice."""
        self.counters["results"] += 1
        jid = res.id
        if self._cancelled and jid in self._cancelled:  # its handle already holds JobCancelled
            self._cancelled.discard(jid)
            return
        h = self._handles.get(jid)
        if h is None:
            if jid in self._delivered:  # its result was taken: this one is a second
                self.counters["duplicate_results"] += 1
                log.warning("dropping a second result for job %s", short(jid))
                return
            # A result of a previous incarnation of this producer, or one read before the
            # reply of its own submission was handled (its handle adopts it: _register).
            h = self._handles[jid] = JobHandle(jid, self._ref)
            self._outstanding += 1
            if len(self._orphans) > 100_000:
                self._orphans.clear()
            self._orphans[jid] = res
        elif h.done():
            self.counters["duplicate_results"] += 1  # a second result for what we hold
            return
        h._entry = None
        h._set(res)
        self._completed[jid] = res

    def _register(self, h: JobHandle) -> None:
        """Make ``h`` the handle of its job; it adopts a result that came before it did."""
        res = self._orphans.pop(h.id, None) if self._orphans else None
        if res is None:
            self._handles[h.id] = h
            return
        # The result was read before the submission's reply was handled: _deliver counted
        # it as a job of its own; it is this one.
        h._set(res)
        held = self._handles.get(h.id)
        if held is not None and held._result is res:  # not taken yet: h takes its place
            self._handles[h.id] = h
        self._release(1)

    def _consume(self, job_id: str, res: Result) -> None:
        """``res`` was taken by its handle or by results(): forget it, free room (once)."""
        h = self._handles.get(job_id)
        if h is None or h._result is not res:
            return  # already taken
        del self._handles[job_id]
        self._delivered.add(job_id)
        if self._completed.get(job_id) is res:
            del self._completed[job_id]
        self._release(1)

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
                self._consume(job_id, res)
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

        async def each() -> list[Result]:  # one waiter, not a task per handle
            return [await h.result(raise_error=False) for h in handles]

        return await asyncio.wait_for(each(), timeout)

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


_pack = msgpack.Packer(use_bin_type=False).pack  # Redis' Lua cmsgpack reads str, not bin


class _RecentIds:
    """A bounded set of recent ids: two generations of at most ``cap`` each (O(1) all)."""

    __slots__ = ("cap", "new", "old")

    def __init__(self, cap: int):
        self.cap = cap
        self.new: set[str] = set()
        self.old: set[str] = set()

    def add(self, x: str) -> None:
        self.new.add(x)
        if len(self.new) >= self.cap:
            self.old, self.new = self.new, set()

    def discard(self, x: str) -> None:
        self.new.discard(x)
        self.old.discard(x)

    def __contains__(self, x: str) -> bool:
        return x in self.new or x in self.old

    def __bool__(self) -> bool:
        return bool(self.new or self.old)


class _GaveUp(Exception):
    """Redis stayed unreachable past the retry budget (turned into SubmitInterrupted)."""


class _Outage:
    """Backoff between resends, and the limit: ``limit`` seconds since the first failure."""

    __slots__ = ("limit", "since", "delay")

    def __init__(self, limit: float | None):
        self.limit = limit
        self.since: float | None = None
        self.delay = RESEND_BACKOFF[0]

    def reset(self) -> None:
        if self.since is not None:
            self.since = None
            self.delay = RESEND_BACKOFF[0]

    async def wait(self, error: BaseException, what: str) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif self.limit is not None and now - self.since >= self.limit:
            raise _GaveUp(
                f"{what}: Redis unreachable for {now - self.since:.1f}s, longer than "
                f"RedisSettings.command_timeout={self.limit}s (last error: {type(error).__name__}: {error})"
            ) from error
        log.info("%s: %s; sending again in %.3fs", what, error, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(2 * self.delay, RESEND_BACKOFF[1])


def _subset(jobs: list[Job], calls: list[Any]) -> tuple[list[Job], list[Any]]:
    """The jobs of ``calls`` (a part of ``jobs``'s calls) and the calls with positions in them."""
    sub: list[Job] = []
    out = []
    for keys, args, part in calls:
        out.append((keys, args, range(len(sub), len(sub) + len(part))))
        sub.extend(jobs[k] for k in part)
    return sub, out


def _unpin(ref: Any, numbers: list[int]) -> None:
    """A SubmitInterrupted is gone: nobody can resend its calls; their records may go."""
    producer = ref()
    if producer is not None:
        for n in numbers:
            if n in producer._pinned:
                producer._pinned.discard(n)
                producer._unread.pop(n, None)

_NOTHING = object()
#: Jobs in the first script call of a streamed submit_many (then doubling to script_batch).
_FIRST_CALL = 64

_SPEC_FIELDS = {"prompt", "prompt_token_ids", "messages", "sampling", "id", "replica", "min_version", "deadline", "timeout", "meta"}
