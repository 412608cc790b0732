"""Request bodies of the completion and chat routes: the fields of vLLM's protocol that a
rollq job carries. As vLLM's server does, fields this server does not know are ignored;
known fields of the wrong type are refused (400)."""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import InvalidJob
from ..protocol import SamplingParams


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: rollq's extension on an assistant message: the ``token_ids`` of the choice that wrote
    #: it, kept exactly in the next prompt (see :mod:`rollq.serve.template`).
    token_ids: list[int] | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    return_token_ids: bool | None = None
    #: Logprob tokens as ``"token_id:<id>"`` instead of the decoded text (vLLM's field; TRL's
    #: client asks for it).
    return_tokens_as_token_ids: bool | None = None
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a batch (a
    list of strings or of token-id lists: one rollq job per prompt, as TRL's client sends)."""

    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens",
                    "include_stop_str_in_output")


def sampling_of(req: CompletionRequest | ChatRequest, max_tokens: int | None, logprobs: bool) -> SamplingParams:
    """The job's sampling params (InvalidJob names a bad value).

    >>> r = msgspec.json.decode(b'{"prompt": "hi", "n": 2, "stop": "."}', type=CompletionRequest)
    >>> sampling_of(r, 8, False).stop
    ['.']
    """
    d: dict[str, Any] = {k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None}
    if req.stop is not None:
        d["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if max_tokens is not None:
        d["max_tokens"] = max_tokens
    if logprobs:
        d["logprobs"] = 0
    return SamplingParams.from_dict(d)


#: Most prompts in one ``/v1/completions`` batch (each is a job).
MAX_BATCH_PROMPTS = 1024


def completion_prompts(req: CompletionRequest) -> list[dict[str, Any]]:
    """The job field of each prompt: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``,
    one for a single prompt, one per entry for a batch (all strings or all token-id lists).

    >>> completion_prompts(msgspec.json.decode(b'{"prompt": [[1, 2], [3]]}', type=CompletionRequest))
    [{'prompt_token_ids': [1, 2]}, {'prompt_token_ids': [3]}]
    >>> completion_prompts(msgspec.json.decode(b'{"prompt": "hi"}', type=CompletionRequest))
    [{'prompt': 'hi'}]
    """
    p: Any = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) > MAX_BATCH_PROMPTS:
            raise InvalidJob(f"a batch of {len(p)} prompts is more than {MAX_BATCH_PROMPTS}")
        if not all(isinstance(q, type(p[0])) for q in p):
            raise InvalidJob("prompt: a batch holds strings only or token-id lists only")
        return [_one_prompt(q) for q in p]
    return [_one_prompt(p)]


def _one_prompt(p: Any) -> dict[str, Any]:
    if isinstance(p, list) and not all(isinstance(t, int) for t in p):
        raise InvalidJob("prompt: a list of token ids holds ints only")
    if isinstance(p, str):
        if not p:
            raise InvalidJob("Either prompt or prompt_embeds must be provided and non-empty.")
        return {"prompt": p}
    if not p:
        raise InvalidJob("Either prompt or prompt_embeds must be provided and non-empty.")
    return {"prompt_token_ids": list(p)}


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as dicts for the chat template (text parts of list contents joined)."""
    out = []
    for m in req.messages:
        c = m.content
        if isinstance(c, list):
            c = "".join(part.get("text", "") for part in c if part.get("type") == "text")
        d: dict[str, Any] = {"role": m.role, "content": c or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def exact_turns(req: ChatRequest) -> dict[int, list[int]]:
    """The messages whose content is given as exact token ids: ``{index: ids}``.

    >>> r = msgspec.json.decode(b'{"messages": [{"role": "assistant", "content": "a", "token_ids": [4]}]}',
    ...                         type=ChatRequest)
    >>> exact_turns(r)
    {0: [4]}
    """
    out = {}
    for i, m in enumerate(req.messages):
        if m.token_ids is None:
            continue
        if m.role != "assistant":
            raise InvalidJob(f"messages[{i}].token_ids: only an assistant message carries its token ids")
        if any(t < 0 for t in m.token_ids):
            raise InvalidJob(f"messages[{i}].token_ids must not contain negative values")
        out[i] = list(m.token_ids)
    return out
