"""Sampling parameters: the whitelist a job may carry, validated once per distinct value."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

import msgpack
import msgspec

from ..errors import InvalidJob
from .limits import MAX_JOB_TOKENS, MAX_LOGPROBS, MAX_N, MAX_STOP, MAX_TOKENS_LIMIT


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, frozen=True):
    """The whitelist of sampling parameters a job may carry (a subset of vLLM's).

    ``n`` samples of one job form one GRPO group and run on one replica (shared prefix
    cache). Unknown names are refused rather than silently ignored. Range checks run in
    msgspec's decoder (C) for jobs read off the wire; :meth:`validate` repeats them, plus
    the cross-field checks, for objects built in Python.

    >>> SamplingParams.from_dict({"max_tokens": 16, "temperature": 0.7, "n": 4}).n
    4
    """

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = 0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=MAX_STOP)] = []
    stop_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_STOP)] = []
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=1e6)] = 1.0
    skip_special_tokens: bool = True
    detokenize: bool = True
    #: Keep the matched stop string at the end of the text (vLLM's field of that name).
    include_stop_str_in_output: bool = False
    #: Logprobs of the prompt's own tokens (vLLM's ``prompt_logprobs``): the logprob of each
    #: prompt token given the ones before it (the first has none). With a prompt made of
    #: context + continuation this scores the continuation (a scoring job, see
    #: :func:`~rollq.protocol.score_spec`). Only the given token's logprob is returned; 0 and
    #: more ask for it.
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from a plain dict, refusing unknown keys and bad values (InvalidJob)."""
        if d is None:
            return cls().validate()
        if isinstance(d, SamplingParams):
            return d.validate()
        if not isinstance(d, dict):
            raise InvalidJob(f"sampling params must be a mapping, got {type(d).__name__}")
        unknown = set(d) - set(cls.__struct_fields__)
        if unknown:
            raise InvalidJob(
                f"unknown sampling parameter(s) {sorted(unknown)}; allowed: {sorted(cls.__struct_fields__)}"
            )
        try:
            sp = msgspec.convert(d, cls, strict=False)
        except msgspec.ValidationError as e:
            raise InvalidJob(f"invalid sampling params: {_explain(e, d)}") from e
        return sp.validate()

    def validate(self) -> SamplingParams:
        def bad(msg: str) -> InvalidJob:
            return InvalidJob(f"invalid sampling params: {msg}")

        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise bad(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not 1 <= self.n <= MAX_N:
            raise bad(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.n * self.max_tokens > MAX_JOB_TOKENS:
            raise bad(f"n x max_tokens = {self.n * self.max_tokens} exceeds {MAX_JOB_TOKENS} tokens per job")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if len(self.stop) > MAX_STOP or any(not s for s in self.stop):
            raise bad(f"stop must be at most {MAX_STOP} non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP or any(t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be at most {MAX_STOP} non-negative ids")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise bad(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            raise bad("seed must fit in 64 bits")
        return self

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def _explain(e: msgspec.ValidationError, given: dict[str, Any]) -> str:
    """``Expected `int` >= 1 - at `$.n``` -> ``n must be an int >= 1 (got 0)``."""
    m = re.match(r"Expected `([^`]+)`(.*?) - at `\$\.(\w+)", str(e))
    if not m:
        return str(e)
    typ, constraint, field = m.group(1), m.group(2).strip(), m.group(3)
    sep = "" if not constraint or constraint.startswith(",") else " "
    return f"{field} must be {typ}{sep}{constraint} (got {given.get(field)!r})"


#: Most entries each memo below holds (both start over when full).
_MEMO_SIZE = 4096
#: SamplingParams objects validated, by identity (holding the object keeps its id unique).
_validated: dict[int, SamplingParams] = {}
#: SamplingParams built from dicts, by the dict's content (:func:`_content_key`).
_by_content: dict[bytes, SamplingParams] = {}
#: The msgpack encoding of a dict of exact types: ``True``, ``1`` and ``1.0`` encode apart,
#: and so do ``0.0`` and ``-0.0``; a subclass (an enum, numpy), a tuple or an int over 64
#: bits is refused. Two dicts with one encoding are alike to :meth:`SamplingParams.from_dict`.
_content_key = msgpack.Packer(strict_types=True, use_bin_type=True).pack
_DEFAULT = SamplingParams().validate()


def validated_sampling(sp: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """:meth:`SamplingParams.from_dict`, validated once per distinct value: a SamplingParams
    object once per object (batches share one), a dict once per content (batches of dicts
    usually hold equal ones). Equal dicts give the same frozen object, shared by their jobs.

    >>> validated_sampling({"max_tokens": 8}) is validated_sampling({"max_tokens": 8})
    True
    >>> validated_sampling({"n": 1}).n
    1
    >>> validated_sampling({"n": True})  # equal to {"n": 1}, and refused all the same
    Traceback (most recent call last):
    ...
    rollq.errors.InvalidJob: invalid sampling params: n must be int, got `bool` (got True)
    """
    if type(sp) is dict:
        try:
            key = _content_key(sp)
        except (TypeError, ValueError, OverflowError):  # a value no key is made of: no memo
            return SamplingParams.from_dict(sp)
        made = _by_content.get(key)
        if made is None:  # refusals raise here and are not kept
            made = SamplingParams.from_dict(sp)
            if len(_by_content) > _MEMO_SIZE:
                _by_content.clear()
            _by_content[key] = made
        return made
    if isinstance(sp, SamplingParams):
        key = id(sp)
        if _validated.get(key) is sp:
            return sp
        sp.validate()
        if len(_validated) > _MEMO_SIZE:
            _validated.clear()
        _validated[key] = sp
        return sp
    if sp is None:
        return _DEFAULT
    return SamplingParams.from_dict(sp)
