"""The trainer side: submit jobs fire-and-forget, collect results exactly once.

>>> async def main():                                         # doctest: +SKIP
...     async with Producer("redis://127.0.0.1:6379/0", queue="grpo") as p:
...         h = await p.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 32, "n": 8})
...         await p.submit_many([{"prompt": "2+2=", "sampling": {"max_tokens": 4}}] * 100)
...         result = await h                     # or: async for r in p.results(): ...
...         print(result.policy_version, result.samples[0].token_ids)

Submission is idempotent (:mod:`rollq.producer._submission`: numbered SUBMIT calls whose
replies Redis keeps until they are read). Results travel through a per-producer stream
(:mod:`rollq.producer._results`); a producer that restarts with the same ``producer_id``
re-reads results it had not yet taken. :mod:`rollq.producer._handles` holds the handles and
the ledger of outstanding jobs.

A queue with K shards (rollq/shards.py; ``ProducerSettings.shards``) is agreed on at
connect. Each job goes to one shard: a caller-chosen id to ``shard_of_id(id, K)``, a job
targeted at a replica to the replica's home shard, any other job round robin. Each SUBMIT
call holds the jobs of one shard and uses that shard's keys and its call record; the results
come back through the producer's result stream in each shard; the staleness bound is split
over the shards' configs. With one shard, keys and commands are the unsharded queue's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Iterable, Sequence

from .._tasks import stop_task
from ..connection import CANCEL, DROP_EMPTY, RETRYABLE, SET_BOUND, Client, connect, deadline, raw_replies
from ..errors import InvalidJob, job_error
from ..keys import GROUP, QueueKeys, check_name
from ..protocol import SPECS_END, Job, Result, Scores, job_from_spec, score_spec, token_jobs, token_list
from ..registry import register_queue
from ..settings import DEFAULT_QUEUE, ProducerSettings, RedisSettings
from ..shards import ShardMap, check_shards, declare_shards, grew
from ._calls import CALL_RECORD_TTL_MS, RESEND_BACKOFF
from ._handles import DELIVERED_MEMORY, JobHandle, Ledger
from ._progress import ProgressReader
from ._results import ResultReader
from ._submission import JobSpec, Submission

log = logging.getLogger(__name__)

__all__ = ["Producer", "JobHandle", "JobSpec", "CANCEL_MARK_TTL", "CALL_RECORD_TTL_MS", "DELIVERED_MEMORY",
           "RESEND_BACKOFF"]

#: Seconds a cancellation mark lives (longer than any job should wait or run).
CANCEL_MARK_TTL = 24 * 3600
#: The fields a job spec may have.
SPEC_FIELDS = frozenset(
    {"prompt", "prompt_token_ids", "messages", "sampling", "id", "replica", "min_version", "deadline", "timeout", "meta",
     "stream"}
)


class Producer:
    """Submits jobs to one queue and receives their results.

    Args:
        url: Redis URL (``$ROLLQ_REDIS_URL`` if None); ``redis+cluster://`` for Redis Cluster.
        queue: queue name.
        producer_id: stable name to re-read undelivered results after a restart (random
            if None).
        settings: :class:`~rollq.settings.ProducerSettings` (``shards``: the queue's number of
            shards to record or check; None follows the record).

    Attributes:
        shards: the queue's number of shards, agreed at :meth:`connect` (1 before).
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
        self._seq = 0  # generated job ids: f"{_prefix}{_seq:x}"
        self._prefix = f"{self.id}-{os.getpid():x}-"
        self._client: Client | None = None
        self._reader_client: Client | None = None
        self._reader: asyncio.Task | None = None
        self._ref = weakref.ref(self)
        #: Cumulative counters (submitted, duplicates, results, second results dropped, resends).
        self.counters = {"submitted": 0, "duplicates": 0, "results": 0, "duplicate_results": 0, "resends": 0}
        self._ledger = Ledger(self.settings, self.counters, self._ref)
        self._progress = ProgressReader(self._ref)  # what JobHandle.stream() reads
        #: SUBMIT calls, their numbers and their routing over the shards.
        self._submission = Submission(self._ref, self.id, self.keys, self.settings, self.redis_settings,
                                      self.counters, self._ledger)
        self._set_shards(1)  # until connect() reads or records the queue's count
        self._publisher: Any = None
        self._closed = False

    # -- shards --------------------------------------------------------------------------
    def _set_shards(self, k: int) -> None:
        """Use ``k`` shards: their layout (:class:`~rollq.shards.ShardMap`), and this
        producer's result stream and call record in each (index = shard)."""
        self.shards = k
        self._map = ShardMap(self.keys, k)
        self._result_keys = [s.results(self.id) for s in self._map]
        self._calls_keys = [s.submit_calls(self.id) for s in self._map]
        self._result_key = self._result_keys[0]
        self._submission.router.set_shards(self._map, self._calls_keys)

    async def _follow_shards(self, k: int) -> None:
        """The queue has ``k`` shards, not the count this producer routed over (it grew after
        connect()): route over ``k`` from now on and read the result stream of each (the new
        readers start from the streams' first entries; a result read twice is dropped)."""
        if k == self.shards:
            return
        check_shards(k)
        async with self._deadline("reading whether the queue grew"):
            grown = k > 1 and await grew(self._client, self.keys)
        if k == self.shards:  # another call followed it meanwhile
            return
        self._submission.router.grown = grown
        log.info("producer %s: queue %r has %d shard(s), not %d; routing over %d", self.id, self.queue, k,
                 self.shards, k)
        self._set_shards(k)
        old, self._reader = self._reader, None
        await stop_task(old)
        if not self._closed:
            self._reader = asyncio.create_task(_run_all(self._result_readers()), name=f"rollq-results-{self.id}")

    # -- lifecycle -----------------------------------------------------------------------
    async def connect(self) -> Producer:
        if self._client is None:
            # No socket timeouts: calls are bounded by deadline() (see rollq.connection). No
            # health checks either: they cost a PING before the handshake of every new
            # connection, and these clients bound every call and reconnect on errors.
            self._client = connect(self.redis_settings, socket_timeout=None, health_check_interval=0)
            self._reader_client = connect(self.redis_settings, socket_timeout=None, health_check_interval=0)
            self._ledger.connect()
            raw_replies(self._reader_client, "XREAD")
            try:
                # The queue's number of shards (recorded if the settings name one and the
                # queue has none): the result readers need it, so it comes first.
                async with self._deadline("connecting (reading the queue's shard count)"):
                    k = await declare_shards(self._client, self.keys, self.settings.shards)
                    self._submission.router.grown = k > 1 and await grew(self._client, self.keys)
                if k != self.shards:
                    self._set_shards(k)
                readers = self._result_readers()
                if self._closed:  # close() stopped the reading for good
                    for r in readers:
                        r.stop()
                # The task refers to the readers, not to the producer (no reference cycle).
                self._reader = asyncio.create_task(_run_all(readers), name=f"rollq-results-{self.id}")
                # The reader connects while this round trip waits: two handshakes in the
                # time of one. It registers the queue (rollq status and the dashboard list
                # it), once per connect, never on the submit path.
                async with self._deadline("connecting (registering the queue)"):
                    await register_queue(self._client, self.queue)
            except BaseException:  # unreachable: leave nothing behind, a later connect() retries
                if self._reader is not None:
                    self._reader.cancel()
                for c in (self._client, self._reader_client):
                    await c.aclose()
                self._client = self._reader_client = self._reader = None
                raise
        return self

    def _result_readers(self) -> list[ResultReader]:
        """Readers of every shard's result stream: one over all of them on one server (one
        blocking XREAD), one per shard on a cluster (one slot each)."""
        cluster = self.redis_settings.cluster
        groups = [[k] for k in self._result_keys] if cluster else [self._result_keys]
        return [
            ResultReader(
                self._reader_client, keys, count=self.settings.result_batch,
                command_timeout=self.redis_settings.command_timeout, cluster=cluster,
                deliver=self._ledger.deliver, arrived=self._ledger.arrived,
            )
            for keys in groups
        ]

    async def close(self) -> None:
        """Stop reading results and close connections (outstanding jobs keep running)."""
        self._closed = True
        if self._publisher is not None:
            await self._publisher.close()
        if self._client is not None and not self._ledger.handles:
            try:  # nothing more can arrive for us: leave no empty stream behind (in any shard)
                async with self._deadline("removing the empty result streams"):
                    for key in self._result_keys:  # one script call per shard: one slot each
                        await DROP_EMPTY(self._client, [key], [])
            except RETRYABLE:
                pass
        if self._client is not None and self._submission.numbers.idle():
            try:  # no call in flight: its records can go (else they expire: CALL_RECORD_TTL_MS)
                async with self._deadline("removing the submit call records"):
                    if self.redis_settings.cluster:
                        for key in self._calls_keys:
                            await self._client.delete(key)
                    else:
                        await self._client.delete(*self._calls_keys)
            except RETRYABLE:
                pass
        await self._progress.close()
        await stop_task(self._reader)
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
        return self._ledger.outstanding

    def _deadline(self, what: str) -> deadline:
        return deadline(self.redis_settings.command_timeout, what)

    # -- building jobs ---------------------------------------------------------------------
    def build_job(self, spec: JobSpec | None = None, /, **kw: Any) -> Job:
        """Validate and build a :class:`~rollq.protocol.Job` from user-facing fields.

        Fields: ``prompt`` (text) | ``prompt_token_ids`` | ``messages``; ``sampling``;
        ``id``; ``replica``; ``min_version``; ``deadline`` or ``timeout``; ``meta``.
        """
        f = spec if not kw else {**(spec or {}), **kw}
        if f is None:
            f = {}
        if not SPEC_FIELDS.issuperset(f):
            raise InvalidJob(f"unknown job field(s) {sorted(set(f) - SPEC_FIELDS)}; allowed: {sorted(SPEC_FIELDS)}")
        given = f.get("id")
        if given is None:
            self._seq += 1
            return job_from_spec(f, f"{self._prefix}{self._seq:x}", self.id, self.settings.max_prompt_bytes)
        return job_from_spec(f, str(given), self.id, self.settings.max_prompt_bytes, tracked=True)

    def build_jobs(self, specs: Iterable[JobSpec | Job]) -> list[Job]:
        """:meth:`build_job` for each spec (a :class:`Job` is taken as it is): the same jobs
        and the same refusals, the common shape built by :func:`~rollq.protocol.token_jobs`'
        loop."""
        jobs: list[Job] = []
        it = iter(specs)
        reply, limit = self.id, self.settings.max_prompt_bytes
        while True:
            built = len(jobs)
            try:
                other = token_jobs(it, jobs, reply, limit, prefix=self._prefix, seq=self._seq)
            finally:
                self._seq += len(jobs) - built  # the ids of the jobs built
            if other is SPECS_END:
                return jobs
            jobs.append(other if isinstance(other, Job) else self.build_job(other))

    # -- submission ----------------------------------------------------------------------
    async def submit(self, prompt: str | None = None, /, **kw: Any) -> JobHandle:
        """Submit one job; returns immediately with its handle.

        A resend after a connection error is idempotent (see :meth:`submit_many`); Redis
        unreachable for ``RedisSettings.command_timeout`` raises SubmitInterrupted (the job in
        ``in_doubt``; ``resume()`` sends it again without doubling it)."""
        if prompt is not None:
            kw["prompt"] = prompt
        job = self.build_job(kw)
        await self.connect()
        return (await self._submission.submit_chunk([job]))[0]

    async def submit_batch(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        """Submit a few jobs together, as :meth:`submit` submits one: all validated first (a
        spec that fails raises and none is sent), then one round of SUBMIT calls on the
        shared connections. For the jobs of one request (a batch of prompts); a stream of
        thousands goes through :meth:`submit_many`, which pipelines chunks on a connection
        of its own.

        >>> hs = await p.submit_batch([{"prompt_token_ids": [1, 2]}, {"prompt": "hi"}])   # doctest: +SKIP
        """
        jobs = self.build_jobs(specs)
        if not jobs:
            return []
        await self.connect()
        return await self._submission.submit_chunk(jobs)

    async def score(self, context: Sequence[int], continuation: Sequence[int], *, timeout: float | None = None, **fields: Any) -> Scores:
        """The logprob of each token of ``continuation`` after ``context`` (token ids) under
        the weights a replica serves, without sampling it (a scoring job: vLLM's
        ``prompt_logprobs``; see :func:`~rollq.protocol.score_spec`), and the policy version
        of those weights (:class:`~rollq.protocol.Scores`; ``-1``: a weight update landed while
        it was scored). For many at once, ``submit_many(score_spec(...) for ...)`` and
        ``Scores.of(result, len(context))``.

        >>> await p.score([1, 2, 3], [4, 5])            # doctest: +SKIP
        Scores(logprobs=[-6.91, -6.87], version=3)
        """
        # Every argument is checked before the job is enqueued (the token ids read once).
        context, continuation = token_list(context, "context"), token_list(continuation, "continuation")
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0):
            raise InvalidJob(f"score(timeout=...) must be None or seconds >= 0, got {timeout!r}")
        r = await (await self.submit(**score_spec(context, continuation, **fields))).result(timeout=timeout)
        return Scores.of(r, len(context))

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

        Under a staleness bound (:meth:`set_staleness_bound`) each SUBMIT call is admitted or
        refused as a whole: all or nothing for one call, which holds ``script_batch`` jobs at
        most, all of one shard. On a sharded queue a batch spans several calls and shards, so
        some of its calls may be admitted while others are refused (each shard checks its own
        part of the bound). A refused call is sent again once a newer version is published
        (``block_when_full``, the default), else :class:`~rollq.errors.StalenessBound` is
        raised after the replies of every call sent were read, with ``enqueued`` (the handles
        of the jobs enqueued: their results will come) and ``refused`` (the jobs not
        enqueued, to submit again later; no job is in both, and none is lost).
        """
        await self.connect()
        return await self._submission.submit_many(specs)

    # -- queue settings and weights --------------------------------------------------------
    async def set_staleness_bound(self, max_lag: int | None, batch: int | None = None) -> None:
        """Bound off-policy lag for this queue: at most ``(max_lag + version + 1) * batch`` jobs
        are ever admitted (AReaL's rule), checked atomically at submission. ``None`` removes it.
        ``batch`` is the number of jobs the trainer consumes per policy version.

        With K shards, shard ``i`` admits at most ``(max_lag + version + 1) * split_budget(batch,
        K)[i]`` (its SUBMIT calls check its own budget and its mirror of the version), so the
        queue's total never exceeds the bound; ``batch`` must be at least K (ValueError). Each
        shard's part is written by ``lua/set_bound.lua``, shard 0's first: if the queue's
        recorded count is not this producer's (it grew since connect()), nothing is written,
        the producer follows the record and writes the parts of the new split."""
        await self.connect()
        if max_lag is not None and (batch is None or batch < 1 or max_lag < 0):
            raise ValueError("set_staleness_bound needs max_lag >= 0 and batch >= 1")
        while True:
            if max_lag is None:
                parts = [0] * self.shards
            elif batch < self.shards:
                raise ValueError(
                    f"set_staleness_bound: batch={batch} is smaller than the queue's {self.shards} shards "
                    "(each shard's budget is a part of batch, at least 1 job)"
                )
            else:
                parts = self._map.split(batch)  # [batch] with one shard
            async with self._deadline("setting the staleness bound"):
                recorded = 0
                for shard, part in zip(self._map, parts):  # one slot per call
                    recorded = await SET_BOUND(self._client, [shard.config],
                                               [self.shards, "" if max_lag is None else max_lag, part])
                    if recorded:  # shard 0 refused: nothing was written
                        break
            if not recorded:
                return
            await self._follow_shards(int(recorded))

    async def publish_weights(self, state: Any, version: int | None = None, transport: str = "memmap", **publisher_kwargs: Any) -> Any:
        """Publish a new policy version of this queue (see
        :class:`~rollq.weightsync.trainer.publisher.WeightPublisher`; ``root=`` names the memmap store,
        ``sender=`` a broadcast sender, on the first call). Returns the committed record."""
        if self._publisher is None:
            from ..weightsync.trainer.publisher import WeightPublisher

            self._publisher = WeightPublisher(self.redis_settings, self.queue, trainer_id=self.id, **publisher_kwargs)
        return await self._publisher.publish_weights(state, version=version, transport=transport)

    async def release_weights(self, timeout: float = 30.0) -> dict[str, int]:
        """Release the version :meth:`publish_weights` exposes over IPC once the replicas on
        this host copied it (``WeightPublisher.release_weights``; call it before changing the
        tensors of a version published with ``ipc_lease=True``); ``{}`` when none is exposed."""
        if self._publisher is None:
            return {}
        got: dict[str, int] = await self._publisher.release_weights(timeout)
        return got

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
        h = self._ledger.handles.get(job_id)
        known = h is not None and not h.done()
        entry = h._entry if h is not None else None
        if entry is not None:  # the job's shard is its stream's
            stream, eid, tracked = entry
            shard = self._map.of_key(stream)
        else:  # not queued by us (any more): mark it where a caller-chosen id goes
            shard = self._map.of_id(job_id)
            stream, eid, tracked = shard.jobs, b"0-0", True
        async with self._deadline(f"cancelling job {job_id!r}"):
            # The hint goes out on the queue's control channel (shard 0's), for every shard.
            how = await CANCEL(
                self._client, [stream, shard.cancel(job_id), shard.ids, shard.stats],
                [eid, job_id, self.keys.control, CANCEL_MARK_TTL, GROUP, "1" if tracked else "0"],
            )
        if how == 1 and h is not None:
            h._entry = None
        if h is not None and not h.done():
            # Removed from the queue (1), or delivered: then a (cancelled) result is still to
            # come, and is dropped. The caller knows now: its room is free.
            self._ledger.cancelled_by_submitter(h, running=how != 1)
        return known

    # -- results -------------------------------------------------------------------------
    def _deliver(self, res: Result) -> None:
        """Hand ``res`` to its handle, as the result reader does (see :meth:`Ledger.deliver`)."""
        self._ledger.deliver(res)

    def _consume(self, job_id: str, res: Result) -> None:
        """``res`` was taken by its handle: forget it, free its room (once)."""
        self._ledger.consume(job_id, res)

    async def results(self, *, timeout: float | None = None, raise_error: bool = False) -> AsyncIterator[Result]:
        """Results as they complete, each once (also ones no handle was awaited for).

        Stops after ``timeout`` seconds without a new result (never, by default). With
        ``raise_error`` a failed job raises its JobError instead of being yielded.
        """
        await self.connect()
        ledger = self._ledger
        assert ledger.arrived is not None
        while True:
            while ledger.completed:
                job_id, res = ledger.completed.popitem(last=False)
                ledger.consume(job_id, res)
                if raise_error and res.error is not None:
                    raise job_error(res.error.type, res.error.message, job_id)
                yield res
            ledger.arrived.clear()
            if ledger.completed:
                continue
            try:
                await asyncio.wait_for(ledger.arrived.wait(), timeout)
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
        while self.outstanding > 0:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = False
            async for r in self.results(timeout=left if left is not None else 1.0):
                out.append(r)
                got = True
                if self.outstanding <= 0:
                    break
            if deadline is not None and time.monotonic() >= deadline and self.outstanding > 0:
                raise TimeoutError(f"{self.outstanding} jobs still outstanding after {timeout}s")
            if not got and deadline is None:
                continue
        return out


async def _run_all(readers: list[ResultReader]) -> None:
    """Run the result readers until cancelled."""
    if len(readers) == 1:
        await readers[0].run()
    else:
        await asyncio.gather(*(r.run() for r in readers))
