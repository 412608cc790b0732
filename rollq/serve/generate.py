"""vLLM's token-in/token-out route, ``POST /inference/v1/generate``: the request body and the
response bodies, shaped as vLLM's ``scale_out/token_in_token_out`` protocol (the route
prime-rl's orchestrator drives, so that multi-turn rollouts are never re-tokenised).

The request carries ``token_ids`` and a ``sampling_params`` object with vLLM's field names;
the response carries each choice's ``token_ids``, ``finish_reason``, ``logprobs`` as
``{"content": [{"token_id", "logprob", "rank", "top_logprobs"}]}`` and ``weight_versions``
(vLLM's spans ``{"version", "start", "end"}`` over the output tokens), filled from the rollq
versions, plus the ``rollq`` extension field of the other routes. As vLLM's server, unknown
fields are ignored; fields that would change the generation and that a rollq job cannot
carry (``logit_bias``, ``structured_outputs``, multimodal ``features``...) are refused with
400 rather than ignored.

>>> r = msgspec.json.decode(b'{"token_ids": [1, 2], "sampling_params": {"max_tokens": 4}}', type=GenerateRequest)
>>> generate_sampling(r).max_tokens
4
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from ..errors import InvalidJob
from ..protocol import Result, SamplingParams


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateSamplingParams(msgspec.Struct, kw_only=True):
    """vLLM's ``SamplingParams`` as JSON: the fields a rollq job carries, with vLLM's defaults,
    and (``Any``, refused unless null) those it cannot."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    #: Omitted: rollq's default (16, the default of vLLM's ``SamplingParams``; vLLM's server
    #: would fill the context instead, which the queue does not know).
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM fields that change what is generated and that no rollq job carries: refused.
    structured_outputs: Any = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logprob_token_ids: Any = None
    prompt_logprob_token_ids: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``)."""

    token_ids: list[int]
    sampling_params: GenerateSamplingParams
    request_id: str | None = None
    model: str | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    # vLLM fields of disaggregated and multimodal serving: refused.
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None


_REFUSED_SAMPLING = ("structured_outputs", "logit_bias", "allowed_token_ids", "bad_words", "logprob_token_ids",
                     "prompt_logprob_token_ids", "thinking_token_budget", "repetition_detection")
_REFUSED_REQUEST = ("features", "content_parts", "kv_transfer_params", "ec_transfer_params", "cache_salt")
_CARRIED = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
            "min_p", "seed", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize",
            "skip_special_tokens", "include_stop_str_in_output")


def generate_sampling(req: GenerateRequest) -> SamplingParams:
    """The job's sampling params; InvalidJob (400) names what is refused.

    >>> bad = msgspec.json.decode(b'{"token_ids": [1], "sampling_params": {"logit_bias": {"1": 2}}}',
    ...                           type=GenerateRequest)
    >>> generate_sampling(bad)
    Traceback (most recent call last):
    ...
    rollq.errors.InvalidJob: sampling_params.logit_bias is not served by rollq serve
    """
    if not req.token_ids:
        raise InvalidJob("token_ids: List should have at least 1 item after validation, not 0")
    if any(t < 0 for t in req.token_ids):
        raise InvalidJob("token_ids must not contain negative values")
    sp = req.sampling_params
    for name in _REFUSED_SAMPLING:
        if getattr(sp, name) is not None:
            raise InvalidJob(f"sampling_params.{name} is not served by rollq serve")
    for name in _REFUSED_REQUEST:
        if getattr(req, name) is not None:
            raise InvalidJob(f"{name} is not served by rollq serve")
    if req.priority != 0:
        raise InvalidJob("Priority scheduling is not enabled (rollq serve orders jobs by the queue)")
    if req.output_mode != "tokens" and not sp.detokenize:
        raise InvalidJob(f"output_mode={req.output_mode!r} requires sampling_params.detokenize to be true")
    if sp.logprobs is not None and sp.logprobs > 1:
        raise InvalidJob("sampling_params.logprobs above 1 are not served: a rollq result carries the sampled "
                         "token's logprob")
    d: dict[str, Any] = {k: getattr(sp, k) for k in _CARRIED if getattr(sp, k) is not None}
    if sp.stop is not None:
        d["stop"] = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
    if sp.stop_token_ids is not None:
        d["stop_token_ids"] = list(sp.stop_token_ids)
    if d.get("top_k") == -1:  # vLLM's old spelling of "disabled"
        d["top_k"] = 0
    return SamplingParams.from_dict(d)


def weight_versions(token_versions: list[int]) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions``: contiguous ``[start, end)`` spans of output tokens sampled
    by one version (``"unknown"`` where rollq does not know which of two did).

    >>> weight_versions([3, 3, 4])
    [{'version': '3', 'start': 0, 'end': 2}, {'version': '4', 'start': 2, 'end': 3}]
    """
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(token_versions):
        label = "unknown" if v < 0 else str(v)
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def _clamp(lp: float) -> float:
    return -9999.0 if math.isnan(lp) else max(lp, -9999.0)


def tokens_logprobs(ids: list[int], lps: list[float]) -> dict[str, Any]:
    """``GenerateLogProbs`` of the sampled tokens (rank: not known, None; ``top_logprobs``: the
    sampled token, as vLLM lists it first for ``logprobs`` 0 and 1)."""
    content = []
    for t, lp in zip(ids, lps):
        entry = {"token_id": t, "logprob": _clamp(lp), "rank": None}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}


def text_logprobs(ids: list[int], lps: list[float], token_str: Any) -> dict[str, Any]:
    """``ChatCompletionLogProbs`` of the sampled tokens (``output_mode="text"``)."""
    content = []
    for t, lp in zip(ids, lps):
        tok = token_str(t)
        entry = {"token": tok, "logprob": _clamp(lp), "bytes": list(tok.encode("utf-8", errors="replace"))}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}


def prompt_logprobs(res: Result, prompt_ids: list[int]) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token_id: Logprob}`` (the first None)."""
    lps = res.prompt_logprobs
    if lps is None:
        return None
    return [None if lp is None else {str(t): {"logprob": _clamp(lp), "rank": None, "decoded_token": None}}
            for t, lp in zip(prompt_ids, lps)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo``."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None,
            "completion_tokens_details": None}
