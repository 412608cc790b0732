"""The jobs a replica holds, from the read that took them until their outcome is queued.

A stream entry is admitted (:meth:`Jobs.admit`: decoded and checked), then it is one of:

- **held**: read while intake was closed (a weight update); it starts when intake opens;
- **waiting** for the policy version it needs (:mod:`rollq.consumer._versions`);
- **running** in the engine, under the request id ``<job id>@<entry id>``;
- **parked**: aborted for a weight update (the ``abort`` policy), to run again from scratch,
  or, with resume, to continue from the samples it had so far (:mod:`rollq.consumer._resume`:
  one engine request per unfinished sample, under ``<request id>~r<k>``, stitched into one
  output when all have reported; their tokens are not streamed, :mod:`rollq.consumer._progress`).

Each is one :class:`~rollq.consumer._in_hand.JobInHand`. A running job ends with the engine's ``done`` callback, a
cancellation or its deadline; its outcome goes to the :class:`~rollq.consumer._finisher.Finisher`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import (
    DeadLettered,
    EngineDead,
    EngineFailed,
    InvalidJob,
    JobCancelled,
    JobExpired,
    JobRejected,
    ProtocolError,
)
from ..protocol import Job, cut, decode_job, encode_job, peek_id
from ._context import ReplicaContext
from .engine import EngineOutput, SwapProgress
from ._in_hand import Failure, JobInHand
from ._progress import ProgressWriter
from . import _resume

if TYPE_CHECKING:
    from ._finisher import Finisher
    from ._versions import VersionWait

log = logging.getLogger(__name__)

class Jobs:
    """The jobs in hand and their moves: admit, hold, start, cancel, abort, restart, end."""

    def __init__(self, ctx: ReplicaContext, finisher: Finisher, versions: VersionWait) -> None:
        self._ctx = ctx
        self._finisher = finisher
        self._versions = versions
        self.running: dict[str, JobInHand] = {}  # request id -> job
        self.by_job: dict[str, str] = {}  # job id -> request id
        self.held: list[JobInHand] = []
        self.parked: list[JobInHand] = []
        #: Job ids cancelled on the control channel lately (job id -> when, unix seconds).
        self.recent_cancels: dict[str, float] = {}
        #: A weight swap is under way (:meth:`begin_swap`): jobs that finish now are held in
        #: :attr:`deferred` until :meth:`mark_swap` says how far each had got, since their
        #: last tokens may come from the new weights.
        self.swap_pending = False
        self.deferred: list[tuple[str, JobInHand, EngineOutput]] = []
        #: Restarts of a job in the engine (job id -> count), to give each its own request id.
        self._restarts: dict[str, int] = {}
        self.restarted: list[JobInHand] = []
        #: Resume: running requests whose abort output is awaited (:meth:`collect_partials`),
        #: set once all reported.
        self._collecting: set[str] = set()
        self._collected = asyncio.Event()
        #: Resumed jobs: request id -> {continuation request id: sample index}, the samples
        #: reported so far, and continuation request id -> request id.
        self._subs: dict[str, dict[str, int]] = {}
        self._sub_out: dict[str, dict[int, Any]] = {}
        self._sub_main: dict[str, str] = {}
        #: Streamed jobs' tokens to Redis while they run (:mod:`rollq.consumer._progress`).
        self.progress = ProgressWriter(ctx)

    def free_slots(self) -> int:
        """Jobs the next read may take: the in-flight cap less what runs or is held. Jobs
        waiting for a policy version do not count, but at ``max_parked`` of them it is 0."""
        if len(self._versions.waiting) >= self._ctx.settings.max_parked:
            return 0
        return self._ctx.capacity.cap - len(self.running) - len(self.held)

    def idle(self) -> bool:
        """Nothing held, waiting, running or waiting to be recorded."""
        return (not self.running and not self.held and not self._versions.waiting and not len(self._finisher)
                and not self.deferred)

    def known_eids(self) -> set[bytes]:
        """Entries this replica has in hand, or whose outcome it has not recorded yet."""
        known = {r.eid for r in self.running.values()}
        known.update(h.eid for h in self.held)
        known.update(w.eid for w in self._versions.waiting)
        known.update(self._finisher.eids())
        known.update(p.eid for p in self.parked)
        known.update(r.eid for _, r, _ in self.deferred)
        known.update(r.eid for r in self.restarted)
        return known

    # -- in ------------------------------------------------------------------------------------
    def admit(self, stream: str, eid: bytes, payload: bytes | None, deliveries: int) -> None:
        """Decode, validate and start one stream entry (or finish it with an error).

        ``payload`` is the entry's ``d`` field (None if it has none: dead-lettered).
        """
        ctx = self._ctx
        s = ctx.settings
        ctx.counters.pulled += 1
        if payload is None:
            self._finisher.fail_entry(stream, eid, deliveries, Failure(DeadLettered, "stream entry has no 'd' field", True))
            return
        try:
            job = decode_job(payload, s.max_prompt_bytes)
        except Exception as e:  # noqa: BLE001 - whatever an entry does, it is dead-lettered, never fatal
            jid, reply = peek_id(payload)
            why = str(e) if isinstance(e, (ProtocolError, InvalidJob)) else f"undecodable entry: {type(e).__name__}"
            self._finisher.fail_entry(stream, eid, deliveries, Failure(JobRejected, cut(why), True, payload), jid, reply)
            return
        held = JobInHand(stream, eid, job, deliveries)
        if deliveries > s.max_deliveries:
            self._finisher.fail(held, Failure(
                DeadLettered, f"delivered {deliveries} times (max_deliveries={s.max_deliveries}); "
                "the replicas running it died or timed out each time", True, payload))
            return
        if self.recent_cancels and job.id in self.recent_cancels:
            self._finisher.fail(held, Failure(JobCancelled, "cancelled before it started"))
            return
        if job.deadline is not None and time.time() > job.deadline:
            self._finisher.fail(held, Failure(JobExpired, "deadline passed while queued"))
            return
        if job.min_version is not None and job.min_version > ctx.version:
            self._versions.park(held)
            return
        self.submit(held)

    def submit(self, held: JobInHand) -> None:
        """Start ``held`` in the engine; while intake is closed, hold it instead."""
        ctx = self._ctx
        if not ctx.intake.is_set():
            # A read that was in flight when intake closed (weight update): hold it until the
            # gate reopens, so it runs on the new version.
            self.held.append(held)
            return
        job = held.job
        rid = f"{job.id}@{held.eid.decode()}"
        k = self._restarts.get(job.id)
        if k:  # a request id of its own, never one vLLM may still be aborting
            rid = f"{rid}~{k}"
        held.started, held.version_start, held.swaps = time.time(), ctx.version, None
        self.running[rid] = held
        self.by_job[job.id] = rid
        progress = self.progress.callback(held, k or 0) if job.stream and ctx.engine.streams_progress else None
        try:
            if progress is None:
                ctx.engine.submit(rid, job, self._on_done)
            else:
                ctx.engine.submit(rid, job, self._on_done, progress)
        except Exception as e:  # an engine must report through done; be safe anyway
            self._on_done(rid, e)

    def release(self) -> None:
        """Start the jobs held while intake was closed and those waiting for the policy
        version now loaded."""
        ctx = self._ctx
        version = ctx.version
        self._versions.loaded(version)
        held, self.held = self.held, []
        for h in held:
            if h.job.min_version is not None and h.job.min_version > version:
                self._versions.park(h)
            else:
                self.submit(h)  # held again while intake is closed
        ready = self._versions.ready(version)
        for w in ready:
            self.submit(w)
        if ready:
            ctx.room.set()

    # -- out -----------------------------------------------------------------------------------
    def _on_done(self, rid: str, out: EngineOutput | BaseException) -> None:
        run = self.running.pop(rid, None)
        if run is None:
            return  # aborted or already finished
        self.by_job.pop(run.job.id, None)
        if rid in self._collecting:
            self._collecting.discard(rid)
            if not self._collecting:
                self._collected.set()
            if isinstance(out, EngineOutput) and any(s.finish_reason == _resume.ABORTED for s in out.samples):
                run.partial = out
                self.parked.append(run)
                return
        self._restarts.pop(run.job.id, None)
        if isinstance(out, EngineOutput):
            if self.swap_pending:
                self.deferred.append((rid, run, out))
                return
            self._finisher.complete(run, out)
        elif isinstance(out, EngineDead):
            self.engine_died(out)  # the job stays pending: a live replica will reclaim it
            return
        elif isinstance(out, InvalidJob):
            self._finisher.fail(run, Failure(JobRejected, str(out), True, _encode_job_safe(run.job)))
        else:
            self._finisher.fail(run, Failure(EngineFailed, f"{type(out).__name__}: {out}"))
        self._ctx.room.set()

    def engine_died(self, error: BaseException) -> None:
        """The engine can no longer serve: stop pulling and exit non-zero. Every job in hand
        stays pending in Redis; shutdown lets go of them at once and ends the lease, so a
        live replica reclaims them (``Consumer._shutdown``)."""
        ctx = self._ctx
        if ctx.engine_error is not None:
            return
        ctx.engine_error = error
        log.error("engine died: %s; consumer %s stops pulling, hands back %d jobs and exits", error, ctx.id,
                  len(self.running) + len(self.held) + len(self._versions.waiting))
        ctx.stop(len(self.running))

    def cancel(self, job_id: str, why: str, error: type[BaseException] = JobCancelled) -> None:
        """Abort a running job and finish it with ``error``; nothing if it is not running."""
        rid = self.by_job.get(job_id)
        if rid is None:
            return
        run = self.running.get(rid)
        if run is None:
            return
        self._abort(rid)
        del self.running[rid]
        del self.by_job[job_id]
        self._restarts.pop(job_id, None)
        self._finisher.fail(run, Failure(error, why))
        self._ctx.room.set()

    def cancelled(self, job_id: str) -> None:
        """The control channel says ``job_id`` was cancelled: end it if it runs, refuse it if
        it is read within the next ten minutes."""
        self.recent_cancels[job_id] = time.time()
        self.cancel(job_id, "cancelled while running")

    def heartbeat_checks(self, cancel_marks: Iterable[tuple[str, Any]]) -> None:
        """Once per heartbeat: end jobs whose cancel key is set (``(job id, mark)`` pairs) or
        whose deadline passed while they ran; forget cancellations older than ten minutes."""
        for jid, mark in cancel_marks:
            if mark is not None:
                self.cancel(jid, "cancelled while running")
        now = time.time()
        for run in list(self.running.values()):  # a deadline passing mid-generation aborts it
            if run.job.deadline is not None and now > run.job.deadline:
                self.cancel(run.job.id, "deadline passed while running", JobExpired)
        now = time.time()
        self.recent_cancels = {k: v for k, v in self.recent_cancels.items() if now - v < 600}

    def begin_swap(self) -> None:
        """A weight swap starts: outputs that arrive from now on wait for :meth:`mark_swap`
        (or :meth:`end_swap`, when the swap failed), since the engine may produce tokens on
        the new weights before the swap's caller resumes."""
        self.swap_pending = True
        self.progress.hold()

    def end_swap(self) -> None:
        """Finish the outputs held back since :meth:`begin_swap` (their swap marks are set)."""
        self.swap_pending = False
        self.progress.release()
        deferred, self.deferred = self.deferred, []
        for _, run, out in deferred:
            self._finisher.complete(run, out)
        if deferred:
            self._ctx.room.set()

    def mark_swap(self, version: int, progress: SwapProgress | None) -> None:
        """Record on every running job, and every job that finished since :meth:`begin_swap`,
        that ``version`` was swapped in, and how far each of its samples had got
        (``progress``; None: not known).

        A running job none of whose samples had a token yet is started again (a request id
        of its own; the engine has a fresh prefix-cache salt by then): its prompt may have
        been, or may be, computed in part with the old weights or reuse prefix blocks cached
        under them, so none of its tokens would be exactly the new version's."""
        restart = []
        for rid, run in [*self.running.items(), *((rid, r) for rid, r, _ in self.deferred)]:
            if progress is None or rid in self._subs:  # a resumed job's requests have other ids
                counts, complete = None, False
            else:
                counts = progress.tokens.get(rid)
                complete = progress.complete
                if counts is None and complete:
                    counts = {}
            if counts is not None and complete and not any(counts.values()):
                if rid in self.running:
                    restart.append(rid)
                    continue
                # It finished already, every token on the new weights over a prompt that may
                # have been computed, or found in the prefix cache, under the old ones.
                counts, complete = None, False
            if run.swaps is None:
                run.swaps = []
            run.swaps.append((version, counts, complete))
        for rid in restart:
            run = self.running.pop(rid)
            self.by_job.pop(run.job.id, None)
            self._abort(rid)
            self.progress.drop(run)
            self._restarts[run.job.id] = self._restarts.get(run.job.id, 0) + 1
            self.restarted.append(run)

    def submit_restarted(self) -> None:
        """Start the jobs :meth:`mark_swap` took back (after the new version is recorded)."""
        restarted, self.restarted = self.restarted, []
        for run in restarted:
            self.submit(run)

    def abort_running(self) -> list[JobInHand]:
        """Abort every running request in the engine; the jobs stay leased to this replica
        and are returned (and kept as parked) for :meth:`restart`."""
        out = []
        for rid, run in list(self.running.items()):
            self._abort(rid)
            out.append(run)
        self.running.clear()
        self.by_job.clear()
        self.parked = list(out)
        return out

    def restart(self, jobs: list[JobInHand]) -> None:
        """Run jobs returned by :meth:`abort_running` or :meth:`partials` again: from where
        they were when they hold a partial output that may be resumed
        (:func:`~rollq.consumer._resume.resumable`), else from scratch."""
        self.parked = []
        for held in jobs:
            partial, held.partial = held.partial, None
            prompt = _resume.prompt_ids_of(held.job, partial) if partial is not None else None
            if partial is not None and prompt is not None and _resume.resumable(held.job, partial):
                self._submit_resumed(held, prompt, partial)
            else:
                self.submit(held)

    # -- resume (WeightSyncSettings.abort_resume) ---------------------------------------------
    def collect_partials(self) -> None:
        """The engine is about to end every running request (``pause("abort")``): keep the
        output each reports (its samples so far, ``finish_reason="abort"``) on the job and
        park it, instead of finishing it; :meth:`partials` waits for them. A request that
        finished before the abort reached it is finished as usual."""
        self._collecting = set(self.running)
        self._collected = asyncio.Event()
        if not self._collecting:
            self._collected.set()

    async def partials(self, timeout: float) -> list[JobInHand]:
        """The jobs parked since :meth:`collect_partials`, once every running request
        reported (at most ``timeout`` seconds; those that did not are aborted and run again
        from scratch). A resumed job running at the time keeps the partial it resumed from
        (its continuations are aborted) and resumes from it again."""
        try:
            await asyncio.wait_for(self._collected.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("%d running requests did not report after the abort; they run again from scratch",
                        len(self._collecting))
        for rid in list(self._collecting):
            run = self.running.pop(rid, None)
            self._collecting.discard(rid)
            if run is None:
                continue
            resumed = rid in self._subs
            self._abort(rid)
            self.by_job.pop(run.job.id, None)
            if not resumed:
                run.partial = None
            self.parked.append(run)
        return list(self.parked)

    def _submit_resumed(self, held: JobInHand, prompt: list[int], partial: EngineOutput) -> None:
        """Continue ``held`` from ``partial`` on the version now served: one request per
        aborted sample; the version it started at stays, and the swap is marked after
        exactly the tokens each sample had."""
        ctx = self._ctx
        job = held.job
        conts = _resume.continuations(job, prompt, partial)
        held.partial = partial
        # Swaps its partial ran through (an earlier resume, a ``keep`` update) stay marked.
        held.swaps = [*(held.swaps or []), (ctx.version, {k: len(s.tokens) // 4 for k, s in enumerate(partial.samples)}, True)]
        k = self._restarts[job.id] = self._restarts.get(job.id, 0) + 1
        rid = f"{job.id}@{held.eid.decode()}~{k}"
        self.running[rid] = held
        self.by_job[job.id] = rid
        if not conts:
            self._finish_resumed(rid, {})
            return
        subs = self._subs[rid] = {f"{rid}~r{j}": j for j in conts}
        self._sub_out[rid] = {}
        for sub, j in subs.items():
            self._sub_main[sub] = rid
        for sub, j in subs.items():
            if rid not in self._subs:
                break  # one of them failed at once
            try:
                ctx.engine.submit(sub, conts[j], self._on_sub_done)
            except Exception as e:  # an engine must report through done; be safe anyway
                self._on_sub_done(sub, e)

    def _on_sub_done(self, sub: str, out: EngineOutput | BaseException) -> None:
        rid = self._sub_main.pop(sub, None)
        if rid is None or rid not in self._subs:
            return
        if not isinstance(out, EngineOutput):
            self._abort(rid)
            self._on_done(rid, out)
            return
        got = self._sub_out[rid]
        got[self._subs[rid][sub]] = out.samples[0]
        if len(got) == len(self._subs[rid]):
            del self._subs[rid]
            self._finish_resumed(rid, self._sub_out.pop(rid))

    def _finish_resumed(self, rid: str, conts: dict[int, Any]) -> None:
        run = self.running.get(rid)
        if run is None or run.partial is None:
            return
        partial, run.partial = run.partial, None
        self._on_done(rid, _resume.stitch(partial, conts))

    def _abort(self, rid: str) -> None:
        """Abort request ``rid`` in the engine; for a resumed job, its continuations."""
        subs = self._subs.pop(rid, None)
        if subs is None:
            self._ctx.engine.abort(rid)
            return
        self._sub_out.pop(rid, None)
        for sub in subs:
            if self._sub_main.pop(sub, None) is not None:
                self._ctx.engine.abort(sub)

    def drop_not_owned(self, owned: set[bytes]) -> None:
        """Abort our copy of running jobs whose entries are no longer pending under this
        consumer (a peer took them over), and forget such waiting ones."""
        for rid, run in list(self.running.items()):
            if run.eid not in owned:
                del self.running[rid]
                self.by_job.pop(run.job.id, None)
                self._restarts.pop(run.job.id, None)
                self._abort(rid)
                log.info("job %s is owned by another replica now; aborted our copy", run.job.id)
        self._versions.keep_only(owned)

    def hand_back(self) -> None:
        """Shutdown: abort what runs and let go of every job in hand (they stay pending in
        Redis; peers reclaim them once the lease is released)."""
        for rid in list(self.running):
            self._abort(rid)
        self.running.clear()
        self.by_job.clear()
        self._restarts.clear()
        self.restarted.clear()
        self.held.clear()
        self._versions.waiting.clear()


def _encode_job_safe(job: Job) -> bytes:
    try:
        return encode_job(job)
    except Exception:
        return b""
