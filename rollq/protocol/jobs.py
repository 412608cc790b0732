"""Jobs: what a producer asks for, built and checked from user-facing fields.

:func:`job_from_spec` builds a job from a mapping of fields; :func:`token_jobs` is its fast
path for the common shape (a list of token ids, sampling params, optional ``meta``), the loop
``Producer.build_jobs`` runs for batches.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping, Sequence

import msgspec

from ..errors import InvalidJob, SchemaVersionError
from ..keys import check_name
from .arrays import pack_i32, unpack_i32
from .limits import MAX_JOB_TOKENS, MAX_META_BYTES, MAX_META_DEPTH, MAX_RESULT_BYTES, SCHEMA_VERSION
from .prompts import prompt_parts
from .results import result_bound
from .sampling import SamplingParams, validated_sampling
from .text import short


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
    #: Publish the samples' tokens while they are generated (:mod:`rollq.protocol.progress`;
    #: ``JobHandle.stream()`` reads them), not only the final result.
    stream: bool = False

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
        # the sign bit of each little-endian int32 (an engine may index its embedding with it)
        if not job.tokens[3::4].isascii():
            raise InvalidJob("prompt_token_ids must not be negative")
    if job.text is not None and not job.text:
        raise InvalidJob("prompt text is empty")
    if job.replica is not None:
        try:
            check_name("replica", job.replica)
        except ValueError as e:
            raise InvalidJob(f"job {job.id!r} targets an impossible replica: {e}") from e
    if job.messages is not None and not job.messages:
        raise InvalidJob("messages is empty")
    if type(job.stream) is not bool:
        raise InvalidJob(f"stream must be true or false (got {type(job.stream).__name__})")
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


_meta_enc = msgspec.msgpack.Encoder()


def check_meta(meta: Any, encoded_within: int | None = None) -> int | None:
    """Refuse a ``meta`` nested deeper than :data:`MAX_META_DEPTH` or larger than
    :data:`MAX_META_BYTES` encoded (iteratively: the check itself never recurses).
    ``encoded_within``: the size of an encoded message that holds ``meta`` (a decoded job):
    at most :data:`MAX_META_BYTES` of it, and ``meta`` is not encoded again to be measured.

    Returns ``meta``'s size encoded (None when ``encoded_within`` spared the encoding).

    >>> check_meta({"a": [1, 2, {"b": None}]})
    10
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
        if encoded_within is not None:
            return None
        try:
            return len(_meta_enc.encode(meta))
        except OverflowError as e:
            raise InvalidJob(f"meta must be msgpack-serializable (str, numbers, lists, dicts): {e}") from e
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
        return None
    try:
        size = len(_meta_enc.encode(meta))
    except (TypeError, OverflowError) as e:
        raise InvalidJob(f"meta must be msgpack-serializable (str, numbers, lists, dicts): {e}") from e
    if size > MAX_META_BYTES:
        raise InvalidJob(f"meta of {size} bytes encoded exceeds the limit of {MAX_META_BYTES}")
    return size


def check_result_bound(sp: SamplingParams, job_id: str, prompt_tokens: int, prompt_ids: bool,
                       meta_bytes: int | None) -> None:
    """Refuse a job whose result could be larger than :data:`MAX_RESULT_BYTES` encoded (see
    :func:`~rollq.protocol.results.result_bound`): it would fail with ResultTooLarge only
    after it ran. ``prompt_tokens``: the prompt's length in tokens (at most, for a text or
    chat prompt, whose ids the result carries: ``prompt_ids``)."""
    size = result_bound(
        id_bytes=len(job_id.encode()), n=sp.n, max_tokens=sp.max_tokens, logprobs=sp.logprobs is not None,
        prompt_tokens=prompt_tokens, prompt_ids=prompt_ids, prompt_logprobs=sp.prompt_logprobs is not None,
        meta_bytes=meta_bytes,
    )
    if size > MAX_RESULT_BYTES:
        raise InvalidJob(
            f"the result of this job can take {size} bytes encoded ({sp.n} samples of up to {sp.max_tokens} tokens"
            f"{', with logprobs' if sp.logprobs is not None else ''}"
            f"{', with prompt logprobs' if sp.prompt_logprobs is not None else ''}), over the limit of "
            f"{MAX_RESULT_BYTES} bytes a replica records; lower n, max_tokens or logprobs"
        )


def _fits_any_id(sp: SamplingParams) -> bool:
    """Whether every job of ``sp`` with a token prompt and no meta or prompt logprobs fits
    :data:`MAX_RESULT_BYTES`, whatever its id (up to 256 characters of 4 bytes)."""
    return result_bound(
        id_bytes=4 * 256, n=sp.n, max_tokens=sp.max_tokens, logprobs=sp.logprobs is not None, prompt_tokens=0,
        prompt_ids=False, prompt_logprobs=False, meta_bytes=None,
    ) <= MAX_RESULT_BYTES


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
    stream: bool = False,
) -> Job:
    """Build and validate a :class:`Job` from user-facing arguments."""
    spec = {
        "prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages, "sampling": sampling,
        "replica": replica, "min_version": min_version, "deadline": deadline, "timeout": timeout, "meta": meta,
        "stream": stream,
    }
    return job_from_spec(spec, id, reply, max_prompt_bytes, tracked)


