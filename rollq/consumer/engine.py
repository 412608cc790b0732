"""The narrow interface between the consumer loop and an inference engine.

The consumer loop does not know whether it drives vLLM or the built-in :class:`EchoEngine`;
it only calls :meth:`Engine.submit` / :meth:`Engine.abort` and receives each outcome through
the ``done`` callback, on the event loop. That callback shape (rather than one awaited
coroutine per job) lets a fast engine finish thousands of jobs per second without creating
an asyncio task per job.
"""

from __future__ import annotations

import abc
import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InvalidJob
from ..protocol import Job, Sample, pack_f32, pack_i32, unpack_i32

if TYPE_CHECKING:
    from ..weightsync.wire import Progress

_LOGPROB_BYTES = pack_f32([-0.5] * 4096)


@dataclass
class EngineOutput:
    """What an engine returns for one job: ``n`` samples.

    ``prompt_ids``: the prompt as the engine tokenized it (int32 bytes; set for text and
    chat prompts); ``prompt_logprobs``: float32 bytes, one per prompt token (NaN for the
    first), when the job asked for them.
    """

    samples: list[Sample]
    prompt_tokens: int = 0
    prompt_ids: bytes | None = None
    prompt_logprobs: bytes | None = None


@dataclass
class SwapProgress:
    """How far each running request had got when new weights were swapped in.

    ``tokens``: request id -> {sample index: tokens generated before the swap}.
    ``complete``: a request (or sample) missing from ``tokens`` had generated nothing yet;
    otherwise its count is not known.
    """

    tokens: dict[str, dict[int, int]] = field(default_factory=dict)
    complete: bool = False


