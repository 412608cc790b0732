"""Worker side of per-token versions: how far each request had got when a swap happened.

Runs inside each vLLM worker process. A swap runs between two engine steps, so every token a
request holds at that moment was sampled on the weights being replaced; the replica maps the
counts to its jobs (``Engine.swap_progress``) and each sample's result records where each
version began.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import torch

from ..wire import Progress

#: Requests that vLLM let go of are remembered (with their token counts) this long, at most
#: this many: a swap reports them so a request that finished on the old weights, whose
#: output had not reached the replica yet, is not taken for one that had not started. A swap
#: reports only those let go of since :attr:`RequestTracker.since` (the replica's oldest
#: request still waiting for its output was submitted after it).
_REMOVED_WINDOW_S = 30.0
_REMOVED_KEEP = 16384


class RequestTracker:
    """Token counts of the requests one worker's model runner holds or recently let go of."""

    def __init__(self) -> None:
        #: request id -> (tokens when vLLM let go of it, when: ``time.monotonic()``, ``time.time()``),
        #: in the order vLLM let go of them; None until :meth:`install`.
        self.removed: collections.OrderedDict[str, tuple[int, float, float]] | None = None
        #: The next report leaves out requests let go of before this wall-clock time
        #: (``time.time()``; 0: none left out). Set per swap call by the replica
        #: (:meth:`~rollq.consumer.vllm_engine.VllmEngine.progress_since`): a request whose output
        #: it still waits for was submitted after it, so vLLM let go of it after it too.
        self.since = 0.0
        #: The pinned host buffer :meth:`begin_report` copies the device's counts into.
        self._pinned: torch.Tensor | None = None

    def install(self, runner: Any) -> bool:
        """Start remembering how many tokens each request had generated when vLLM let go of
        it (finished or aborted). True where this vLLM allows it.

        Two model runners are read: vLLM's first GPU runner (also the CPU backend's; one
        ``CachedRequestState`` per request in ``requests``, removal through
        ``_on_request_state_removed``) and the second (``vllm.v1.worker.gpu``, default on
        GPUs in 0.26: ``req_states`` arrays, removal through ``req_states.remove_request``).
        """
        if runner is None or _runner_counts(runner) is None:
            return False
        if self.removed is not None:
            return True
        removed: collections.OrderedDict[str, tuple[int, float, float]] = collections.OrderedDict()

        def remember(req_id: str, n: int | None) -> None:
            if n is not None:
                removed[req_id] = (n, time.monotonic(), time.time())
                if len(removed) > _REMOVED_KEEP:
                    removed.popitem(last=False)

        if isinstance(getattr(runner, "requests", None), dict):
            orig = getattr(runner, "_on_request_state_removed", None)
            if orig is None:
                return False

            def on_removed(req_id: str, req_state: Any, *args: Any, **kwargs: Any) -> Any:
                remember(req_id, len(req_state.output_token_ids) if req_state is not None else None)
                return orig(req_id, req_state, *args, **kwargs)

            runner._on_request_state_removed = on_removed
        else:
            states = runner.req_states
            orig_remove = states.remove_request

            def on_remove(req_id: str, *args: Any, **kwargs: Any) -> Any:
                i = states.req_id_to_index.get(req_id)
                remember(req_id, _v2_count(states, i) if i is not None else None)
                return orig_remove(req_id, *args, **kwargs)

            states.remove_request = on_remove
        self.removed = removed
        return True

    def begin_report(self, worker: Any) -> Callable[[], Progress]:
        """:meth:`report` in two halves, for a swap that enqueues its copies between them.
        On a GPU whose model runner keeps the computed tokens on the device, their copy to
        the host is enqueued now on the current stream, ahead of the swap's copies, and the
        returned call waits for it alone (the steps already launched), not for the copies
        behind it, then gives the report; elsewhere the report is taken now.

        >>> RequestTracker().begin_report(object())()
        Progress(tokens={}, complete=False)
        """
        states = getattr(getattr(worker, "model_runner", None), "req_states", None)
        dev = getattr(getattr(states, "num_computed_tokens", None), "gpu", None)
        if not isinstance(dev, torch.Tensor) or not dev.is_cuda:
            progress = self.report(worker)
            return lambda: progress
        host = self._pinned
        if host is None or host.shape != dev.shape or host.dtype != dev.dtype:
            host = self._pinned = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(dev.device))

        def finish() -> Progress:
            copied.synchronize()  # without the GIL
            return self.report(worker, computed=host.numpy())

        return finish

    def report(self, worker: Any, computed: Any = None) -> Progress:
        """Tokens generated so far by every request vLLM holds, taken inside a swap (between
        two engine steps, so each of them was sampled on the weights being replaced; a token
        of a step still in flight counts too, since the swap's copies run after that step).

        ``complete``: a request missing from ``tokens`` had generated nothing yet (requests
        that ended in the last :data:`_REMOVED_WINDOW_S` seconds are included with their
        final counts; of those, only the ones let go of since :attr:`since`). ``computed``: the
        second model runner's computed tokens per row, read already (:meth:`begin_report`).
        """
        runner = getattr(worker, "model_runner", None)
        tokens = _runner_counts(runner, computed) if runner is not None else None
        if tokens is None:
            return Progress(tokens={}, complete=False)
        removed = self.removed
        if removed is not None:
            horizon = time.monotonic() - _REMOVED_WINDOW_S
            while removed and next(iter(removed.values()))[1] < horizon:
                removed.popitem(last=False)
            for rid, (n, _, wall) in reversed(removed.items()):  # newest first
                if wall < self.since:
                    break
                tokens.setdefault(rid, n)
        return Progress(tokens=tokens, complete=removed is not None)


def _runner_counts(runner: Any, computed: Any = None) -> dict[str, int] | None:
    """Output tokens so far of every request a model runner holds (None: a runner this code
    cannot read); ``computed``: the second runner's computed tokens per row, if read already."""
    reqs = getattr(runner, "requests", None)
    if isinstance(reqs, dict):
        return {rid: len(st.output_token_ids) for rid, st in list(reqs.items())}
    states = getattr(runner, "req_states", None)
    index = getattr(states, "req_id_to_index", None)
    if isinstance(index, dict) and hasattr(states, "num_computed_tokens_np") and hasattr(states, "prompt_len"):
        if computed is None:
            computed = _v2_computed(states)
        return {rid: _v2_count(states, i, computed) for rid, i in list(index.items())}
    return None


def _v2_computed(states: Any) -> Any:
    """Computed tokens per row of the second model runner's ``req_states``, the last step
    included. Its host copy (``num_computed_tokens_np``) holds what the scheduler sent at the
    start of each row's last step; the device copy is advanced after every step, so it is
    read (one small copy, which waits for the steps already launched: their tokens come from
    the weights being replaced)."""
    dev = getattr(getattr(states, "num_computed_tokens", None), "gpu", None)
    if dev is not None:
        try:
            return dev.cpu().numpy()
        except Exception:  # noqa: BLE001 - the host copy, one step behind, is the fallback
            pass
    return states.num_computed_tokens_np


def _v2_count(states: Any, i: int, computed: Any = None) -> int:
    """Output tokens of row ``i`` of the second model runner's ``req_states``: the prompt is
    computed, then each step computes one more token and samples the next, so a request
    with ``c >= prompt`` computed tokens has sampled ``c - prompt + 1``."""
    c = int((computed if computed is not None else _v2_computed(states))[i])
    prompt = int(states.prompt_len.np[i])
    return max(0, c - prompt + 1) if c >= prompt else 0
