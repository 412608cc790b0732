"""Prompts in the forms vLLM accepts, and scoring specs."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, NamedTuple, Sequence

from ..errors import InvalidJob
from .results import UNKNOWN_START, Result

_NO_ODD = object()


def prompt_parts(prompt: Any) -> tuple[str | None, Any]:
    """``(text, token ids)`` of a prompt given in one of the forms vLLM accepts: a ``str``, a
    ``TokensPrompt`` dict (``{"prompt_token_ids": [...]}``), a ``TextPrompt`` dict
    (``{"prompt": "..."}``), or a bare sequence of token ids (a list, tuple, 1-D numpy array
    or tensor); anything else is refused with :class:`~rollq.errors.InvalidJob`.

    >>> prompt_parts({"prompt_token_ids": [1, 2, 3]})
    (None, [1, 2, 3])
    >>> prompt_parts([4, 5])
    (None, [4, 5])
    >>> prompt_parts({"prompt": "hi"})
    ('hi', None)
    """
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        extra = set(prompt) - {"prompt_token_ids", "prompt"}
        if extra:
            raise InvalidJob(f"prompt dict has unsupported key(s) {sorted(map(str, extra))[:5]}; "
                             "rollq takes {'prompt_token_ids': [...]} or {'prompt': str}")
        if "prompt_token_ids" in prompt and "prompt" not in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__len__"):
                raise InvalidJob(f"prompt_token_ids must be a sequence of token ids, got {type(ids).__name__}")
            return None, ids if isinstance(ids, list) else token_list(ids, "prompt_token_ids")
        if "prompt" in prompt and "prompt_token_ids" not in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        raise InvalidJob("a prompt dict needs exactly one of 'prompt_token_ids' (a list of ints) or 'prompt' (a str)")
    if isinstance(prompt, (list, tuple)) or (hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1):
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        odd = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), _NO_ODD)
        if odd is not _NO_ODD:
            raise InvalidJob(f"a prompt given as a sequence must hold token ids (ints); got a {type(odd).__name__}")
        return None, ids
    raise InvalidJob(
        f"prompt must be a str, a list of token ids or a TokensPrompt dict {{'prompt_token_ids': [...]}}; "
        f"got {type(prompt).__name__}"
    )


#: Job fields a scoring job sets itself (:func:`score_spec`): given, they would override it.
SCORE_SETS = ("prompt", "prompt_token_ids", "messages", "sampling")


def token_list(ids: Any, what: str) -> list[int]:
    """``ids`` (a list, tuple, iterator, 1-D numpy array or tensor of token ids) as a list of
    ints, read once; anything else (a float, a bool, a str) is refused with
    :class:`~rollq.errors.InvalidJob` naming ``what``.

    >>> token_list(iter([1, 2]), "context")
    [1, 2]
    >>> token_list([1, 2.5], "context")
    Traceback (most recent call last):
    ...
    rollq.errors.InvalidJob: context must hold token ids (ints); got a float
    """
    if isinstance(ids, (str, bytes, Mapping)):
        raise InvalidJob(f"{what} must be a sequence of token ids, got {type(ids).__name__}")
    if hasattr(ids, "tolist") and getattr(ids, "ndim", None) == 1:
        ids = ids.tolist()
    try:
        out = list(ids)
    except TypeError:
        raise InvalidJob(f"{what} must be a sequence of token ids, got {type(ids).__name__}") from None
    odd = next((t for t in out if isinstance(t, bool) or not isinstance(t, numbers.Integral)), _NO_ODD)
    if odd is not _NO_ODD:
        raise InvalidJob(f"{what} must hold token ids (ints); got a {type(odd).__name__}")
    return out


def score_spec(context: Sequence[int], continuation: Sequence[int], **fields: Any) -> dict[str, Any]:
    """A job spec that scores ``continuation`` after ``context`` (token ids) without sampling
    it: the replica returns each prompt token's logprob (vLLM's ``prompt_logprobs``), and
    ``result.prompt_logprobs[len(context):]`` are the continuation's, under the weights the
    replica serves (``result.version_start``). vLLM generates at least one token, so one
    greedy token comes with it. Other job fields (``meta``, ``min_version``, ...) pass through;
    the prompt and sampling fields are the scoring job's own and are refused
    (:data:`SCORE_SETS`), as are token ids that are not ints.

    >>> score_spec([1, 2], [3, 4])["sampling"]
    {'max_tokens': 1, 'temperature': 0.0, 'prompt_logprobs': 0}
    >>> score_spec([1, 2], [3], sampling={"max_tokens": 2})
    Traceback (most recent call last):
    ...
    rollq.errors.InvalidJob: a scoring job sets its own sampling: score(..., sampling=...) would override it
    """
    for name in SCORE_SETS:
        if name in fields:
            raise InvalidJob(f"a scoring job sets its own {name}: score(..., {name}=...) would override it")
    context, continuation = token_list(context, "context"), token_list(continuation, "continuation")
    if not context or not continuation:
        raise InvalidJob("scoring needs a non-empty context and a non-empty continuation")
    return {"prompt_token_ids": [*context, *continuation],
            "sampling": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}, **fields}


class Scores(NamedTuple):
    """What a scoring job (:func:`score_spec`) gives: the continuation's logprobs and the
    policy version whose weights computed them.

    ``version`` is ``-1`` (:data:`~rollq.protocol.UNKNOWN_START`) when a weight update landed
    while the prompt was being scored and which version computed them is not known.

    >>> from rollq.protocol import Result, pack_f32
    >>> r = Result(id="j", version_start=4, version_end=4, prompt_lps=pack_f32([math.nan, -1.5, -0.25]))
    >>> Scores.of(r, context_len=2)
    Scores(logprobs=[-0.25], version=4)
    """

    logprobs: list[float]
    version: int

    @classmethod
    def of(cls, result: Result, context_len: int) -> Scores:
        """The scores in ``result`` of a :func:`score_spec` job whose context was ``context_len``
        tokens (NaN where the replica gave none)."""
        lps = result.prompt_logprobs or []
        return cls([math.nan if x is None else x for x in lps[context_len:]], _scoring_version(result))


def _scoring_version(result: Result) -> int:
    """The version that computed a scoring job's prompt logprobs: its span's, or, across a
    swap, the first version when the sampled token still came before the swap (the prompt was
    scored before it too); otherwise not known."""
    v0 = result.version_start
    if result.version_end == v0:
        return v0
    s = result.samples[0] if len(result.samples) == 1 else None
    if s is not None and s.versions is not None and s.single_version(v0) == v0:
        return v0
    return UNKNOWN_START
