"""Handles of submitted jobs, and the ledger of a producer's outstanding jobs.

The :class:`Ledger` holds what a producer knows about the jobs it submitted and has not seen
consumed: their handles, results that arrived and were not taken yet, results that came
before their handle, and the room left under ``ProducerSettings.max_outstanding``. The
submission path adds handles and reserves room, the result reader delivers results, and a
handle or :meth:`Producer.results` consumes them (which frees the room).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from typing import Any, AsyncIterator

import msgspec

from ..errors import JobCancelled, JobRejected, QueueFull, job_error
from ..protocol import ErrorInfo, Job, ProgressEntry, Result, short
from ._progress import read_progress
from ..settings import ProducerSettings

log = logging.getLogger(__name__)

#: Results remembered as taken, to drop a second result for the same job id (two generations
#: of this many ids each).
DELIVERED_MEMORY = 1 << 16
#: Where a queued job is: (stream, entry id, id recorded); what cancel() removes.
Entry = tuple[str, bytes, bool]


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
    #: Where the job is while it is queued: what cancel() removes.
    _entry: Entry | None = None
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

    async def stream(self) -> AsyncIterator[ProgressEntry]:
        """The job's tokens while it runs (it was submitted with ``stream=True``): one
        :class:`~rollq.protocol.ProgressEntry` per piece (a sample's tokens after ``offset``),
        until its result is in; then ``await handle.result()`` (the record: it may hold more
        tokens than the pieces). Only the newest delivery's pieces are yielded: a job run
        again after its replica died starts over at offset 0 with a new ``attempt``
        (:mod:`rollq.producer._progress`). Ends at once when the result is in already.

        >>> async for piece in handle.stream():   # doctest: +SKIP
        ...     print(piece.sample, piece.offset, piece.token_ids)
        """
        target = self._twin or self
        producer = self._producer()
        if producer is None:
            raise RuntimeError(f"cannot stream job {self.id!r}: its producer is gone")
        entry = target._entry
        if target._result is not None or entry is None or producer._client is None:
            return
        try:
            key = producer._map.of_key(entry[0]).progress(producer.id, self.id)
        except KeyError:
            return
        result = asyncio.get_running_loop().create_future()  # resolved by _set, as a waiter
        if target._waiters is None:
            target._waiters = []
        target._waiters.append(result)
        try:
            async for piece in read_progress(producer._progress, key, result):
                yield piece
        finally:
            if not result.done():
                result.cancel()
                try:
                    target._waiters.remove(result)  # type: ignore[union-attr]
                except (AttributeError, ValueError):
                    pass

    async def cancel(self) -> bool:
        """Cancel the job (queued: it never runs; running: its engine request is aborted)."""
        producer = self._producer()
        if producer is None:
            raise RuntimeError(f"cannot cancel job {self.id!r}: its producer is gone")
        return await producer.cancel(self.id)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"JobHandle({self.id!r}, {state})"


class Ledger:
    """A producer's outstanding jobs: submitted, result not consumed yet.

    ``ref`` is the producer, weakly, for the handles made here. :meth:`connect` makes the
    events (room freed, results arrived) on the running loop.
    """

    def __init__(self, settings: ProducerSettings, counters: dict[str, int], ref: Any):
        self.settings = settings
        self.counters = counters
        self.ref = ref
        self.handles: dict[str, JobHandle] = {}  # outstanding jobs (result not consumed yet)
        self.completed: OrderedDict[str, Result] = OrderedDict()  # arrived, not consumed yet
        self.orphans: dict[str, Result] = {}  # results that arrived before any handle
        self.cancelled: set[str] = set()  # cancelled while running: their result is dropped
        self.delivered = _RecentIds(DELIVERED_MEMORY)  # ids whose results were taken
        self.outstanding = 0
        self.room: asyncio.Event | None = None  # set when outstanding jobs were consumed
        self.room_waiters = 0
        self.arrived: asyncio.Event | None = None  # set when results were delivered

    def connect(self) -> None:
        self.room = asyncio.Event()
        self.arrived = asyncio.Event()

    # -- room under max_outstanding --------------------------------------------------------
    async def reserve(self, n: int) -> None:
        """Take room for ``n`` jobs: wait for it (``block_when_full``) or raise QueueFull."""
        cap = self.settings.max_outstanding
        if n > cap:
            raise QueueFull(f"a batch of {n} jobs exceeds max_outstanding={cap}; submit smaller batches")
        if self.outstanding + n <= cap:
            self.outstanding += n
            return
        if not self.settings.block_when_full:
            raise QueueFull(
                f"{self.outstanding} jobs outstanding, cap is {cap} (ProducerSettings.max_outstanding); "
                "consume results or set block_when_full=True"
            )
        assert self.room is not None
        self.room_waiters += 1
        try:
            while self.outstanding + n > cap:
                self.room.clear()
                await self.room.wait()
        finally:
            self.room_waiters -= 1
        self.outstanding += n

    def release(self, n: int) -> None:
        self.outstanding -= n
        if self.room_waiters and self.room is not None:
            self.room.set()

    # -- handles ---------------------------------------------------------------------------
    def add(self, jobs: list[Job], entries: list[Entry | None], dups: list[bytes], foreign: dict[str, str]) -> list[JobHandle]:
        """Handles of ``jobs`` (``entries``: where each was queued; ``dups``: ids SUBMIT
        skipped; ``foreign``: those of them queued by another producer -> its id)."""
        if not dups:  # the common case: every job was enqueued
            handles = [JobHandle(job.id, self.ref, entry) for job, entry in zip(jobs, entries)]
            if self.orphans:
                for h in handles:
                    self.register(h)
            else:
                known = self.handles
                for h in handles:
                    known[h.id] = h
            self.counters["submitted"] += len(jobs)
            return handles
        return self._add_with_duplicates(jobs, entries, dups, foreign)

    def add_enqueued(self, jobs: list[Job], stream: str, eids: list[bytes]) -> list[JobHandle]:
        """Handles of ``jobs``, all enqueued in ``stream`` as ``eids``, none of them seen before."""
        ref, known = self.ref, self.handles
        handles = [JobHandle(job.id, ref, (stream, eid, job.tracked)) for job, eid in zip(jobs, eids)]
        for h in handles:
            known[h.id] = h
        self.counters["submitted"] += len(jobs)
        return handles

    def _add_with_duplicates(
        self, jobs: list[Job], entries: list[Entry | None], dups: list[bytes], foreign: dict[str, str],
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
            first = self.handles.get(job.id)
            h = JobHandle(job.id, self.ref, entry, duplicate=dup)
            if first is None or (not dup and job.id in self.orphans):
                self.register(h)
            elif dup:  # resubmitted while ours is still outstanding: one result, shared
                self.release(1)
                h._twin = first._twin or first
            else:
                self.handles[job.id] = h
            if dup and job.id in foreign and not h.done():
                # Queued by another producer: its result goes there, never here.
                res = Result(id=job.id, error=ErrorInfo(
                    type=JobRejected.__name__,
                    message=f"job id {job.id!r} is already queued or running for producer {foreign[job.id]!r}, "
                            "which receives its result; this submission was a no-op",
                ))
                h._set(res)
                self.completed[job.id] = res
            handles.append(h)
        self.counters["submitted"] += len(jobs) - len(dups)
        self.counters["duplicates"] += len(dups)
        return handles

    def register(self, h: JobHandle) -> None:
        """Make ``h`` the handle of its job; it adopts a result that came before it did."""
        res = self.orphans.pop(h.id, None) if self.orphans else None
        if res is None:
            self.handles[h.id] = h
            return
        # The result was read before the submission's reply was handled: deliver() counted
        # it as a job of its own; it is this one.
        h._set(res)
        held = self.handles.get(h.id)
        if held is not None and held._result is res:  # not taken yet: h takes its place
            self.handles[h.id] = h
        self.release(1)

    # -- results ---------------------------------------------------------------------------
    def deliver(self, res: Result) -> None:
        """Resolve the handle of ``res``; a second result for a job id is dropped (held, or
        taken not long ago: ``DELIVERED_MEMORY``), so the trainer never sees one id twice."""
        self.counters["results"] += 1
        jid = res.id
        if self.cancelled and jid in self.cancelled:  # its handle already holds JobCancelled
            self.cancelled.discard(jid)
            return
        h = self.handles.get(jid)
        if h is None:
            if jid in self.delivered:  # its result was taken: this one is a second
                self.counters["duplicate_results"] += 1
                log.warning("dropping a second result for job %s", short(jid))
                return
            # A result of a previous incarnation of this producer, or one read before the
            # reply of its own submission was handled (its handle adopts it: register()).
            h = self.handles[jid] = JobHandle(jid, self.ref)
            self.outstanding += 1
            if len(self.orphans) > 100_000:
                self.orphans.clear()
            self.orphans[jid] = res
        elif h.done():
            self.counters["duplicate_results"] += 1  # a second result for what we hold
            return
        h._entry = None
        h._set(res)
        self.completed[jid] = res

    def consume(self, job_id: str, res: Result) -> None:
        """``res`` was taken by its handle or by results(): forget it, free room (once)."""
        h = self.handles.get(job_id)
        if h is None or h._result is not res:
            return  # already taken
        del self.handles[job_id]
        self.delivered.add(job_id)
        if self.completed.get(job_id) is res:
            del self.completed[job_id]
        self.release(1)

    def cancelled_by_submitter(self, h: JobHandle, running: bool) -> None:
        """``h``'s job was cancelled: its handle holds JobCancelled (and the room is free);
        the result of a job that was ``running`` is dropped when it comes."""
        if running:
            self.cancelled.add(h.id)
        res = Result(id=h.id, error=ErrorInfo(type=JobCancelled.__name__, message="cancelled by the submitter"))
        h._set(res)
        self.consume(h.id, res)


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