#: Keys of the specs :func:`token_jobs` builds (the common shape).
TOKEN_SPEC_KEYS = frozenset({"prompt_token_ids", "sampling", "meta"})
#: What :func:`token_jobs` returns when its specs ran out.
SPECS_END = object()


def token_jobs(specs: Iterator[Any], out: list[Job], reply: str, max_prompt_bytes: int | None = None, *,
               prefix: str = "", seq: int = 0, ids: Iterator[str] | None = None, tracked: bool = False) -> Any:
    """The fast path of :func:`job_from_spec`, for batches: builds into ``out`` a job for
    each spec of the common shape (a dict of ``prompt_token_ids``, a non-empty list, and
    optionally ``sampling`` and ``meta``), until a spec of another shape, which it returns
    (:data:`SPECS_END` when ``specs`` ran out). Job ids are taken from ``ids``, or else
    numbered ``f"{prefix}{n:x}"`` from ``n = seq + 1`` on (``seq + len(out)`` afterwards).

    Each job is the one :func:`job_from_spec`'s general path makes of the same fields, and
    only what can be wrong with this shape is checked, in the same order: sampling params
    (validated once per distinct value), prompt size, job id, ``meta``, token ids.

    >>> out = []
    >>> token_jobs(iter([{"prompt_token_ids": [1, 2]}, {"prompt": "hi"}]), out, "p1", prefix="p1-")
    {'prompt': 'hi'}
    >>> out[0].id, out[0].prompt_token_ids
    ('p1-1', [1, 2])
    """
    append, now = out.append, time.time
    last_in: Any = SPECS_END  # the sampling params of the last spec
    sp = SamplingParams()  # replaced at the first spec (last_in is no spec's)
    fits = False  # every job of sp fits MAX_RESULT_BYTES (no meta, no prompt logprobs)
    for s in specs:
        if type(s) is not dict:
            return s
        tokens = s.get("prompt_token_ids")
        # The keys are TOKEN_SPEC_KEYS' (tested without making a keys view per spec: one
        # object each, which the garbage collector would count).
        if type(tokens) is not list or not tokens or len(s) != 1 + ("sampling" in s) + ("meta" in s):
            return s
        sampling = s.get("sampling")
        if sampling is not last_in:
            sp = validated_sampling(sampling)
            fits = _fits_any_id(sp)
            # Frozen params (or none) are the same for the next spec that holds them; a dict may change.
            last_in = sampling if sampling is None or isinstance(sampling, SamplingParams) else SPECS_END
        if max_prompt_bytes is not None and 4 * len(tokens) > max_prompt_bytes:
            raise InvalidJob(f"prompt of {4 * len(tokens)} bytes exceeds the limit of {max_prompt_bytes} bytes")
        if ids is None:
            seq += 1
            jid = f"{prefix}{seq:x}"
        else:
            jid = next(ids)
        if tracked and not 0 < len(jid) <= 256:
            raise InvalidJob("job id must be 1-256 characters")
        meta = s.get("meta")
        meta_bytes = check_meta(meta) if meta is not None else None
        if not fits or meta is not None or sp.prompt_logprobs is not None:
            check_result_bound(sp, jid, len(tokens), False, meta_bytes)
        append(Job(id=jid, reply=reply, tokens=pack_i32(tokens), sampling=sp, submitted=now(), meta=meta, tracked=tracked))
    return SPECS_END


def job_from_spec(spec: Mapping[str, Any], id: str, reply: str, max_prompt_bytes: int | None = None, tracked: bool = False) -> Job:
    """:func:`make_job` for fields given as a mapping (the producer's hot path; unknown keys
    are the caller's to refuse). Keys: ``prompt``, ``prompt_token_ids``, ``messages``,
    ``sampling``, ``replica``, ``min_version``, ``deadline`` or ``timeout``, ``meta``,
    ``stream`` (publish progress while it runs)."""
    get = spec.get
    tokens = get("prompt_token_ids")
    if type(tokens) is list and tokens:  # perhaps the common shape: token_jobs takes it if it is
        out: list[Job] = []
        one = spec if type(spec) is dict else dict(spec)
        if token_jobs(iter((one,)), out, reply, max_prompt_bytes, ids=iter((id,)), tracked=tracked) is SPECS_END:
            return out[0]
    msgs = get("messages")
    if msgs is not None:
        try:
            msgs = [m if isinstance(m, Message) else Message(role=str(m["role"]), content=str(m["content"])) for m in msgs]
        except (KeyError, TypeError) as e:
            raise InvalidJob(f"each message needs 'role' and 'content': {e}") from e
    now = time.time()
    timeout = get("timeout")
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
        stream=get("stream", False),
    )
    validate_job(job, max_prompt_bytes=max_prompt_bytes, sampling=False)
    if job.tokens is not None:
        prompt, ids = len(job.tokens) // 4, False
    else:  # a text or chat prompt: at most one token per byte (byte-level tokenizers), ids returned
        text = job.text if job.text is not None else "".join(m.role + m.content for m in job.messages or ())
        prompt, ids = len(text.encode()), True
    check_result_bound(job.sampling, job.id, prompt, ids, check_meta(job.meta) if job.meta is not None else None)
    return job
