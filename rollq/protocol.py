"""rollq's wire format: typed msgpack messages, a schema version in each, no pickle.

Pure functions and structs only; the Redis code calls :func:`encode_job` /
:func:`decode_job` / :func:`encode_result` / :func:`decode_result` and never looks inside.

Messages are msgspec structs encoded as msgpack arrays (compact: no field names on the
wire). The first element of every message is :data:`SCHEMA_VERSION`; a decoder rejects any
other version with :class:`~rollq.errors.SchemaVersionError`. Token ids and logprobs travel
as raw little-endian arrays (``int32`` / ``float32``) with their dtype implied by the field.

>>> job = Job(id="j1", reply="p1", text="hello", sampling=SamplingParams(max_tokens=4))
>>> decode_job(encode_job(job)).text
'hello'
"""

from __future__ import annotations

import enum
import math
import numbers
import re
import struct
import sys
import time
from array import array
from typing import Annotated, Any, Iterable, Mapping, Sequence

import msgspec

from .errors import InvalidJob, ProtocolError, SchemaVersionError
from .keys import check_name

#: Version of every message rollq writes. Bump on any incompatible change.
SCHEMA_VERSION = 1

#: Upper bounds that protect consumers from absurd requests.
MAX_TOKENS_LIMIT = 1 << 20
#: Most tokens one job may ask for over all its samples (``n * max_tokens``): a result of
#: that many tokens with logprobs and text stays well under Redis' 512 MiB bulk limit.
MAX_JOB_TOKENS = 1 << 23
MAX_N = 1024
MAX_LOGPROBS = 20
MAX_STOP = 64
#: ``meta`` may nest this deep (lists and maps) and take this many bytes encoded: decoding
#: deeper structures recurses, and a consumer must never be made to run out of stack.
MAX_META_DEPTH = 32
MAX_META_BYTES = 1 << 20

_LITTLE = sys.byteorder == "little"


# ----------------------------------------------------------------------------------------
# Raw arrays
# ----------------------------------------------------------------------------------------
_I32: dict[int, struct.Struct] = {}  # "<{n}i" packers by length


def i32_packer(n: int) -> struct.Struct:
    """A cached ``struct.Struct`` packing ``n`` int32 token ids, little-endian."""
    packer = _I32.get(n)
    if packer is None:
        if len(_I32) > 4096:
            _I32.clear()
        packer = _I32[n] = struct.Struct(f"<{n}i")
    return packer


