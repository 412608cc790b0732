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

Modules: :mod:`~rollq.protocol.limits` (schema version, bounds), :mod:`~rollq.protocol.arrays`
(int32/float32 packing), :mod:`~rollq.protocol.sampling`, :mod:`~rollq.protocol.prompts`,
:mod:`~rollq.protocol.jobs`, :mod:`~rollq.protocol.results`, :mod:`~rollq.protocol.progress`, :mod:`~rollq.protocol.codec`,
:mod:`~rollq.protocol.control` (the control channel's verbs), :mod:`~rollq.protocol.text`
(untrusted strings cut short). Import from ``rollq.protocol``.
"""

from .arrays import i32_packer, pack_f32, pack_i32, unpack_f32, unpack_i32
from .codec import (
    decode_dead_letter,
    decode_job,
    decode_result,
    encode,
    encode_dead_letter,
    encode_job,
    encode_result,
    job_like,
    peek_id,
)
from .control import Control, control_message, parse_control
from .jobs import SPECS_END, TOKEN_SPEC_KEYS, Job, Message, check_meta, job_from_spec, make_job, token_jobs, validate_job
from .limits import (
    MAX_JOB_TOKENS,
    MAX_LOGPROBS,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MAX_N,
    MAX_STOP,
    MAX_TOKENS_LIMIT,
    SCHEMA_VERSION,
)
from .progress import MAX_PROGRESS_TEXT, MAX_PROGRESS_TOKENS, ProgressEntry, decode_progress, encode_progress
from .prompts import SCORE_SETS, Scores, prompt_parts, score_spec, token_list
from .replica import LATENCY_BUCKETS_MS, FreeSlots, ReplicaInfo, latency_bucket
from .results import RAW_LOGPROBS, UNKNOWN_START, DeadLetter, ErrorInfo, LogprobSource, Result, Sample
from .sampling import SamplingParams, validated_sampling
from .text import cut, short

__all__ = [
    # limits
    "SCHEMA_VERSION", "MAX_TOKENS_LIMIT", "MAX_JOB_TOKENS", "MAX_N", "MAX_LOGPROBS", "MAX_STOP",
    "MAX_META_DEPTH", "MAX_META_BYTES",
    # sampling
    "SamplingParams", "validated_sampling",
    # jobs and prompts
    "Job", "Message", "make_job", "job_from_spec", "token_jobs", "TOKEN_SPEC_KEYS", "SPECS_END", "validate_job", "check_meta",
    "prompt_parts", "score_spec", "Scores", "token_list", "SCORE_SETS",
    # results
    "Result", "Sample", "ErrorInfo", "DeadLetter", "UNKNOWN_START", "LogprobSource", "RAW_LOGPROBS",
    # codec
    "encode", "encode_job", "decode_job", "job_like", "peek_id", "encode_result", "decode_result",
    "encode_dead_letter", "decode_dead_letter",
    # progress of streamed jobs
    "ProgressEntry", "encode_progress", "decode_progress", "MAX_PROGRESS_TOKENS", "MAX_PROGRESS_TEXT",
    # raw arrays
    "pack_i32", "unpack_i32", "pack_f32", "unpack_f32", "i32_packer",
    # control channel
    "Control", "control_message", "parse_control",
    # untrusted text
    "cut", "short",
    # what replicas publish: the registry entry, the free slots, the latency histogram's buckets
    "ReplicaInfo", "FreeSlots", "LATENCY_BUCKETS_MS", "latency_bucket",
]
