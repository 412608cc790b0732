"""A streamed job's vLLM outputs (``RequestOutputKind.DELTA``): each step's new tokens go to
the job's progress callback, and the steps add up to the one final output that
``FINAL_ONLY`` would have given (:func:`~rollq.consumer._vllm_api.to_output` reads it).

With ``n > 1`` vLLM's DELTA outputs hold only the samples that moved in that step (each
``CompletionOutput`` names its sample by ``index``); the first output alone carries the prompt
logprobs. :class:`DeltaFold` keeps, per sample, the token ids, sampled logprobs, text and
finish reason so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol import pack_f32, pack_i32
from ._vllm_api import _sampled_logprobs
from .engine import ProgressCallback


@dataclass
class _SoFar:
    """One sample's outputs so far, shaped as the ``CompletionOutput`` ``to_output`` reads."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def logprobs(self) -> _FlatSampled:
        return _FlatSampled(self.values)


@dataclass
class _FlatSampled:
    """The sampled logprobs in ``FlatLogprobs``' shape: one entry per position."""

    logprobs: list[float]

    @property
    def start_indices(self) -> range:
        return range(len(self.logprobs))


class DeltaFold:
    """Folds a request's DELTA outputs (:meth:`add`) into the final output (:meth:`final`),
    reporting each step's new tokens of each sample through ``progress``."""

    def __init__(self, progress: ProgressCallback, logprobs: bool, detokenize: bool) -> None:
        self._progress = progress
        self._logprobs = logprobs
        self._detokenize = detokenize
        self._samples: dict[int, _SoFar] = {}
        self.prompt_token_ids: Any = None
        self.prompt_logprobs: Any = None
        self._seen = False

    def add(self, out: Any) -> None:
        """One output of ``AsyncLLM.generate``: fold it in, report what is new."""
        if not self._seen:
            self._seen = True
            self.prompt_token_ids = getattr(out, "prompt_token_ids", None)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = getattr(out, "prompt_logprobs", None)
        for c in out.outputs:
            s = self._samples.get(c.index)
            if s is None:
                s = self._samples[c.index] = _SoFar(c.index)
            ids = list(c.token_ids)
            lps = _sampled_logprobs(c.logprobs, ids) if self._logprobs else []
            text = c.text or ""
            offset = len(s.token_ids)
            s.token_ids += ids
            s.values += lps
            s.text += text
            if c.finish_reason is not None:
                s.finish_reason = c.finish_reason
            if ids or text:
                self._progress(
                    c.index, offset, pack_i32(ids), pack_f32(lps) if self._logprobs else None, text if self._detokenize else None
                )

    def final(self) -> Any:
        """The request's output as ``FINAL_ONLY`` gives it (None: nothing came)."""
        if not self._seen:
            return None
        return _Final(
            outputs=[self._samples[k] for k in sorted(self._samples)],
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass
class _Final:
    outputs: list[_SoFar]
    prompt_token_ids: Any
    prompt_logprobs: Any