def pack_i32(values: Iterable[int] | bytes | None) -> bytes:
    """Token ids as little-endian int32 bytes (lists, arrays, numpy, tensors accepted)."""
    if type(values) is list:  # the common case first: one C call, range-checked by struct
        packer = _I32.get(len(values)) or i32_packer(len(values))
        try:
            return packer.pack(*values)
        except struct.error as e:
            raise InvalidJob(f"token ids must be integers that fit in int32: {e}") from e
    if values is None:
        return b""
    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    tobytes = getattr(values, "numpy", None)
    if tobytes is not None:  # torch tensor
        values = values.numpy()  # type: ignore[union-attr]
    if hasattr(values, "astype") and hasattr(values, "tobytes"):  # numpy
        if values.size and values.dtype.itemsize > 4 and (values.min() < -(2**31) or values.max() >= 2**31):  # type: ignore[union-attr]
            raise InvalidJob("token ids must fit in int32")
        return values.astype("<i4", copy=False).tobytes()  # type: ignore[union-attr]
    try:
        a = array("i", values if isinstance(values, (list, tuple)) else list(values))
    except (OverflowError, TypeError) as e:
        raise InvalidJob(f"token ids must be integers that fit in int32: {e}") from e
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_i32(data: bytes) -> list[int]:
    a = array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def pack_f32(values: Iterable[float] | None) -> bytes:
    if values is None:
        return b""
    if hasattr(values, "astype") and hasattr(values, "tobytes"):
        return values.astype("<f4", copy=False).tobytes()  # type: ignore[union-attr]
    a = array("f", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_f32(data: bytes) -> list[float]:
    a = array("f")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


# ----------------------------------------------------------------------------------------
# Sampling parameters
# ----------------------------------------------------------------------------------------

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
    #: :func:`score_spec`). Only the given token's logprob is returned; 0 and more ask for it.
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


# ----------------------------------------------------------------------------------------
# Jobs
# ----------------------------------------------------------------------------------------
class Message(msgspec.Struct, array_like=True, frozen=True):
    """One chat message (the tokenizer's chat template is applied by the consumer)."""

    role: str
    content: str


class Job(msgspec.Struct, array_like=True, kw_only=True, gc=False):
    """A generation request: one prompt, ``sampling.n`` samples.

    Exactly one of ``text``, ``tokens`` (little-endian int32 bytes) or ``messages`` is set.
    Jobs, results and samples are values that never refer back to what holds them, so they
    are not tracked by the garbage collector (``gc=False``): large batches of them would
    otherwise make every collection traverse them.
    """

    v: int = SCHEMA_VERSION
    id: str
    reply: str  # producer id; results go to QueueKeys.results(reply)
    text: str | None = None
    tokens: bytes | None = None
    messages: list[Message] | None = None
    sampling: SamplingParams = SamplingParams()
    replica: str | None = None
    min_version: int | None = None
    deadline: float | None = None  # unix seconds
    submitted: float = 0.0  # unix seconds, set by the producer
    meta: Any = None
    #: The caller chose the id: it is recorded while queued or running (idempotency).
    tracked: bool = False

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return unpack_i32(self.tokens) if self.tokens is not None else None

    def kind(self) -> str:
        return "text" if self.text is not None else "tokens" if self.tokens is not None else "messages"


def validate_job(job: Job, *, max_prompt_bytes: int | None = None, sampling: bool = True,
                 entry_bytes: int | None = None) -> Job:
    """Structural checks a consumer repeats on every job it pulls (the producer does too).

    ``sampling=False`` skips re-validating the sampling params (already checked by msgspec's
    decoder, or validated once for a shared object). ``entry_bytes``: the size of the
    encoded job it was decoded from, which bounds the size of its ``meta``.
    """
    if job.v != SCHEMA_VERSION:
        raise SchemaVersionError(f"job schema version {job.v} is not supported (this build: {SCHEMA_VERSION})")
    if not job.id or len(job.id) > 256:
        raise InvalidJob(f"job id must be 1-256 characters (got {len(job.id)})")
    try:
        check_name("producer", job.reply)
    except ValueError as e:
        raise InvalidJob(f"job {short(job.id)} has an impossible reply address: {e}") from e
    if job.meta is not None:
        check_meta(job.meta, entry_bytes)
    if (job.text is not None) + (job.tokens is not None) + (job.messages is not None) != 1:
        raise InvalidJob("a job needs exactly one of prompt text, prompt_token_ids or messages")
    if job.tokens is not None:
        if len(job.tokens) % 4 or not job.tokens:
            raise InvalidJob("prompt_token_ids must be a non-empty int32 array")
    if job.text is not None and not job.text:
        raise InvalidJob("prompt text is empty")
    if job.replica is not None:
        try:
            check_name("replica", job.replica)
        except ValueError as e:
            raise InvalidJob(f"job {job.id!r} targets an impossible replica: {e}") from e
    if job.messages is not None and not job.messages:
        raise InvalidJob("messages is empty")
    if max_prompt_bytes is not None:
        size = len(job.text.encode()) if job.text is not None else (
            len(job.tokens) if job.tokens is not None else sum(len(m.content.encode()) for m in job.messages or ())
        )
        if size > max_prompt_bytes:
            raise InvalidJob(f"prompt of {size} bytes exceeds the limit of {max_prompt_bytes} bytes")
    if sampling:
        job.sampling.validate()
    elif job.sampling.min_tokens > job.sampling.max_tokens:
        raise InvalidJob("invalid sampling params: min_tokens must be <= max_tokens")
    elif job.sampling.n * job.sampling.max_tokens > MAX_JOB_TOKENS:
        raise InvalidJob(f"invalid sampling params: n x max_tokens exceeds {MAX_JOB_TOKENS} tokens per job")
    return job


def cut(text: str, limit: int = 500) -> str:
    """An untrusted message cut to ``limit`` characters, for logs, errors and dead letters.

    >>> cut("x" * 12, 5)
    'xxxxx... (12 characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def short(text: Any, limit: int = 80) -> str:
    """``repr`` of an untrusted string cut to ``limit`` characters, for logs and error
    messages (a 10 MB job id must not become a 10 MB log line).

    >>> short("x" * 100, 10)
    "'xxxxxxxxxx'... (100 characters)"
    """
    if text is None:
        return "None"
    if not isinstance(text, str):
        return type(text).__name__
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def check_meta(meta: Any, encoded_within: int | None = None) -> None:
    """Refuse a ``meta`` nested deeper than :data:`MAX_META_DEPTH` or larger than
    :data:`MAX_META_BYTES` encoded (iteratively: the check itself never recurses).
    ``encoded_within``: the size of an encoded message that holds ``meta`` (a decoded job):
    at most :data:`MAX_META_BYTES` of it, and ``meta`` is not encoded again to be measured.

    >>> check_meta({"a": [1, 2, {"b": None}]})
    >>> nested = []
    >>> for _ in range(40): nested = [nested]
    >>> check_meta(nested)
    Traceback (most recent call last):
    ...
    rollq.errors.InvalidJob: meta nests deeper than 32 levels
    """
    if meta is None or isinstance(meta, (str, int, float, bool, bytes)):
        if isinstance(meta, (str, bytes)) and len(meta) > MAX_META_BYTES:
            raise InvalidJob(f"meta of {len(meta)} bytes exceeds the limit of {MAX_META_BYTES}")
        return
    stack: list[tuple[Any, int]] = [(meta, 1)]
    seen = 0
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_META_DEPTH:
            raise InvalidJob(f"meta nests deeper than {MAX_META_DEPTH} levels")
        children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        for child in children:
            seen += 1
            if seen > MAX_META_BYTES:  # each item takes a byte at least
                raise InvalidJob(f"meta is larger than {MAX_META_BYTES} bytes")
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
    if encoded_within is not None and encoded_within <= MAX_META_BYTES:
        return
    try:
        size = len(_enc.encode(meta))
    except (TypeError, OverflowError) as e:
        raise InvalidJob(f"meta must be msgpack-serializable (str, numbers, lists, dicts): {e}") from e
    if size > MAX_META_BYTES:
        raise InvalidJob(f"meta of {size} bytes encoded exceeds the limit of {MAX_META_BYTES}")


def _explain(e: msgspec.ValidationError, given: dict[str, Any]) -> str:
    """``Expected `int` >= 1 - at `$.n``` -> ``n must be an int >= 1 (got 0)``."""
    m = re.match(r"Expected `([^`]+)`(.*?) - at `\$\.(\w+)", str(e))
    if not m:
        return str(e)
    typ, constraint, field = m.group(1), m.group(2).strip(), m.group(3)
    sep = "" if not constraint or constraint.startswith(",") else " "
    return f"{field} must be {typ}{sep}{constraint} (got {given.get(field)!r})"


_validated: dict[int, SamplingParams] = {}
#: Keys of the job specs job_from_spec builds without the general checks.
_TOKENS_SPEC = frozenset({"prompt_token_ids", "sampling", "meta"})


def validated_sampling(sp: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """Validate sampling params once per distinct object (batches share one object)."""
    if isinstance(sp, SamplingParams):
        key = id(sp)
        if _validated.get(key) is sp:
            return sp
        sp.validate()
        if len(_validated) > 4096:
            _validated.clear()
        _validated[key] = sp  # holding it keeps its id from being reused
        return sp
    return SamplingParams.from_dict(sp)


def make_job(
    *,
    id: str,
    reply: str,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | bytes | None = None,
    messages: Sequence[dict[str, str] | Message] | None = None,
    sampling: SamplingParams | dict[str, Any] | None = None,
    replica: str | None = None,
    min_version: int | None = None,
    deadline: float | None = None,
    timeout: float | None = None,
    meta: Any = None,
    max_prompt_bytes: int | None = None,
    tracked: bool = False,
) -> Job:
    """Build and validate a :class:`Job` from user-facing arguments."""
    spec = {
        "prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages, "sampling": sampling,
        "replica": replica, "min_version": min_version, "deadline": deadline, "timeout": timeout, "meta": meta,
    }
    return job_from_spec(spec, id, reply, max_prompt_bytes, tracked)


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
            return None, ids if isinstance(ids, list) else list(ids)
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


def score_spec(context: Sequence[int], continuation: Sequence[int], **fields: Any) -> dict[str, Any]:
    """A job spec that scores ``continuation`` after ``context`` (token ids) without sampling
    it: the replica returns each prompt token's logprob (vLLM's ``prompt_logprobs``), and
    ``result.prompt_logprobs[len(context):]`` are the continuation's, under the weights the
    replica serves (``result.version_start``). vLLM generates at least one token, so one
    greedy token comes with it. Other job fields (``meta``, ``min_version``, ...) pass through.

    >>> score_spec([1, 2], [3, 4])["sampling"]
    {'max_tokens': 1, 'temperature': 0.0, 'prompt_logprobs': 0}
    """
    if not context or not continuation:
        raise InvalidJob("scoring needs a non-empty context and a non-empty continuation")
    return {"prompt_token_ids": [*context, *continuation],
            "sampling": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}, **fields}


def job_from_spec(spec: Mapping[str, Any], id: str, reply: str, max_prompt_bytes: int | None = None, tracked: bool = False) -> Job:
    """:func:`make_job` for fields given as a mapping (the producer's hot path; unknown keys
    are the caller's to refuse). Keys: ``prompt``, ``prompt_token_ids``, ``messages``,
    ``sampling``, ``replica``, ``min_version``, ``deadline`` or ``timeout``, ``meta``."""
    tokens = spec.get("prompt_token_ids")
    if type(tokens) is list and tokens and spec.keys() <= _TOKENS_SPEC:
        # The common shape (token ids, shared sampling params, meta): only what can be wrong
        # with it is checked; every other shape takes the general path below.
        sp = validated_sampling(spec.get("sampling"))
        if max_prompt_bytes is not None and 4 * len(tokens) > max_prompt_bytes:
            raise InvalidJob(f"prompt of {4 * len(tokens)} bytes exceeds the limit of {max_prompt_bytes} bytes")
        if tracked and not 0 < len(id) <= 256:
            raise InvalidJob("job id must be 1-256 characters")
        meta = spec.get("meta")
        if meta is not None:
            check_meta(meta)
        return Job(id=id, reply=reply, tokens=pack_i32(tokens), sampling=sp, submitted=time.time(), meta=meta, tracked=tracked)
    get = spec.get
    msgs = get("messages")
    if msgs is not None:
        try:
            msgs = [m if isinstance(m, Message) else Message(role=str(m["role"]), content=str(m["content"])) for m in msgs]
        except (KeyError, TypeError) as e:
            raise InvalidJob(f"each message needs 'role' and 'content': {e}") from e
    now = time.time()
    timeout = get("timeout")
    tokens = get("prompt_token_ids")
    text = get("prompt")
    if text is not None and type(text) is not str:
        if tokens is not None:
            raise InvalidJob("a job needs exactly one of prompt text, prompt_token_ids or messages")
        text, tokens = prompt_parts(text)
    job = Job(
        id=id,
        reply=reply,
        text=text,
        tokens=pack_i32(tokens) if tokens is not None else None,
        messages=msgs,
        sampling=validated_sampling(get("sampling")),
        replica=get("replica"),
        min_version=get("min_version"),
        deadline=now + timeout if timeout is not None else get("deadline"),
        submitted=now,
        meta=get("meta"),
        tracked=tracked,
    )
    return validate_job(job, max_prompt_bytes=max_prompt_bytes, sampling=False)


# ----------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------
#: ``Sample.versions`` start index of a version whose first token is not known (the
#: request was off the device, e.g. preempted, when that version was swapped in).
UNKNOWN_START = -1


class Sample(msgspec.Struct, array_like=True, gc=False):
    """One of the ``n`` completions of a job.

    ``versions`` says which policy version generated which tokens when a weight update
    landed during the generation (update policy ``keep``): ``[(version, first token index),
    ...]`` in order, starting with ``(version_start, 0)``. None: every token was generated
    at the result's ``version_start``. See :meth:`token_versions`.
    """

    tokens: bytes  # little-endian int32
    logprobs: bytes | None = None  # little-endian float32, one per generated token
    text: str | None = None
    finish_reason: str | None = None
    versions: list[tuple[int, int]] | None = None

    @property
    def token_ids(self) -> list[int]:
        return unpack_i32(self.tokens)

    @property
    def token_logprobs(self) -> list[float] | None:
        return unpack_f32(self.logprobs) if self.logprobs is not None else None

    def token_versions(self, version_start: int) -> list[int]:
        """The policy version that generated each token (``-1``: not known exactly).

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
    #: little-endian float32 (the first token has none: NaN).
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


# ----------------------------------------------------------------------------------------
# Codec
# ----------------------------------------------------------------------------------------
_enc = msgspec.msgpack.Encoder()
_job_dec = msgspec.msgpack.Decoder(Job)
_res_dec = msgspec.msgpack.Decoder(Result)
_dl_dec = msgspec.msgpack.Decoder(DeadLetter)
_any_dec = msgspec.msgpack.Decoder()

encode = _enc.encode


def _diagnose(data: bytes, what: str, err: Exception) -> ProtocolError:
    """Turn a typed-decode failure into the clearest error we can give."""
    try:
        raw = _any_dec.decode(data)
    except RecursionError:
        return ProtocolError(f"{what} of {len(data)} bytes nests too deep to decode")
    except Exception:  # noqa: BLE001 - not msgpack at all
        return ProtocolError(f"{what} is not valid msgpack ({len(data)} bytes)")
    if isinstance(raw, list) and raw and isinstance(raw[0], int) and raw[0] != SCHEMA_VERSION:
        return SchemaVersionError(
            f"{what} has schema version {raw[0]}; this build understands version {SCHEMA_VERSION}"
        )
    return ProtocolError(f"malformed {what}: {cut(str(err), 300)}")




class _Envelope(msgspec.Struct, array_like=True):
    """The first three fields of a job (the rest is skipped without being decoded)."""

    v: int
    id: str
    reply: str


def peek_id(data: bytes) -> tuple[str | None, str | None]:
    """Best-effort ``(job id, reply)`` of an undecodable job, to tell its submitter: only a
    plausible id and a valid producer name are returned (an entry with a 10 MB id or reply
    must not name a result key, nor fill a log line)."""
    try:
        raw = msgspec.msgpack.decode(data, type=_Envelope)
    except Exception:  # noqa: BLE001 - anything undecodable: nobody to tell
        return None, None
    jid, reply = raw.id, raw.reply
    try:
        check_name("producer", reply)
    except ValueError:
        return None, None
    return (jid if 0 < len(jid) <= 256 else None), reply


def encode_job(job: Job) -> bytes:
    return _enc.encode(job)


def decode_job(data: bytes, max_prompt_bytes: int | None = None) -> Job:
    """Decode and validate a job; raise ProtocolError / SchemaVersionError / InvalidJob, and
    nothing else, whatever the bytes (a structure nested too deep to decode included).

    msgspec's decoder enforces types and ranges; the rest of :func:`validate_job` follows.
    """
    try:
        job = _job_dec.decode(data)
    except msgspec.ValidationError as e:
        if job_like(data):
            raise InvalidJob(f"invalid job: {cut(str(e), 300)}") from e
        raise _diagnose(data, "job", e) from e
    except msgspec.DecodeError as e:
        raise _diagnose(data, "job", e) from e
    except RecursionError as e:
        raise ProtocolError(f"job of {len(data)} bytes nests too deep to decode") from e
    except Exception as e:  # noqa: BLE001 - any other decoder failure is a bad entry too
        raise ProtocolError(f"job of {len(data)} bytes cannot be decoded: {type(e).__name__}") from e
    return validate_job(job, max_prompt_bytes=max_prompt_bytes, sampling=False, entry_bytes=len(data))


def job_like(data: bytes) -> bool:
    """A well-formed job envelope of our schema version (its contents may still be invalid)."""
    try:
        raw = msgspec.msgpack.decode(data, type=_Envelope)
    except Exception:  # noqa: BLE001 - not one
        return False
    return raw.v == SCHEMA_VERSION


def encode_result(result: Result) -> bytes:
    return _enc.encode(result)


def decode_result(data: bytes) -> Result:
    try:
        r = _res_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _diagnose(data, "result", e) from e
    if r.v != SCHEMA_VERSION:
        raise SchemaVersionError(f"result schema version {r.v} is not supported")
    return r


def encode_dead_letter(d: DeadLetter) -> bytes:
    return _enc.encode(d)


def decode_dead_letter(data: bytes) -> DeadLetter:
    try:
        return _dl_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _diagnose(data, "dead letter", e) from e


# ----------------------------------------------------------------------------------------
# Control channel (pub/sub hints; the durable state is in Redis keys)
# ----------------------------------------------------------------------------------------
class Control(str, enum.Enum):
    """Verbs of a queue's control channel (``keys.control``): messages are ``"<verb> <arg>"``.
    They are hints: a replica that misses one catches up from the durable state.

    >>> control_message(Control.CANCEL, "job-1")
    'cancel job-1'
    >>> parse_control("version 7")
    (<Control.VERSION: 'version'>, '7')
    >>> parse_control("no-such-verb x")
    (None, 'x')
    """

    #: A job was cancelled (arg: job id; ``lua/cancel.lua`` publishes it).
    CANCEL = "cancel"
    #: A replica stopped and handed its jobs back (arg: replica id): peers reclaim now.
    HANDBACK = "handback"
    #: A policy version was committed (arg: version; ``lua/publish_version.lua``).
    VERSION = "version"
    #: A version is offered over the broadcast group (arg: version).
    WOFFER = "woffer"
    #: A broadcast group is forming (arg: group id): replicas join it.
    WGROUP = "wgroup"
    #: Drop the prefix cache (no arg; loading a version drops it anyway).
    RESET_PREFIX_CACHE = "reset-prefix-cache"


_CONTROL = {c.value: c for c in Control}


def control_message(verb: Control, arg: str | int = "") -> str:
    """The text of a control message."""
    return f"{verb.value} {arg}" if arg != "" else verb.value


def parse_control(text: str) -> tuple[Control | None, str]:
    """``(verb, arg)`` of a control message; an unknown verb gives ``None`` (newer peers)."""
    verb, _, arg = text.partition(" ")
    return _CONTROL.get(verb), arg
