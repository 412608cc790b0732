"""Results, their samples, and dead letters: what comes back from a replica."""

from __future__ import annotations

import math
from typing import Any, Iterator, Literal, Sequence

import msgspec

from ..errors import job_error
from .arrays import PackedTokens, unpack_f32, unpack_i32
from .limits import SCHEMA_VERSION
from .sampling import SamplingParams

#: ``Sample.versions`` start index of a version whose first token is not known (the
#: request was off the device, e.g. preempted, when that version was swapped in).
UNKNOWN_START = -1


class LogprobSource(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Which distribution a sample's logprobs are of, and the sampling transform that
    applied to the tokens.

    ``kind``: ``"raw"``, the ``log_softmax`` of the model's logits (vLLM's default
    ``logprobs_mode="raw_logprobs"``), or ``"processed"``, the logprobs of the distribution
    the tokens were drawn from, after the transform below (``"processed_logprobs"``). The
    other fields are the sampling transform of the job, at their identity values where it
    did not apply: raw logprobs are the probabilities the tokens were sampled from only when
    all of them are. ``min_tokens`` counts only where it masked stop tokens.

    A sample from a replica that does not send this struct (one older than it, an engine
    that does not know) reads as :data:`RAW_LOGPROBS`: raw, no transform known.

    >>> LogprobSource.of(SamplingParams(temperature=0.7), "processed")
    LogprobSource(kind='processed', temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0)
    >>> LogprobSource.of(SamplingParams(top_p=0.9), "raw").transformed()
    ['top_p=0.9']
    """

    kind: Literal["raw", "processed"] = "raw"
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0: no top-k (vLLM's -1 is stored as 0).
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    @classmethod
    def of(cls, sp: SamplingParams, kind: Literal["raw", "processed"]) -> LogprobSource:
        """The source of logprobs of ``kind`` from a job sampled with ``sp``."""
        masks_stops = not sp.ignore_eos or bool(sp.stop_token_ids)
        return cls(
            kind=kind, temperature=sp.temperature, top_p=sp.top_p, top_k=max(0, sp.top_k), min_p=sp.min_p,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty, min_tokens=sp.min_tokens if masks_stops else 0,
        )

    def transformed(self) -> list[str]:
        """The fields of the transform that applied (not at their identity value), as
        ``name=value``, in the order vLLM applies them after the temperature."""
        ident = _IDENTITY
        return [f"{name}={getattr(self, name)!r}" for name in _TRANSFORM_FIELDS if getattr(self, name) != getattr(ident, name)]


#: Logprobs of the raw logits, with no transform known: what a sample without a
#: :class:`LogprobSource` holds.
RAW_LOGPROBS = LogprobSource()
_IDENTITY = RAW_LOGPROBS
_TRANSFORM_FIELDS = ("temperature", "min_p", "top_k", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens")


class Sample(msgspec.Struct, PackedTokens, array_like=True, gc=False):
    """One of the ``n`` completions of a job.

    ``versions`` says which policy version generated which tokens when a weight update
    landed during the generation (update policy ``keep``): ``[(version, first token index),
    ...]`` in order, starting with ``(version_start, 0)``. None: every token was generated
    at the result's ``version_start``. See :meth:`token_versions`.

    ``lp_source`` says what ``logprobs`` are the logprobs of (see :attr:`logprob_source`).
    """

    tokens: bytes  # little-endian int32
    logprobs: bytes | None = None  # little-endian float32, one per generated token
    text: str | None = None
    finish_reason: str | None = None
    versions: list[tuple[int, int]] | None = None
    lp_source: LogprobSource | None = None

    @property
    def logprob_source(self) -> LogprobSource:
        """What :attr:`token_logprobs` are the logprobs of: :data:`RAW_LOGPROBS` for a sample
        that does not say (results of replicas before this field, engines that do not know)."""
        return self.lp_source or RAW_LOGPROBS

    def token_versions(self, version_start: int) -> list[int]:
        """The policy version that generated each token (``-1``: not known exactly).

        >>> from rollq.protocol import pack_i32
        >>> s = Sample(tokens=pack_i32([5, 6, 7, 8]), versions=[(3, 0), (4, 2)])
        >>> s.token_versions(3)
        [3, 3, 4, 4]
        >>> Sample(tokens=pack_i32([5, 6])).token_versions(2)
        [2, 2]
        """
        n = len(self.tokens) // 4
        out = [version_start] * n
        if not self.versions:
            return out
        for k, (v, start) in enumerate(self.versions):
            if start == UNKNOWN_START:  # from the last known start on, either version: ambiguous
                start = next((st for _, st in reversed(self.versions[:k]) if st != UNKNOWN_START), 0)
                v = -1
            for i in range(min(start, n), n):
                out[i] = v
        return out

    def single_version(self, version_start: int) -> int | None:
        """The version that generated every token of this sample, or None if several did
        (or one is not known): the samples whose logprobs a trainer can recompute exactly."""
        vs = set(self.token_versions(version_start))
        return vs.pop() if len(vs) == 1 and -1 not in vs else None


class ErrorInfo(msgspec.Struct, array_like=True):
    type: str
    message: str


class Result(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """The outcome of a job: samples or an error, tagged with the policy version span."""

    v: int = SCHEMA_VERSION
    id: str
    samples: list[Sample] = []
    error: ErrorInfo | None = None
    prompt_tokens: int = 0
    version_start: int = 0
    version_end: int = 0
    replica: str = ""
    submitted: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    deliveries: int = 1
    meta: Any = None
    #: The prompt as the replica tokenized it (text and chat prompts; token prompts: None,
    #: the submitter has them), little-endian int32.
    prompt_ids: bytes | None = None
    #: ``sampling.prompt_logprobs``: each prompt token's logprob given the tokens before it,
    #: little-endian float32 (the first token has none: NaN). Of the raw logits in every
    #: ``logprobs_mode`` (vLLM applies no sampling transform to prompt tokens).
    prompt_lps: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def policy_version(self) -> tuple[int, int]:
        """``(version at start, version at end)`` of the generation."""
        return (self.version_start, self.version_end)

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """Token ids of the prompt as the replica tokenized it (None for token prompts)."""
        return unpack_i32(self.prompt_ids) if self.prompt_ids is not None else None

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        """``sampling.prompt_logprobs``: the logprob of each prompt token given the ones before
        it (the first token's is None); None when not asked for."""
        if self.prompt_lps is None:
            return None
        return [None if math.isnan(x) else x for x in unpack_f32(self.prompt_lps)]

    @property
    def logprob_source(self) -> LogprobSource:
        """What the samples' logprobs are the logprobs of (a job's samples share their
        sampling; see :class:`LogprobSource`)."""
        return self.samples[0].logprob_source if self.samples else RAW_LOGPROBS

    def token_versions(self, sample: int = 0) -> list[int]:
        """The policy version that generated each token of sample ``sample`` (see
        :meth:`Sample.token_versions`)."""
        return self.samples[sample].token_versions(self.version_start)

    @property
    def queued_s(self) -> float:
        return max(0.0, self.started - self.submitted) if self.started else 0.0


class DeadLetter(msgspec.Struct, array_like=True, kw_only=True):
    """An entry of the dead-letter stream."""

    v: int = SCHEMA_VERSION
    job_id: str | None
    reason: str
    error_type: str
    consumer: str
    deliveries: int
    at: float
    source: str  # stream the entry came from
    #: The original entry (may not be a valid job), cut to the consumer's
    #: ``ConsumerSettings.dlq_payload_bytes``: a cut one cannot be requeued.
    payload: bytes
    #: Size of the original entry (``len(payload)`` unless it was cut).
    payload_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.payload_bytes > len(self.payload)


# -- the largest result a job can have -----------------------------------------------------
#: msgpack sizes (bytes) of what a result holds: an int or float of any value, nil.
_NUM, _NIL = 9, 1
#: The longest ``finish_reason`` a replica reports ("stop", "length", "abort").
_FINISH = len("length")
#: The widest encoded :class:`LogprobSource` a sample with logprobs carries.
_LP_SOURCE = 1 + 1 + len("processed") + 6 * _NUM + 2 * _NUM
#: The longest replica name (rollq.keys.check_name).
_REPLICA = 128


def _str_size(n: int) -> int:
    return n + (1 if n < 32 else 2 if n < 256 else 3 if n < 65536 else 5)


def _bin_size(n: int) -> int:
    return n + (2 if n < 256 else 3 if n < 65536 else 5)


def _array_size(n: int) -> int:
    return 1 if n < 16 else 3 if n < 65536 else 5


def sample_bound(max_tokens: int, logprobs: bool) -> int:
    """The largest encoded :class:`Sample` of ``max_tokens`` tokens (with their logprobs):
    its tokens, logprobs (and what they are of), the longest finish reason, no text and no
    version marks.

    >>> from rollq.protocol import SamplingParams, encode_result, pack_f32, pack_i32
    >>> src = LogprobSource.of(SamplingParams(temperature=0.7, top_k=2**31 - 1, min_tokens=5, stop_token_ids=[1]), "processed")
    >>> s = Sample(tokens=pack_i32([1] * 9), logprobs=pack_f32([0.0] * 9), finish_reason="length", lp_source=src)
    >>> len(msgspec.msgpack.encode(s)) <= sample_bound(9, True)
    True
    """
    arr = _bin_size(4 * max_tokens)
    return 1 + arr + (arr if logprobs else _NIL) + _NIL + _str_size(_FINISH) + _NIL + (_LP_SOURCE if logprobs else _NIL)


def result_bound(*, id_bytes: int, n: int, max_tokens: int, logprobs: bool, prompt_tokens: int,
                 prompt_ids: bool, prompt_logprobs: bool, meta_bytes: int | None) -> int:
    """The largest encoded :class:`Result` a job can have: ``n`` samples of ``max_tokens``
    tokens, every integer and float at its widest, the longest replica name, the job's
    ``meta`` (``meta_bytes`` encoded, None: no meta) and, for a prompt of ``prompt_tokens``
    tokens, its ids (``prompt_ids``: a text or chat prompt) and logprobs. Not counted: the
    text of detokenized samples and the version marks of weight updates during the run (the
    replica makes them; the submitter cannot know their size).

    >>> from rollq.protocol import encode_result, pack_f32, pack_i32
    >>> widest = LogprobSource("processed", 0.5, 0.5, 2**63 - 1, 0.5, 0.5, 0.5, 0.5, 2**63 - 1)
    >>> r = Result(id="j", samples=[Sample(tokens=pack_i32([1] * 300), logprobs=pack_f32([0.0] * 300),
    ...            finish_reason="length", lp_source=widest)] * 2, replica="r" * 128, version_start=2**63, version_end=2**63,
    ...            prompt_tokens=2**63, deliveries=2**63, submitted=1.0, started=1.0, finished=1.0)
    >>> len(encode_result(r)) == result_bound(id_bytes=1, n=2, max_tokens=300, logprobs=True,
    ...                                       prompt_tokens=3, prompt_ids=False, prompt_logprobs=False,
    ...                                       meta_bytes=None)
    True
    """
    prompt_arr = _bin_size(4 * prompt_tokens)
    return (
        1 + 1 + _str_size(id_bytes)  # the array of 15 fields, v, id
        + _array_size(n) + n * sample_bound(max_tokens, logprobs)
        + _NIL + _NUM + 2 * _NUM + _str_size(_REPLICA)  # error, prompt_tokens, version span, replica
        + 3 * _NUM + _NUM  # submitted, started, finished, deliveries
        + (_NIL if meta_bytes is None else meta_bytes)
        + (prompt_arr if prompt_ids else _NIL) + (prompt_arr if prompt_logprobs else _NIL)
    )


def successful(results: Sequence[Result], skip_errors: bool = True) -> Iterator[tuple[int, Result]]:
    """``(index, result)`` for each result without an error; a failed one is skipped, or with
    ``skip_errors=False`` its error is raised (:func:`rollq.errors.job_error`).

    >>> from rollq.protocol import ErrorInfo
    >>> rs = [Result(id="a"), Result(id="b", error=ErrorInfo(type="InvalidJob", message="bad"))]
    >>> [(i, r.id) for i, r in successful(rs)]
    [(0, 'a')]
    """
    for i, r in enumerate(results):
        if r.error is None:
            yield i, r
        elif not skip_errors:
            raise job_error(r.error.type, r.error.message, r.id)