@dataclass
class EngineStats:
    """Load signals the consumer's capacity controller reads (all optional but ``running``)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None  # 0..1 fraction of KV-cache blocks in use
    preemptions: int = 0  # cumulative
    generated_tokens: int = 0  # cumulative
    extra: dict[str, Any] = field(default_factory=dict)


#: ``done(request_id, output_or_exception)``; called exactly once per submitted request
#: unless the request was aborted, always on the event loop thread.
DoneCallback = Callable[[str, "EngineOutput | BaseException"], None]
#: ``progress(sample, offset, tokens, logprobs, text)``: sample ``sample`` generated
#: ``tokens`` (int32 bytes) after its first ``offset`` ones, with their ``logprobs`` (float32
#: bytes; None unless the job asked) and the ``text`` they added (None where the engine does
#: not detokenize); on the event loop thread, never after ``done`` or :meth:`Engine.abort`.
ProgressCallback = Callable[[int, int, bytes, "bytes | None", "str | None"], None]
#: Most progress calls :class:`EchoEngine` makes per sample of a request (it reports its
#: tokens in at most this many pieces, spread over the request's delay).
ECHO_PROGRESS_STEPS = 64


class Engine(abc.ABC):
    """An inference engine the consumer drives.

    Contract:
    - :meth:`submit` must not block; it starts the request and returns.
    - ``done`` is called once per request, on the loop, with an :class:`EngineOutput` or an
      exception (:class:`~rollq.errors.InvalidJob` for a job the engine refuses,
      :class:`~rollq.errors.EngineDead` when the engine can no longer serve).
    - After :meth:`abort`, ``done`` is not called for that request.
    """

    #: Short name shown in status views ("echo", "vllm").
    name: str = "engine"
    #: Model identifier shown in status views.
    model: str = ""
    #: Device description shown in status views.
    device: str = "cpu"
    #: Devices (tensor-parallel ranks) the engine spans; each is one weight-broadcast receiver.
    tp_size: int = 1
    #: The dtype the model's floating-point weights are served in ("" for engines without weights).
    dtype: str = ""
    #: ``pause("abort")`` ends running requests through ``done``, with each sample's tokens
    #: so far and ``finish_reason="abort"`` (what a resume continues from; engines that do
    #: not are aborted and run again from scratch).
    reports_aborted: bool = False
    #: :meth:`submit` takes a ``progress`` callback (streamed jobs); engines without it get
    #: no callback and their streamed jobs publish only their result.
    streams_progress: bool = False

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Bring the engine up (load the model)."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""

    @abc.abstractmethod
    def submit(self, request_id: str, job: Job, done: DoneCallback, progress: ProgressCallback | None = None) -> None:
        """Start generating ``job``; report through ``done`` (and, where
        :attr:`streams_progress`, each sample's new tokens through ``progress`` as they come)."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a running request; ``done`` will not be called for it."""

    def stats(self) -> EngineStats:
        return EngineStats()

    def failure(self) -> BaseException | None:
        """Why the engine can no longer serve (an :class:`~rollq.errors.EngineDead`), or None
        while it can. Cheap: the consumer asks every heartbeat, and stops at the first answer
        (an engine whose process died must be noticed with no job running, too)."""
        return None

    def capacity_hint(self) -> int | None:
        """How many requests the engine itself runs at once (vLLM: ``max_num_seqs``), if known."""
        return None

    # -- weight updates (used by rollq.weightsync) ---------------------------------------
    async def pause(self, mode: str = "keep") -> None:  # noqa: B027
        """Stop generating (``keep``: in-flight requests resume later; ``abort``: they end,
        reported through ``done`` where :attr:`reports_aborted`)."""

    async def resume(self) -> None:  # noqa: B027
        """Resume generating after :meth:`pause`."""

    async def reset_prefix_cache(self) -> bool | None:
        """Drop cached prefixes computed with older weights (False: the engine kept them;
        None: it has none)."""
        return None

    def new_cache_salt(self) -> str | None:
        """Make later requests ignore prefixes cached so far, without an engine call (used
        while requests still run, when the cache cannot be dropped). Engines without a
        prefix cache have nothing to do."""
        return None

    @property
    def num_workers(self) -> int:
        """Workers that hold the weights (each joins weight broadcasts)."""
        return 1

    async def call_workers(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``method`` of the weight-sync worker extension in every worker; one result each.
        Weight sync calls it only through :class:`~rollq.weightsync.replica.worker_calls.WorkerCalls`.

        Engines without weights (the echo engine) have nothing to load and return ``[]``.
        """
        return []

    def swap_progress(self, report: Progress | None) -> SwapProgress | None:
        """Read the progress a worker reported from a weight swap (its report's ``progress``)
        into tokens generated per running request. None: this engine cannot tell, and the
        swap's first token is recorded as unknown for every running request."""
        return None

    def progress_since(self) -> float:
        """A wall-clock time (``time.time()``) before which the engine let go of no request
        whose output the replica still waits for: a swap's progress report may leave out
        requests let go of earlier. 0.0: it leaves out none."""
        return 0.0


class EchoEngine(Engine):
    """A deterministic engine for queue tests, the queue demo and benchmarks.

    Sample ``j`` of a job repeats the prompt's token ids (or the UTF-8 bytes of its text)
    shifted by ``j`` (modulo ``vocab_size``), ``max_tokens`` of them, with logprob ``-0.5``
    each. With
    ``delay_per_token`` > 0 a request takes ``max_tokens * delay_per_token`` seconds;
    requests run concurrently, as in a batching engine.

    >>> e = EchoEngine()
    >>> out = e.generate_now(Job(id="a", reply="p", text="hi"))
    >>> out.samples[0].token_ids[:2]
    [104, 105]
    """

    name = "echo"
    model = "echo"
    reports_aborted = True
    streams_progress = True

    def __init__(self, delay_per_token: float = 0.0, vocab_size: int = 32000, max_model_len: int = 1 << 16,
                 abort_at: int | None = None):
        self.delay_per_token = delay_per_token
        #: ``pause("abort")`` ends each running request with this many tokens per sample
        #: (None: as many as ``delay_per_token`` gave it time for).
        self.abort_at = abort_at
        self._running: dict[str, tuple[EngineOutput, DoneCallback, float]] = {}
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._generated = 0
        self._paused = False
        self._held: list[tuple[str, Job, DoneCallback, ProgressCallback | None]] = []
        self._lengths: dict[str, dict[int, int]] = {}  # running request -> tokens per sample
        self._finished: dict[str, dict[int, int]] = {}  # the same, of requests that reported lately

    @staticmethod
    def _prompt_ids(job: Job) -> list[int]:
        if job.tokens is not None:
            return job.prompt_token_ids or [0]
        text = job.text if job.text is not None else "\n".join(f"{m.role}: {m.content}" for m in job.messages or ())
        return list(text.encode()) or [0]

    def generate_now(self, job: Job) -> EngineOutput:
        sp = job.sampling
        k = sp.max_tokens
        raw = job.tokens if job.tokens is not None else pack_i32(self._prompt_ids(job))
        n_prompt = len(raw) // 4
        if n_prompt + k > self.max_model_len:
            raise InvalidJob(
                f"prompt of {n_prompt} tokens + max_tokens {k} exceeds "
                f"the engine's context of {self.max_model_len} tokens"
            )
        # Sample 0 repeats the prompt's bytes (cheap slicing); sample j shifts the ids by j.
        base = (raw * (k // n_prompt + 1))[: 4 * k]
        lp = None
        if sp.logprobs is not None:
            lp = _LOGPROB_BYTES[: 4 * k] if len(_LOGPROB_BYTES) >= 4 * k else pack_f32([-0.5] * k)
        samples = []
        for j in range(sp.n):
            toks = base if j == 0 else pack_i32([(t + j) % self.vocab_size for t in unpack_i32(base)])
            samples.append(Sample(tokens=toks, logprobs=lp, text=None, finish_reason="length"))
        self._generated += k * sp.n
        plp = pack_f32([math.nan] + [-0.5] * (n_prompt - 1)) if sp.prompt_logprobs is not None else None
        return EngineOutput(samples=samples, prompt_tokens=n_prompt,
                            prompt_ids=raw if job.tokens is None else None, prompt_logprobs=plp)

    def submit(self, request_id: str, job: Job, done: DoneCallback, progress: ProgressCallback | None = None) -> None:
        """With ``progress``, each sample's tokens are reported in pieces as their time comes
        (at most :data:`ECHO_PROGRESS_STEPS`; all at once without a delay), then ``done``."""
        if self._paused:
            self._held.append((request_id, job, done, progress))
            return
        try:
            out: EngineOutput | BaseException = self.generate_now(job)
        except InvalidJob as e:
            out = e
        if isinstance(out, BaseException):
            done(request_id, out)
            return
        if self.delay_per_token <= 0:
            if progress is not None:
                _report(out, 0, job.sampling.max_tokens, progress)
            done(request_id, out)
            return
        loop = asyncio.get_running_loop()
        k = job.sampling.max_tokens
        step = k if progress is None else max(1, -(-k // ECHO_PROGRESS_STEPS))
        t0 = loop.time()
        final = out

        def tick(at: int) -> None:
            end = min(k, at + step)
            if progress is not None:
                _report(final, at, end, progress)
            if end < k:  # the next piece, at the time its last token is due
                self._timers[request_id] = loop.call_at(t0 + self.delay_per_token * min(k, end + step), tick, end)
                return
            self._timers.pop(request_id, None)
            self._running.pop(request_id, None)
            # Kept a while: a swap's report may still be asked about a request that reported.
            self._finished[request_id] = self._lengths.pop(request_id, {})
            if len(self._finished) > 4096:
                self._finished.pop(next(iter(self._finished)))
            done(request_id, final)

        self._timers[request_id] = loop.call_at(t0 + self.delay_per_token * min(k, step), tick, 0)
        self._running[request_id] = (out, done, t0)
        self._lengths[request_id] = {j: len(s.tokens) // 4 for j, s in enumerate(out.samples)}

    def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        t = self._timers.pop(request_id, None)
        self._lengths.pop(request_id, None)
        if t is not None:
            t.cancel()
        self._held = [h for h in self._held if h[0] != request_id]

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._timers), waiting=len(self._held), generated_tokens=self._generated)

    def swap_progress(self, report: Progress | None) -> SwapProgress:
        """Echo generates every token when a request starts: all of them precede any swap."""
        return SwapProgress(tokens={rid: dict(n) for rid, n in (*self._finished.items(), *self._lengths.items())}, complete=True)

    async def pause(self, mode: str = "keep") -> None:
        """``abort`` ends the running requests: their ``done`` gets each sample's tokens so
        far (see :attr:`abort_at`) with ``finish_reason="abort"``, as vLLM's does."""
        self._paused = True
        if mode != "abort":
            return
        now = asyncio.get_running_loop().time()
        running, self._running = self._running, {}
        for rid, (out, done, t0) in running.items():
            self.abort(rid)
            k = self.abort_at if self.abort_at is not None else int((now - t0) / self.delay_per_token)
            cut = [Sample(tokens=s.tokens[: 4 * k], logprobs=s.logprobs[: 4 * k] if s.logprobs is not None else None,
                          finish_reason="abort" if 4 * k < len(s.tokens) else s.finish_reason) for s in out.samples]
            done(rid, EngineOutput(cut, out.prompt_tokens, out.prompt_ids, out.prompt_logprobs))

    async def resume(self) -> None:
        self._paused = False
        held, self._held = self._held, []
        for rid, job, done, progress in held:
            self.submit(rid, job, done, progress)



def _report(out: EngineOutput, start: int, end: int, progress: ProgressCallback) -> None:
    """Report tokens ``start .. end`` of each sample of ``out`` through ``progress``."""
    for j, s in enumerate(out.samples):
        toks = s.tokens[4 * start: 4 * end]
        if toks:
            progress(j, start, toks, s.logprobs[4 * start: 4 * end] if s.logprobs is not None else None, None)
