"""rollq results as vLLM's own output objects (``vllm.RequestOutput`` / ``CompletionOutput``).

What TorchRL's ``vLLMWrapper`` reads is filled the way vLLM fills it: ``prompt_token_ids``
(the caller's token prompt, or the ids the replica tokenized a text prompt into),
``prompt_logprobs`` and each output's ``logprobs`` in vLLM's per-position form
(``{token_id: Logprob}``, the first prompt position ``None``), ``cumulative_logprob``.
rollq carries the logprob of the sampled (or given) token only, so each position's dict
has that one entry: what ``logprobs=0``/``1`` return, minus vLLM's top-1 alternative.

rollq's additions ride along: each ``CompletionOutput.weight_versions`` (vLLM's own field)
holds the policy versions that generated its tokens as ``WeightVersionSpan``\\ s, and the
``RequestOutput`` carries ``policy_version`` (start, end), ``replica`` and ``rollq_result``
(the :class:`~rollq.protocol.Result` it was built from).
"""

from __future__ import annotations

import math
from typing import Any

from ..protocol import Result, Sample


def _position(token: int, logprob: float, Logprob: Any) -> dict[int, Any]:
    return {int(token): Logprob(logprob=float(logprob), rank=None, decoded_token=None)}


def weight_spans(sample: Sample, version_start: int, WeightVersionSpan: Any) -> list[Any]:
    """``[WeightVersionSpan(version, start, end), ...]`` over the sample's tokens (a
    version not known exactly, -1, is its own span)."""
    versions = sample.token_versions(version_start)
    spans: list[Any] = []
    start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append(WeightVersionSpan(version=str(versions[start]), start=start, end=i))
            start = i
    return spans


def request_output(r: Result, prompt: str | None, prompt_token_ids: list[int] | None) -> Any:
    """One ``vllm.RequestOutput`` for the result ``r`` of a prompt (``prompt`` for text,
    ``prompt_token_ids`` for a token prompt; the replica's ids fill in for text)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan

    ids = prompt_token_ids if prompt_token_ids is not None else r.prompt_token_ids
    plp = r.prompt_logprobs
    prompt_logprobs = None
    if plp is not None and ids is not None:
        prompt_logprobs = [
            None if lp is None or math.isnan(lp) else _position(t, lp, Logprob) for t, lp in zip(ids, plp)
        ]
    outputs = []
    for i, s in enumerate(r.samples):
        tokens = s.token_ids
        lps = s.token_logprobs
        outputs.append(CompletionOutput(
            index=i, text=s.text if s.text is not None else "", token_ids=tokens,
            cumulative_logprob=None if lps is None else float(sum(lps)),
            logprobs=None if lps is None else [_position(t, lp, Logprob) for t, lp in zip(tokens, lps)],
            finish_reason=s.finish_reason,
            weight_versions=weight_spans(s, r.version_start, WeightVersionSpan) if tokens else None,
        ))
    out = RequestOutput(
        request_id=r.id, prompt=prompt, prompt_token_ids=list(ids) if ids is not None else None,
        prompt_logprobs=prompt_logprobs, outputs=outputs, finished=True,
    )
    out.policy_version = r.policy_version
    out.replica = r.replica
    out.rollq_result = r
    return out
