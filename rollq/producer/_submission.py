"""Submission: batches of jobs to SUBMIT calls of ``ProducerSettings.script_batch`` jobs
each (one msgpack argument per call), streamed on one server, pipelined in chunks on a
cluster; refusals of the staleness bound; :class:`~rollq.errors.SubmitInterrupted` and its
``resume()``. A :class:`~rollq.producer.client.Producer` holds one :class:`Submission` and is
its :class:`SubmitHost`. The calls are built and routed by :mod:`rollq.producer._routing`,
numbered and resent by :mod:`rollq.producer._calls`.
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from redis.exceptions import NoScriptError

from ..connection import RETRYABLE, SUBMIT, Client, deadline
from ..errors import StalenessBound, SubmitInterrupted
from ..keys import QueueKeys
from ..protocol import Job
from ..settings import ProducerSettings, RedisSettings
from ..weightsync.versions import heal_mirrors
from ._calls import Call, CallNumbers, CallStream, GaveUp, Outage
from ._handles import Entry, JobHandle, Ledger
from ._routing import CallRouter

#: Jobs in the first script call of a streamed submit_many (then doubling to script_batch).
FIRST_CALL = 64
#: Codes of a SUBMIT reply (``lua/submit.lua``): refused by the staleness bound; refused
#: because the queue records another shard count; a check call's answer.
REFUSED_BOUND, REFUSED_COUNT, CHECKED = 1, 2, 3

#: A job's fields as the user gives them (see :meth:`Producer.build_job`).
JobSpec = Mapping[str, Any]


class SubmitHost(Protocol):
    """What a :class:`Submission` asks of the producer it submits for: the connected client,
    the jobs built from specs, and to follow the queue's shard count when a SUBMIT call finds
    it changed (the producer routes its submission anew: ``router.set_shards``)."""

    _client: Client | None

    def build_jobs(self, specs: Iterable[JobSpec | Job]) -> list[Job]: ...

    async def _follow_shards(self, k: int) -> None: ...


class Submission:
    """The submission part of a :class:`~rollq.producer.client.Producer`: ``submit_many``'s
    streamed (one server) and chunked (cluster) paths, resends, refusals of the staleness
    bound, and :class:`~rollq.errors.SubmitInterrupted`; the calls themselves are its
    ``router``'s (:class:`~rollq.producer._routing.CallRouter`), numbered by its ``numbers``.

    It holds its producer weakly (``host``: a weak reference to a :class:`SubmitHost`), and
    the producer's ledger of outstanding jobs and counters.

    >>> import asyncio
    >>> from rollq.producer._handles import Ledger
    >>> from rollq.settings import ProducerSettings, RedisSettings
    >>> settings, counters = ProducerSettings(), {"resends": 0}
    >>> sub = Submission(lambda: None, "p1", QueueKeys("grpo"), settings, RedisSettings(),
    ...                  counters, Ledger(settings, counters, lambda: None))
    >>> asyncio.run(sub.submit_many([]))
    Traceback (most recent call last):
    ...
    RuntimeError: the producer of this submission is gone
    """

    def __init__(self, host: Callable[[], SubmitHost | None], producer_id: str, keys: QueueKeys,
                 settings: ProducerSettings, redis_settings: RedisSettings, counters: dict[str, int],
                 ledger: Ledger) -> None:
        self._host = host
        self.id = producer_id
        self.keys = keys
        self.settings = settings
        self.redis_settings = redis_settings
        self.counters = counters
        #: Room for outstanding jobs and their handles (the producer's).
        self.ledger = ledger
        #: SUBMIT call numbers: Redis replays the reply of a number it has run.
        self.numbers = CallNumbers()
        #: The calls for built jobs, routed over the queue's shards (``router.set_shards``).
        self.router = CallRouter(producer_id, keys, settings.script_batch, numbers=self.numbers, ledger=ledger)
        self._ref = weakref.ref(self)

    @property
    def _producer(self) -> SubmitHost:
        host = self._host()
        if host is None:
            raise RuntimeError("the producer of this submission is gone")
        return host

    @property
    def _client(self) -> Any:
        return self._producer._client

    def _deadline(self, what: str) -> deadline:
        return deadline(self.redis_settings.command_timeout, what)

    async def submit_many(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        """:meth:`Producer.submit_many <rollq.producer.client.Producer.submit_many>` once connected."""
        if self.redis_settings.cluster:
            return await self._submit_many_chunks(specs)
        return await self._submit_many_stream(specs)

    async def _submit_many_stream(self, specs: Iterable[JobSpec | Job]) -> list[JobHandle]:
        """One server: script calls written on one pooled connection as soon as they are
        built, at most ``chunk_size // script_batch`` unanswered, replies read in order."""
        step = max(1, self.settings.script_batch)
        window = max(1, self.settings.chunk_size // step)  # calls whose replies are not read yet
        size = min(step, FIRST_CALL)  # small first calls: Redis starts while the rest is built
        it = iter(specs)
        ledger = self.ledger
        pool = self._client.connection_pool
        stream = CallStream(self, await pool.get_connection())
        try:
            while True:
                try:
                    jobs = self._producer.build_jobs(itertools.islice(it, size))
                    if jobs:
                        if stream.inflight and ledger.outstanding + len(jobs) > self.settings.max_outstanding:
                            # Room comes back as results are consumed, which counts only for
                            # jobs whose replies were read: read them all before waiting.
                            await stream.take_all()
                        await ledger.reserve(len(jobs))
                except (SubmitInterrupted, GaveUp):
                    raise
                except Exception:
                    # A spec failed validation, or QueueFull: the jobs before were sent, their
                    # handles are made (the caller gets the error, the jobs run as submitted).
                    await stream.take_all()
                    raise
                if not jobs:
                    break
                size = min(2 * size, step)
                try:
                    calls = self.router.calls(jobs)
                    packed = stream.pack(calls)
                except BaseException:
                    ledger.release(len(jobs))
                    raise
                await stream.write(jobs, calls, packed)
                if len(stream.inflight) >= window:
                    await stream.take_window()
            await stream.take_all()
            return stream.handles
        except GaveUp as e:
            raise self._interrupted(str(e), stream.handles, stream.in_doubt(), [], it) from e.__cause__
        except StalenessBound as e:
            # A call was refused (not blocking): read the replies of the calls in flight, so
            # every job written is known to be enqueued (a handle) or refused.
            enqueued, refused = list(e.enqueued), list(e.refused)
            while stream.inflight:
                try:
                    await stream.take()
                except StalenessBound as more:
                    enqueued += more.enqueued
                    refused += more.refused
            e.enqueued, e.refused = stream.handles + enqueued, refused
            raise
        except SubmitInterrupted as e:  # a rerun of refused calls in take() gave up
            e._unpin.detach()  # the new error holds its calls
            doubt = [*e._doubt, *stream.in_doubt()]
            raise self._interrupted(str(e), stream.handles + e.enqueued, doubt, e.not_sent, it) from e.__cause__
        finally:
            await stream.close(pool)

    async def _read_replies(self, conn: Any, calls: list[Call], reran: list[bool]) -> list[Any]:
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
        """A cluster: chunks from ``script_batch`` jobs doubling up to ``chunk_size``, one
        pipelined round trip each, the next chunk built while one is in flight."""
        handles: list[JobHandle] = []
        chunk = min(self.settings.script_batch, self.settings.chunk_size)
        it = iter(specs)
        build = self._producer.build_jobs
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
                    handles.extend(await self.submit_chunk(only))
                    return handles
                inflight = asyncio.ensure_future(self.submit_chunk(batch))
                batch = []
                await asyncio.sleep(0)  # let it write its pipeline before we build the next chunk
                chunk = min(2 * chunk, self.settings.chunk_size)
        except StalenessBound as e:  # the chunk in flight was refused in part; ``batch`` was not sent
            e.enqueued, e.refused = handles + e.enqueued, e.refused + batch
            batch = []
            raise
        except SubmitInterrupted as e:  # the chunk in flight gave up; ``batch`` was built, not sent
            e._unpin.detach()  # the new error holds its calls
            raise self._interrupted(str(e), handles + e.enqueued, e._doubt, e.not_sent + batch, it) from e.__cause__
        finally:
            if inflight is not None and not inflight.done():
                await asyncio.shield(inflight)

    async def submit_chunk(self, jobs: list[Job]) -> list[JobHandle]:
        """Submit ``jobs`` (built) in one round of SUBMIT calls, after room for them."""
        await self.ledger.reserve(len(jobs))
        try:
            calls = self.router.calls(jobs)
        except BaseException:
            self.ledger.release(len(jobs))
            raise
        return await self._finish_chunk(jobs, calls, None)

    async def _finish_chunk(self, jobs: list[Job], pending: list[Call], results: list[Any] | None) -> list[JobHandle]:
        """Run the SUBMIT calls of ``jobs`` (``results``: the replies of a first round already
        sent), again for calls the staleness bound refused, and make the handles. The
        ``len(jobs)`` reserved places are released for jobs that are not sent.

        Raises SubmitInterrupted if Redis stays unreachable (see :meth:`_run_scripts`)."""
        numbers, ledger = self.numbers, self.ledger
        if results is not None and len(pending) == 1 and not ledger.orphans:
            numbers.read(pending[0][1][3])
            skipped, was_refused, _, eids, _ = results[0]
            if not skipped and not was_refused and len(eids) == len(jobs):
                # The common reply: one call (its jobs in order), every job enqueued.
                return ledger.add_enqueued(jobs, pending[0][0][0], eids)
        entries: list[Entry | None] = [None] * len(jobs)
        dups: list[bytes] = []
        foreign: dict[str, str] = {}  # duplicate ids queued by another producer -> its id
        read: list[int] = []  # positions of the jobs whose calls' replies were read (not refused)
        refused_limit = -1
        try:
            while pending:
                if results is None:
                    results = await self._run_scripts(pending)
                refused: list[Call] = []
                again: list[Call] = []  # to send at once: checked ids to their shard, calls routed anew
                recorded_count = 0
                for call, (skipped, code, limit, eids, owners) in zip(pending, results):
                    keys, args, part = call
                    numbers.read(args[3])
                    if code == REFUSED_BOUND:
                        refused.append(call)
                        refused_limit = limit
                        continue
                    if code == REFUSED_COUNT:  # the queue grew since we connected: nothing was done
                        recorded_count = limit
                        again.append(call)
                        continue
                    if skipped:
                        dups.extend(skipped)
                        for jid, owner in zip(skipped, owners):
                            if owner is not None and owner.decode() != self.id:
                                foreign[jid.decode()] = owner.decode()
                    if code == CHECKED:  # recorded in shard 0 since before the growth: duplicates
                        if not limit:
                            self.router.grown = False  # none is left there
                        held = set(skipped)
                        read.extend(k for k in part if jobs[k].id.encode() in held)
                        forward = [k for k in part if jobs[k].id.encode() not in held]
                        if forward:
                            again += self.router.calls_for(jobs, forward, check=False)
                        continue
                    read.extend(part)
                    stream = keys[0]
                    for k, eid in zip(part, eids):
                        if eid:
                            entries[k] = (stream, eid, jobs[k].tracked)
                results = None
                if recorded_count:
                    await self._producer._follow_shards(int(recorded_count))
                    stale = [c for c in again if c[1][6] != self.router.shards]
                    again = [c for c in again if c[1][6] == self.router.shards]
                    for _, _, part in stale:
                        again += self.router.calls_for(jobs, list(part))
                if refused and not again and any(self.router.layout.of_key(c[0][0]).shard_index for c in refused):
                    # A shard's mirror of the version may lag the record (a publisher died
                    # between its commit and its mirror): heal it, and send again at once.
                    if await self._heal_mirrors():
                        again, refused = refused, []
                        for _, args, _ in again:
                            numbers.number(args)
                if refused and not again:
                    try:
                        await self._wait_for_admission(sum(len(c[2]) for c in refused), refused_limit, refused[-1][0][0])
                    except StalenessBound as e:
                        # Not blocking: the refused calls did nothing (each is all or nothing:
                        # one shard's jobs); the jobs of the others are enqueued, and get handles.
                        ledger.release(len(jobs) - len(read))
                        read.sort()
                        e.enqueued = ledger.add([jobs[k] for k in read], [entries[k] for k in read], dups, foreign)
                        e.refused = [jobs[k] for call in refused for k in call[2]]
                        raise
                for _, args, _ in refused:  # a refusal is not recorded: a new number
                    numbers.number(args)
                pending = again + refused
        except StalenessBound:
            raise
        except GaveUp as e:
            ledger.release(len(jobs) - len(read))  # what was enqueued runs; the rest is in doubt
            read.sort()
            done = ledger.add([jobs[k] for k in read], [entries[k] for k in read], dups, foreign)
            raise self._interrupted(str(e), done, [_subset(jobs, pending)], [], None) from e.__cause__
        except BaseException:
            ledger.release(len(jobs) - len(read))  # what was enqueued runs; the rest was not sent
            for _, args, _ in pending:
                numbers.drop(args[3])
            raise
        return ledger.add(jobs, entries, dups, foreign)

    def _interrupted(
        self, message: str, enqueued: list[JobHandle], doubt: list[tuple[list[Job], list[Call]]],
        not_sent: list[Job], remaining: Iterator[Any] | None,
    ) -> SubmitInterrupted:
        """A SubmitInterrupted whose resume() resends the ``doubt`` calls under their numbers
        (held unread until then, so their records stay), then submits the rest."""
        doubt = [(jobs, calls) for jobs, calls in doubt if jobs]
        numbers = [args[3] for _, calls in doubt for _, args, _ in calls]
        self.numbers.pin(numbers)
        resume = _Resume(self._ref, doubt, not_sent, remaining)
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
        err._unpin = resume.unpin = weakref.finalize(err, self.numbers.unpin, numbers)
        return err

    async def _run_scripts(self, calls: list[Call]) -> list[Any]:
        """Run SUBMIT calls in one pipeline (one round trip), loading the script if needed.

        A connection error sends them again (a call that ran replays its reply) with backoff,
        until Redis has been unreachable for ``RedisSettings.command_timeout`` (GaveUp)."""
        what = f"submitting {sum(len(c[2]) for c in calls)} jobs"
        outage = None
        while True:
            try:
                async with self._deadline(what):
                    return await self._run_scripts_now(calls)
            except RETRYABLE as e:
                if outage is None:
                    outage = Outage(self.redis_settings.command_timeout)
                await outage.wait(e, what)
                self.counters["resends"] += 1

    async def _run_scripts_now(self, calls: list[Call]) -> list[Any]:
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

    async def _heal_mirrors(self) -> bool:
        """Mirror the committed version into the shards whose mirror lags it; whether one did."""
        async with self._deadline("healing the shards' mirrors of the policy version"):
            return await heal_mirrors(self._client, self.keys, self.router.shards)

    async def _wait_for_admission(self, n: int, limit: int, stream: str) -> None:
        """The staleness bound refused ``n`` jobs (the last refused call's ``limit``, in the
        shard of ``stream``): wait for a newer policy version, or raise StalenessBound.

        Each shard checks its own part of the bound against its mirror of the version, so
        the calls refused in one shard wait here while the other shards' are enqueued; the
        caller sends them again (new numbers) after the wait, until admitted."""
        if not self.settings.block_when_full:
            where = "" if self.router.shards == 1 else f" of shard {self.router.layout.of_key(stream).shard_index}/{self.router.shards}"
            raise StalenessBound(
                f"admitting {n} more jobs would exceed the staleness bound ({limit} jobs{where} at the current "
                "policy version; see Producer.set_staleness_bound); publish a newer version or wait"
            )
        await asyncio.sleep(self.settings.admission_poll)


class _Resume:
    """:meth:`SubmitInterrupted.resume`: the calls in doubt again, under their numbers, then
    the jobs not sent and the specs not read. Holds the submission weakly."""

    def __init__(self, ref: Any, doubt: list[tuple[list[Job], list[Call]]], not_sent: list[Job],
                 remaining: Iterator[Any] | None):
        self.ref = ref
        self.doubt = doubt
        self.not_sent = not_sent
        self.remaining = remaining
        self.unpin: weakref.finalize | None = None

    async def __call__(self) -> list[JobHandle]:
        sub = self.ref()
        if sub is None or sub._host() is None:
            raise RuntimeError("cannot resume the submission: its producer is gone")
        if self.unpin is not None:
            self.unpin.detach()  # from here on, what is not read is held by the next error, if any
        out: list[JobHandle] = []
        for i, (jobs, calls) in enumerate(self.doubt):
            await sub.ledger.reserve(len(jobs))
            try:
                out += await sub._finish_chunk(jobs, calls, None)
            except SubmitInterrupted as e:
                e._unpin.detach()
                rest = [*e._doubt, *self.doubt[i + 1 :]]
                raise sub._interrupted(str(e), out + e.enqueued, rest, self.not_sent, self.remaining) from e.__cause__
        if self.not_sent or self.remaining is not None:
            rest_specs = itertools.chain(self.not_sent, self.remaining or ())
            try:
                out += await sub.submit_many(rest_specs)
            except SubmitInterrupted as e:
                e.enqueued[:0] = out
                raise
        return out


def _subset(jobs: list[Job], calls: list[Call]) -> tuple[list[Job], list[Call]]:
    """The jobs of ``calls`` (a part of ``jobs``'s calls) and the calls with positions in them."""
    sub: list[Job] = []
    out = []
    for keys, args, part in calls:
        out.append((keys, args, range(len(sub), len(sub) + len(part))))
        sub.extend(jobs[k] for k in part)
    return sub, out
