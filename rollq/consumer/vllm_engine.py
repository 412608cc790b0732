"""The :class:`~rollq.consumer.engine.Engine` adapter for vLLM's v1 ``AsyncLLM``.

One asyncio task per request iterates ``AsyncLLM.generate`` with
``RequestOutputKind.FINAL_ONLY`` (vLLM sends one output per request, not one per token; a
streamed job's is ``DELTA``: :mod:`~rollq.consumer._vllm_stream`) and
reports through ``done`` exactly once, unless the request was aborted. Prompts are tokenized
here, so the context-length check happens before vLLM sees the request:

- ``job.text``: ``tokenizer.encode(text)`` (special tokens added as vLLM would);
- ``job.tokens``: used as they are;
- ``job.messages``: the tokenizer's chat template with ``add_generation_prompt=True``.

Length policy: a job whose ``prompt tokens + max_tokens`` exceeds ``max_model_len`` is
refused with :class:`~rollq.errors.PromptTooLong` (as :class:`EchoEngine` does), so every
sample can reach ``max_tokens``. With ``VllmEngineConfig(truncate_generation=True)`` only a
prompt that leaves no room for one token is refused, and ``max_tokens`` is cut to fit.

Errors reach ``done`` as values: :class:`~rollq.errors.InvalidJob` for parameters or prompts
vLLM refuses, :class:`~rollq.errors.EngineDead` once the engine core is gone (every later
request gets it too), :class:`~rollq.errors.EngineFailed` for anything else.

Load signals come from vLLM's own per-step statistics (:mod:`rollq.consumer._vllm_stats`);
see :meth:`VllmEngine.stats`. What differs between vLLM versions is asked of the installed
one in :mod:`rollq.consumer._vllm_api`.

>>> import asyncio
>>> from rollq.protocol import Job, SamplingParams
>>> async def main():  # doctest: +SKIP
...     engine = VllmEngine(VllmEngineConfig(model="/path/to/model", max_model_len=2048))
...     await engine.start()
...     fut = asyncio.get_running_loop().create_future()
...     job = Job(id="j1", reply="p1", text="hello", sampling=SamplingParams(max_tokens=8))
...     engine.submit("j1", job, lambda rid, out: fut.set_result(out))
...     print((await fut).samples[0].token_ids)
...     await engine.stop()
>>> if __name__ == "__main__":  # AsyncLLM starts processes: scripts need this guard
...     asyncio.run(main())  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import EngineDead, EngineFailed, InvalidJob, PromptTooLong, RollqError
from ..protocol import Job, SamplingParams
from ..weightsync.replica.worker_calls import WorkerCalls
from . import _vllm_api, _vllm_children, _vllm_liveness
from .engine import DoneCallback, Engine, EngineOutput, EngineStats, ProgressCallback, SwapProgress
from ._vllm_stream import DeltaFold
from ._vllm_api import DEFAULT_CPU_KV_CACHE_BYTES, _Api, _vllm
from .vllm_config import VllmEngineConfig
from ._vllm_stats import StatsSink, stat_logger_factory
from ._vllm_swaps import SwapLedger

if TYPE_CHECKING:
    from ..weightsync.wire import Progress

logger = logging.getLogger(__name__)

__all__ = ["VllmEngine", "DEFAULT_CPU_KV_CACHE_BYTES"]

#: How long :meth:`VllmEngine.stop` waits for request tasks to unwind.
STOP_TIMEOUT_S = 10.0


class VllmEngine(Engine):
    """Drives one vLLM ``AsyncLLM`` (one replica, ``tensor_parallel_size`` devices).

    Call :meth:`start` on the event loop that will submit requests; every method must be
    called from that loop.

    >>> engine = VllmEngine(VllmEngineConfig(model="/models/tiny", max_model_len=512))
    >>> engine.name
    'vllm'
    """

    name = "vllm"
    #: vLLM's ``pause_generation(mode="abort")`` ends each request with its tokens and
    #: logprobs so far (``finish_reason="abort"``), which ``done`` gets.
    reports_aborted = True
    streams_progress = True

    def __init__(self, config: VllmEngineConfig | str) -> None:
        if not isinstance(config, VllmEngineConfig):
            config = VllmEngineConfig(model=str(config))
        self.config = config
        self.model = config.model
        self.device = "?"
        self.seeds_ok = True
        #: Context window of the loaded model (set by :meth:`start`).
        self.max_model_len = 0
        #: vLLM's version string (set by :meth:`start`).
        self.vllm_version = ""
        #: Seconds :meth:`start` took.
        self.start_seconds = 0.0
        #: When set, added to every new request's prefix-cache key (vLLM ``cache_salt``), so
        #: no prefix cached under another salt is reused. :meth:`reset_prefix_cache` sets a
        #: fresh one when vLLM cannot drop its cache (requests still hold blocks).
        self.cache_salt: str | None = None
        self._salt_generation = 0
        self._api: _Api | None = None
        self._llm: Any = None
        self._tokenizer: Any = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: The requests as swaps' progress reports concern them.
        self._swaps = SwapLedger()
        self._background: set[asyncio.Task[Any]] = set()
        self._sink = StatsSink()
        self._dead: str | None = None
        self._stopping = False
        self._progress_complete = False

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM`` (None before :meth:`start`)."""
        return self._llm

    @property
    def tokenizer(self) -> Any:
        """The tokenizer vLLM loaded (None before :meth:`start`)."""
        return self._tokenizer

    async def start(self) -> None:
        """Build the engine: engine-core and worker processes, model load, KV cache.

        Slow (each of the three processes imports vLLM), so the import and the blocking
        construction run in a thread and the loop keeps serving (heartbeats, for one).
        """
        if self._llm is not None:
            return
        t0 = time.perf_counter()
        _vllm_api.spawn_if_cuda_in_use()
        api: _Api = await asyncio.to_thread(_vllm)  # importing vLLM is slow
        self._api = api
        _vllm_children.install()  # its processes end with this one, even if it is SIGKILLed
        args = _vllm_api.engine_args(api, self.config)
        factory = stat_logger_factory(self._sink)
        build = asyncio.ensure_future(asyncio.to_thread(
            api.AsyncLLM.from_engine_args, args, usage_context=api.serving_context, stat_loggers=[factory]))
        try:
            llm = await asyncio.shield(build)
        except asyncio.CancelledError:
            # The thread cannot be stopped: shut the engine down whenever it comes up.
            build.add_done_callback(_vllm_liveness.shut_down_when_built)
            raise
        try:
            # Start vLLM's output handler on this loop now (it would start with the first
            # request), so engine-core failures are seen before any request is sent.
            run_handler = getattr(llm, "_run_output_handler", None)
            if run_handler is not None:
                run_handler()
            tok = llm.get_tokenizer()
            self._tokenizer = await tok if inspect.isawaitable(tok) else tok
            model_config = getattr(llm, "model_config", None) or llm.vllm_config.model_config
            self.max_model_len = int(model_config.max_model_len)
        except BaseException:
            llm.shutdown()
            raise
        self._llm = llm
        self._dead, self._stopping = None, False
        if self.config.worker_extension_cls:
            try:  # per-token versions: workers remember requests they let go of
                got = await WorkerCalls(self).track_progress(timeout=30)
                self._progress_complete = bool(got) and all(got)
            except Exception as e:  # noqa: BLE001 - an extension without the method
                logger.info("workers do not track request progress (%s); version boundaries of "
                            "requests that ended just before a swap are recorded as unknown", e)
        self.vllm_version = api.version
        self.dtype = _vllm_api.served_dtype(llm)
        self.device = _vllm_api.device_name(self.config.tensor_parallel_size)
        sched = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        #: Seeded jobs are safe here: False on CPU with chunked prefill on (see
        #: :func:`~rollq.consumer._vllm_api.unchunked_prefill_args`); such jobs are refused.
        self.seeds_ok = not (self.device.startswith("cpu") and bool(getattr(sched, "enable_chunked_prefill", False)))
        if not self.seeds_ok:
            logger.warning("vLLM's CPU backend with chunked prefill on dies on seeded requests whose prefill is "
                           "chunked; this replica refuses jobs with a seed (set VllmEngineConfig.max_model_len "
                           "and leave chunking to rollq to serve them)")
        self.tp_size = self.config.tensor_parallel_size
        self.start_seconds = time.perf_counter() - t0
        logger.info(
            "vLLM %s up in %.1fs: model=%s device=%s dtype=%s max_model_len=%d",
            api.version, self.start_seconds, self.model, self.device, self.dtype, self.max_model_len,
        )

    async def stop(self) -> None:
        """Shut the engine down. Requests still running get ``done(rid, EngineDead(...))``."""
        if self._llm is None or self._stopping:
            return
        self._stopping = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        background = list(self._background)
        if tasks or background:
            await asyncio.wait(tasks + background, timeout=STOP_TIMEOUT_S)
        llm, self._llm = self._llm, None
        self._dead = "the engine was stopped"
        t0 = time.perf_counter()
        await _vllm_liveness.shut_down(llm, STOP_TIMEOUT_S)
        del llm
        # AsyncLLM sits in reference cycles; collect it now, while the interpreter is whole,
        # or its __del__ runs at exit and prints a TypeError.
        gc.collect()
        logger.info(
            "vLLM engine stopped in %.1fs (%d requests were running)", time.perf_counter() - t0, len(tasks)
        )

    # -- requests ----------------------------------------------------------------------
    def submit(self, request_id: str, job: Job, done: DoneCallback, progress: ProgressCallback | None = None) -> None:
        """Start ``job``; ``done(request_id, EngineOutput | exception)`` follows once (and with
        ``progress``, each step's new tokens: :mod:`~rollq.consumer._vllm_stream`).

        Raises ``RuntimeError`` before :meth:`start` and ``ValueError`` for a request id that
        is already running (both are caller bugs, not job errors).
        """
        if self._llm is None and self._dead is None:
            raise RuntimeError("VllmEngine.submit() called before start()")
        if request_id in self._tasks:
            raise ValueError(f"request id {request_id!r} is already running")
        self._tasks[request_id] = asyncio.create_task(self._run(request_id, job, done, progress))
        self._swaps.started(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel the request's task and free it in vLLM; ``done`` is not called for it.

        vLLM's ``generate`` aborts on cancellation too, but not when the cancellation lands
        while the request is being added; the explicit ``AsyncLLM.abort`` after the task has
        unwound covers that window."""
        task = self._tasks.pop(request_id, None)
        self._swaps.dropped(request_id)
        if task is None:
            return
        task.cancel()
        if self._llm is not None:
            self._spawn(_abort_after(self._llm, task, request_id))

    async def _run(self, rid: str, job: Job, done: DoneCallback, progress: ProgressCallback | None = None) -> None:
        me = asyncio.current_task()
        try:
            outcome: EngineOutput | BaseException = await self._generate(rid, job, progress)
        except asyncio.CancelledError:
            if not (self._stopping and self._tasks.get(rid) is me):
                raise  # aborted: the caller no longer wants an answer
            outcome = EngineDead("the vLLM engine was stopped while the job was running")
        except Exception as e:  # noqa: BLE001 - every failure becomes the job's outcome
            outcome = self._classify(e, job)
        # ``done`` is owed only while this task still owns the request id (abort removes it).
        if self._tasks.get(rid) is not me:
            return
        del self._tasks[rid]
        self._swaps.reported(rid)
        try:
            done(rid, outcome)
        except Exception:
            logger.exception("done callback failed for request %s", rid)

    async def _generate(self, rid: str, job: Job, progress: ProgressCallback | None = None) -> EngineOutput:
        if self._dead is not None:
            raise EngineDead(f"vLLM engine is not serving: {self._dead}")
        llm, api = self._llm, self._api
        assert api is not None
        if llm.errored:
            raise api.EngineDeadError()
        sp = job.sampling
        if sp.seed is not None and not self.seeds_ok:
            raise InvalidJob("this replica cannot run seeded jobs: vLLM's CPU backend with chunked prefill on kills its "
                             "engine on them (send the job without a seed, or start the replica with max_model_len set)")
        prompt_ids = self._prompt_ids(job)
        params = api.sampling_params(sp, self._check_length(len(prompt_ids), sp), stream=progress is not None)
        if sp.prompt_logprobs is not None and len(prompt_ids) < 2:
            raise InvalidJob("prompt_logprobs needs a prompt of at least 2 tokens (the first has no logprob)")
        final, fold = None, DeltaFold(progress, sp.logprobs is not None, sp.detokenize) if progress else None
        # FINAL_ONLY: vLLM yields once, when all n samples finished; DELTA (streamed): once a step.
        async for out in llm.generate(api.prompt(prompt_ids, self.cache_salt), params, rid):
            final = out
            if fold is not None:
                fold.add(out)
        if (final := fold.final() if fold is not None else final) is None:
            raise EngineFailed(f"vLLM returned no output for job {job.id}", job_id=job.id)
        return _vllm_api.to_output(final, sp, prompt_ids, job.tokens is None, self.config.logprobs_mode)

    def _prompt_ids(self, job: Job) -> list[int]:
        if job.tokens is not None:
            return job.prompt_token_ids or []
        tok = self._tokenizer
        if tok is None:
            raise InvalidJob("this engine has no tokenizer; send prompt token ids")
        if job.text is not None:
            return list(tok.encode(job.text))
        messages = [{"role": m.role, "content": m.content} for m in job.messages or ()]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors, missing template
            raise InvalidJob(f"cannot apply the tokenizer's chat template: {e}") from e
        return list(tok.encode(text, add_special_tokens=False))

    def _check_length(self, n_prompt: int, sp: SamplingParams) -> int:
        """Enforce the length policy; return the max_tokens to ask vLLM for."""
        limit = self.max_model_len
        if n_prompt == 0:
            raise InvalidJob("the prompt is empty")
        if n_prompt + sp.max_tokens <= limit:
            return sp.max_tokens
        if self.config.truncate_generation and n_prompt < limit:
            return limit - n_prompt
        raise PromptTooLong(
            f"prompt of {n_prompt} tokens + max_tokens {sp.max_tokens} exceeds the model's "
            f"context of {limit} tokens (max_model_len); shorten the prompt or lower max_tokens"
            + ("" if self.config.truncate_generation else
               " (VllmEngineConfig.truncate_generation=True cuts max_tokens instead)")
        )

    def _classify(self, e: BaseException, job: Job) -> BaseException:
        """Map an exception from a request to the error its job reports."""
        if isinstance(e, RollqError):
            return e
        api, llm = self._api, self._llm
        assert api is not None
        if isinstance(e, api.EngineDeadError) or (llm is not None and llm.errored):
            self._dead = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            logger.error("vLLM engine is dead (%s); every further job fails with EngineDead", self._dead)
            return EngineDead(f"vLLM engine died: {self._dead}")
        if isinstance(e, api.client_errors):
            return InvalidJob(f"vLLM refused job {job.id}: {e}")
        cause = e.__cause__ or e  # EngineGenerateError carries the real error as its cause
        logger.warning("vLLM failed on job %s: %r", job.id, cause)
        return EngineFailed(f"vLLM failed on job {job.id}: {type(cause).__name__}: {cause}", job_id=job.id)

    def _spawn(self, coro: Any) -> None:
        self._background.add(task := asyncio.get_running_loop().create_task(coro))
        task.add_done_callback(self._background.discard)

    # -- load signals ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """vLLM's latest scheduler view plus cumulative counters.

        - ``running``: sequences the scheduler is running (a job with ``n`` samples counts
          ``n``), ``SchedulerStats.num_running_reqs``, summed over engine cores;
        - ``waiting``: sequences queued, ``num_waiting_reqs`` (+ ``num_skipped_waiting_reqs``);
        - ``kv_usage``: ``SchedulerStats.kv_cache_usage``, 0..1 (None before the first step);
        - ``preemptions``, ``generated_tokens``: sums of ``IterationStats.num_preempted_reqs``
          and ``num_generation_tokens`` since start;
        - ``extra``: ``prompt_tokens``, ``finished_requests``, ``prefix_cache_queries`` /
          ``prefix_cache_hits`` (tokens), ``inflight_jobs`` (this adapter's tasks),
          ``unfinished_requests`` (vLLM front end), ``stats_age_s`` (since the last step
          report; vLLM reports only while it steps).

        >>> VllmEngine("/m").stats().running
        0
        """
        return self._sink.engine_stats(len(self._tasks), _vllm_api.unfinished(self._llm))

    def step_gaps(self, since: float, until: float | None = None) -> list[float]:
        """Seconds between consecutive engine steps seen in ``[since, until]`` (``time.monotonic``
        clock); the largest is how long generation stood still in that window."""
        return self._sink.step_gaps(since, until)

    def steps_seen(self, since: float, until: float | None = None) -> list[float]:
        """When engine steps were seen in ``[since, until]`` (``time.monotonic`` clock), in
        order: where a gap of :meth:`step_gaps` began and ended."""
        return self._sink.steps_seen(since, until)

    def capacity_hint(self) -> int | None:
        """vLLM's scheduler limit (``max_num_seqs``): how many sequences it schedules at once,
        which the consumer sizes its in-flight cap to (None before :meth:`start`)."""
        sc = getattr(getattr(self._llm, "vllm_config", None), "scheduler_config", None)
        n = getattr(sc, "max_num_seqs", None)
        return int(n) if n else None

    # -- weight updates ----------------------------------------------------------------
    async def pause(self, mode: str = "keep", *, clear_cache: bool = False) -> None:
        """Stop scheduling: ``keep`` freezes running requests (they continue after
        :meth:`resume`), ``abort`` ends them (their ``done`` gets samples with
        ``finish_reason="abort"`` and the tokens so far), ``wait`` lets them finish first.

        ``clear_cache=True`` also drops the KV and prefix caches (running requests are then
        recomputed on resume); weight sync normally calls :meth:`reset_prefix_cache` instead.
        vLLM keeps accepting requests while paused and runs them after resume.
        """
        llm = self._require()
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        await self._while_alive(_vllm_api.pause_generation(llm, mode, clear_cache, self.vllm_version))

    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""
        await self._while_alive(self._require().resume_generation())

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """Make sure no new request reuses a prefix cached before this call.

        vLLM drops its prefix cache only when no request holds KV blocks (e.g. not while
        requests are frozen by ``pause("keep")``), unless ``reset_running_requests``
        (running requests are then preempted and recomputed). When it refuses, a fresh
        :attr:`cache_salt` is used for every later request instead, which has the same effect
        on new requests and leaves the running ones alone. Returns whether vLLM itself reset.
        """
        ok = await self._while_alive(_vllm_api.reset_prefix_cache(self._require(), reset_running_requests))
        if not ok:
            self.new_cache_salt()
            logger.info("vLLM kept its prefix cache (requests hold KV blocks); new requests use cache_salt %r", self.cache_salt)
        return ok

    def new_cache_salt(self) -> str:
        """Give every later request a fresh :attr:`cache_salt`: no prefix cached before this
        call is reused (the old blocks age out of vLLM's cache). No engine call involved."""
        self._salt_generation += 1
        self.cache_salt = f"rollq-prefix-{self._salt_generation}"
        return self.cache_salt

    async def call_workers(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """:meth:`Engine.call_workers`: ``method(*args, **kwargs)`` in every vLLM worker (a
        method of ``worker_extension_cls``), one result per worker."""
        return await self.collective_rpc(method, args=args, kwargs=kwargs or None, timeout=timeout)

    async def collective_rpc(
        self,
        method_name: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``method_name`` on every worker (a method of ``worker_extension_cls`` or of the
        worker itself) and return one result per worker.

        >>> await engine.collective_rpc("reload_from", args=("/dev/shm/w/v3",))  # doctest: +SKIP
        """
        return await self._while_alive(
            self._require().collective_rpc(method_name, timeout=timeout, args=tuple(args), kwargs=kwargs)
        )

    @property
    def num_workers(self) -> int:
        """vLLM workers of this replica (tensor x pipeline parallel); each joins weight broadcasts."""
        pc = getattr(getattr(self._llm, "vllm_config", None), "parallel_config", None)
        if pc is not None:
            return int(getattr(pc, "world_size", self.config.tensor_parallel_size))
        return self.config.tensor_parallel_size

    def progress_since(self) -> float:
        """:meth:`Engine.progress_since`: the oldest submission of a request whose output this
        adapter still waits for, less a slack (:meth:`~rollq.consumer._vllm_swaps.SwapLedger.since`)."""
        return self._swaps.since()

    def swap_progress(self, report: Progress | None) -> SwapProgress | None:
        """A worker's swap progress (:meth:`rollq.weightsync.worker._progress.RequestTracker.report`)
        mapped to this adapter's request ids (:meth:`~rollq.consumer._vllm_swaps.SwapLedger.progress`)."""
        return None if report is None else self._swaps.progress(report, self._progress_complete)

    def _require(self) -> Any:
        if self._llm is None:
            raise RuntimeError("the vLLM engine is not running (start() it first)")
        return self._llm

    # -- liveness ----------------------------------------------------------------------
    def failure(self) -> EngineDead | None:
        """:meth:`Engine.failure`: the engine-core process exited (or a request found the
        engine dead). None before :meth:`start` and once :meth:`stop` was called."""
        if self._stopping:
            return None
        if self._dead is None:
            why = _vllm_liveness.core_failure(self._llm)
            if why is None:
                return None
            self._dead = why
            logger.error("vLLM engine is dead (%s); every further job fails with EngineDead", why)
        return EngineDead(f"vLLM engine died: {self._dead}")

    async def _while_alive(self, call: Any) -> Any:
        """Await a call into the engine core; raise :class:`~rollq.errors.EngineDead` as soon
        as the engine is dead (vLLM never answers a call whose engine core died)."""
        api = self._api
        assert api is not None
        try:
            return await _vllm_liveness.until_dead(call, self.failure)
        except api.EngineDeadError as e:
            raise self.failure() or EngineDead(f"vLLM engine died: {type(e).__name__}") from e


async def _abort_after(llm: Any, task: asyncio.Task[Any], request_id: str) -> None:
    await asyncio.wait([task])  # let generate() unwind (it aborts what it had registered)
    try:
        await llm.abort(request_id)
    except Exception:  # the engine may be gone; nothing left to free then
        logger.debug("vLLM abort of %s failed", request_id, exc_info=True)
