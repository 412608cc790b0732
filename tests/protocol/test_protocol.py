"""Wire format: pure encode/decode, validation, schema versions (no Redis)."""

from __future__ import annotations

import math
import struct

import msgspec
import pytest

from rollq.errors import InvalidJob, ProtocolError, SchemaVersionError
from rollq.protocol import (
    MAX_LOGPROBS,
    RAW_LOGPROBS,
    SCHEMA_VERSION,
    UNKNOWN_START,
    DeadLetter,
    ErrorInfo,
    Job,
    LogprobSource,
    Message,
    Result,
    Sample,
    SamplingParams,
    Scores,
    decode_dead_letter,
    decode_job,
    decode_result,
    encode,
    encode_dead_letter,
    encode_job,
    encode_result,
    job_from_spec,
    make_job,
    pack_f32,
    pack_i32,
    peek_id,
    unpack_f32,
    unpack_i32,
)


def job(**kw) -> Job:
    kw.setdefault("id", "j1")
    kw.setdefault("reply", "p1")
    if not any(k in kw for k in ("prompt", "prompt_token_ids", "messages")):
        kw["prompt"] = "hello"
    return make_job(**kw)


# ----------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt": "héllo wörld ✓"},
        {"prompt_token_ids": [1, 2, 3, 2**31 - 1, 0]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]},
    ],
    ids=["text", "tokens", "messages"],
)
def test_job_round_trip(prompt):
    j = job(
        id="job-1",
        reply="prod-1",
        sampling={"max_tokens": 32, "temperature": 0.7, "top_p": 0.9, "n": 8, "logprobs": 2, "stop": ["\n"], "seed": 7},
        replica="r0",
        min_version=3,
        timeout=60,
        meta={"step": 12, "tags": ["a", "b"], "blob": b"\x00\xff"},
        **prompt,
    )
    data = encode_job(j)
    assert isinstance(data, bytes)
    back = decode_job(data)
    assert back == j
    assert back.v == SCHEMA_VERSION
    assert back.sampling.n == 8 and back.sampling.stop == ["\n"] and back.sampling.seed == 7
    assert back.replica == "r0" and back.min_version == 3
    assert back.deadline == pytest.approx(j.submitted + 60, abs=1)
    assert back.meta == {"step": 12, "tags": ["a", "b"], "blob": b"\x00\xff"}
    if "prompt_token_ids" in prompt:
        assert back.kind() == "tokens"
        assert back.prompt_token_ids == prompt["prompt_token_ids"]
    elif "messages" in prompt:
        assert back.kind() == "messages"
        assert back.messages == [Message("system", "be brief"), Message("user", "2+2?")]
    else:
        assert back.kind() == "text" and back.text == prompt["prompt"]


def test_default_sampling_is_omitted_and_compact():
    """Defaults are not written (omit_defaults): a tiny job stays tiny on the wire."""
    j = job(prompt_token_ids=list(range(50)))
    data = encode_job(j)
    assert len(data) < 50 * 4 + 80, len(data)
    assert decode_job(data).sampling == SamplingParams()


def test_result_round_trip():
    r = Result(
        id="j1",
        samples=[
            Sample(tokens=pack_i32([5, 6, 7]), logprobs=pack_f32([-0.25, -1.5, 0.0]), text="abc", finish_reason="stop"),
            Sample(tokens=pack_i32([]), finish_reason="length"),
        ],
        prompt_tokens=3,
        version_start=4,
        version_end=5,
        replica="r1",
        submitted=1.0,
        started=2.0,
        finished=3.5,
        deliveries=2,
        meta=["x", 1],
    )
    back = decode_result(encode_result(r))
    assert back == r
    assert back.ok and back.policy_version == (4, 5)
    assert back.samples[0].token_ids == [5, 6, 7]
    assert back.samples[0].token_logprobs == [-0.25, -1.5, 0.0]
    assert back.samples[1].token_ids == [] and back.samples[1].token_logprobs is None
    assert back.queued_s == 1.0

    err = Result(id="j2", error=ErrorInfo(type="JobRejected", message="nope"))
    back = decode_result(encode_result(err))
    assert not back.ok and back.error == ErrorInfo("JobRejected", "nope")


def test_samples_say_what_their_logprobs_are_and_old_results_read_as_raw():
    src = LogprobSource.of(SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True), "processed")
    r = Result(id="j1", samples=[Sample(tokens=pack_i32([5, 6]), logprobs=pack_f32([-0.5, -1.0]), lp_source=src)])
    back = decode_result(encode_result(r))
    assert back.samples[0].logprob_source == src and back.logprob_source == src
    assert (src.kind, src.temperature, src.top_p) == ("processed", 0.7, 0.9)
    assert src.transformed() == ["temperature=0.7", "top_p=0.9"]
    # A result from a replica before the field: its samples are arrays of 5, read as raw.
    raw = msgspec.msgpack.decode(encode_result(r))
    raw[2] = [s[:5] for s in raw[2]]
    old = decode_result(encode(raw))
    assert old.samples[0].lp_source is None and old.logprob_source == RAW_LOGPROBS
    assert RAW_LOGPROBS.kind == "raw" and RAW_LOGPROBS.transformed() == []
    assert old.samples[0].token_logprobs == [-0.5, -1.0]


def test_scores_carry_the_version_that_computed_them():
    lps = pack_f32([math.nan, -1.0, -2.0, -3.0])
    one = Sample(tokens=pack_i32([9]))
    assert Scores.of(Result(id="s", prompt_lps=lps, version_start=5, version_end=5, samples=[one]), 2) == ([-2.0, -3.0], 5)
    # Across a swap: known only when the sampled token (after the whole prompt) came before it.
    before = Sample(tokens=pack_i32([9]), versions=[(5, 0), (6, 1)])
    after = Sample(tokens=pack_i32([9]), versions=[(5, 0), (6, 0)])
    unknown = Sample(tokens=pack_i32([9]), versions=[(5, 0), (6, UNKNOWN_START)])
    for sample, version in ((before, 5), (after, UNKNOWN_START), (unknown, UNKNOWN_START), (one, UNKNOWN_START)):
        got = Scores.of(Result(id="s", prompt_lps=lps, version_start=5, version_end=6, samples=[sample]), 1)
        assert got.version == version and got.logprobs == [-1.0, -2.0, -3.0], sample
    assert Scores.of(Result(id="s", version_start=2, version_end=2), 1) == Scores([], 2)  # no prompt logprobs


def test_dead_letter_round_trip():
    d = DeadLetter(
        job_id=None, reason="garbage", error_type="JobRejected", consumer="c1", deliveries=1, at=12.5,
        source="rollq:{q}:jobs", payload=b"\xc1\x00",
    )
    assert decode_dead_letter(encode_dead_letter(d)) == d


# ----------------------------------------------------------------------------------------
# schema versions and malformed bytes
# ----------------------------------------------------------------------------------------
def test_job_of_unknown_schema_version_is_refused():
    j = job()
    j.v = SCHEMA_VERSION + 1
    with pytest.raises(SchemaVersionError, match=rf"schema version {SCHEMA_VERSION + 1}.*\b{SCHEMA_VERSION}\b"):
        decode_job(encode_job(j))


def test_unknown_schema_version_with_unknown_shape_is_named():
    """A future version may change the shape too: the error still names the version."""
    data = encode([SCHEMA_VERSION + 6, {"a new": "layout"}, 3.5])
    with pytest.raises(SchemaVersionError, match=rf"schema version {SCHEMA_VERSION + 6}"):
        decode_job(data)
    with pytest.raises(SchemaVersionError, match=rf"schema version {SCHEMA_VERSION + 6}"):
        decode_result(data)


def test_result_of_unknown_schema_version_is_refused():
    r = Result(id="x", v=SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError, match="schema version"):
        decode_result(encode_result(r))


def test_schema_version_error_is_a_protocol_error():
    assert issubclass(SchemaVersionError, ProtocolError)
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),  # a byte msgpack never uses
        (b"\xff\x00garbage\x13", "not valid msgpack"),
        (encode_job(Job(id="j", reply="p", text="hi"))[:-3], "not valid msgpack"),  # truncated
        (encode({"id": "j", "reply": "p", "text": "hi"}), "malformed job"),  # a map, not an array
        (encode([SCHEMA_VERSION, 42, "p"]), "malformed job"),  # wrong field type
        (encode("just a string"), "malformed job"),
        (encode([]), "malformed job"),
    ],
    ids=["empty", "c1", "garbage", "truncated", "map", "wrong-type", "string", "empty-array"],
)
def test_malformed_job_bytes(data, match):
    with pytest.raises(ProtocolError, match=match) as ei:
        decode_job(data)
    assert not isinstance(ei.value, SchemaVersionError)


@pytest.mark.parametrize("data", [b"", b"\xc1", encode({"id": 1}), encode([SCHEMA_VERSION, 5])])
def test_malformed_result_and_dead_letter_bytes(data):
    with pytest.raises(ProtocolError):
        decode_result(data)
    with pytest.raises(ProtocolError):
        decode_dead_letter(data)


def test_peek_id_of_undecodable_jobs():
    """The consumer tells the submitter when it can find the id and reply in a bad entry."""
    bad_version = job(id="j9", reply="prod")
    bad_version.v = 99
    assert peek_id(encode_job(bad_version)) == ("j9", "prod")
    assert peek_id(b"\xc1") == (None, None)
    assert peek_id(encode({"id": "j9"})) == (None, None)


# ----------------------------------------------------------------------------------------
# sampling parameter whitelist
# ----------------------------------------------------------------------------------------
def test_sampling_params_accepts_the_whitelist():
    sp = SamplingParams.from_dict(
        {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.05, "seed": 1, "stop": ["</s>"],
         "stop_token_ids": [2], "n": 16, "logprobs": MAX_LOGPROBS, "ignore_eos": True, "min_tokens": 4,
         "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
         "skip_special_tokens": False, "detokenize": False}
    )
    assert sp.n == 16 and sp.top_k == -1 and sp.logprobs == MAX_LOGPROBS
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict(sp) is sp


def test_unknown_sampling_key_is_refused_by_name():
    with pytest.raises(InvalidJob, match=r"unknown sampling parameter.*'best_of'.*allowed"):
        SamplingParams.from_dict({"max_tokens": 4, "best_of": 2})


@pytest.mark.parametrize(
    "params, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"n": -3}, "n must be"),
        ({"logprobs": 50}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_p": math.nan}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"n": 2.5}, "invalid sampling params"),
        ({"max_tokens": "many"}, "invalid sampling params"),
        ({"stop": "\n"}, "invalid sampling params"),  # a string, not a list of strings
    ],
)
def test_bad_sampling_values_are_refused_clearly(params, match):
    with pytest.raises(InvalidJob, match=match) as ei:
        SamplingParams.from_dict(params)
    assert "invalid sampling params" in str(ei.value)
    # and the same through the job builder
    with pytest.raises(InvalidJob, match=match):
        job(sampling=params)


def test_sampling_params_must_be_a_mapping():
    with pytest.raises(InvalidJob, match="mapping"):
        SamplingParams.from_dict([("n", 2)])  # type: ignore[arg-type]


def test_decoder_revalidates_sampling_params():
    """A job written by a buggy or foreign producer is re-checked by the consumer's decoder."""
    j = Job(id="j", reply="p", text="hi", sampling=SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidJob, match="temperature"):
        decode_job(encode_job(j))


# ----------------------------------------------------------------------------------------
# prompts
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompts",
    [
        {},
        {"prompt": "a", "prompt_token_ids": [1]},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"prompt_token_ids": [1], "messages": [{"role": "user", "content": "b"}]},
        {"prompt": "a", "prompt_token_ids": [1], "messages": [{"role": "user", "content": "b"}]},
    ],
    ids=["none", "text+tokens", "text+messages", "tokens+messages", "all"],
)
def test_exactly_one_prompt(prompts):
    with pytest.raises(InvalidJob, match="exactly one of"):
        make_job(id="j", reply="p", **prompts)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt_token_ids": []}, "non-empty"),
        ({"prompt_token_ids": [5, -3, 7]}, "negative"),
        ({"prompt_token_ids": [-(2**31)]}, "negative"),
        ({"messages": []}, "empty"),
        ({"messages": [{"role": "user"}]}, "role.*content"),
    ],
)
def test_empty_or_broken_prompts(prompts, match):
    with pytest.raises(InvalidJob, match=match):
        make_job(id="j", reply="p", **prompts)


def test_decoder_enforces_exactly_one_prompt():
    j = Job(id="j", reply="p", text="a", tokens=pack_i32([1]))
    with pytest.raises(InvalidJob, match="exactly one of"):
        decode_job(encode_job(j))
    j = Job(id="j", reply="p", tokens=b"\x01\x00\x00")  # not a whole number of int32
    with pytest.raises(InvalidJob, match="int32"):
        decode_job(encode_job(j))
    # a negative id written by something other than a producer: refused where it is read
    j = Job(id="j", reply="p", tokens=pack_i32([1, 2**31 - 1]) + b"\xff\xff\xff\xff")
    with pytest.raises(InvalidJob, match="negative"):
        decode_job(encode_job(j))
    assert decode_job(encode_job(Job(id="j", reply="p", tokens=pack_i32([0, 2**31 - 1, 255, 128, 2**24])))).tokens


@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt": "x" * 101},
        {"prompt": "é" * 51},  # 102 UTF-8 bytes, 51 characters
        {"prompt_token_ids": list(range(26))},  # 104 bytes
        {"messages": [{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 60}]},
        {"messages": [{"role": "user", "content": "é" * 51}]},  # 102 bytes: the limit is in bytes
    ],
    ids=["text", "utf8", "tokens", "messages", "messages-utf8"],
)
def test_oversized_prompt_is_refused(prompt):
    with pytest.raises(InvalidJob, match=r"exceeds the limit of 100 bytes"):
        make_job(id="j", reply="p", max_prompt_bytes=100, **prompt)


def test_prompt_at_the_limit_is_accepted():
    assert make_job(id="j", reply="p", prompt="x" * 100, max_prompt_bytes=100).text == "x" * 100
    assert make_job(id="j", reply="p", prompt_token_ids=list(range(25)), max_prompt_bytes=100).tokens


def test_job_id_length():
    with pytest.raises(InvalidJob, match="job id"):
        make_job(id="", reply="p", prompt="a")
    with pytest.raises(InvalidJob, match="job id"):
        make_job(id="x" * 257, reply="p", prompt="a")


def test_token_id_outside_int32_is_refused_not_wrapped():
    """A token id that does not fit int32 must be an InvalidJob, never silently wrapped."""
    with pytest.raises(InvalidJob):
        make_job(id="j", reply="p", prompt_token_ids=[1, 2**31])


# ----------------------------------------------------------------------------------------
# raw arrays
# ----------------------------------------------------------------------------------------
def test_token_ids_are_little_endian_int32():
    ids = [0, 1, -1, 255, 256, 2**31 - 1, -(2**31)]
    data = pack_i32(ids)
    assert data == struct.pack(f"<{len(ids)}i", *ids)
    assert unpack_i32(data) == ids
    assert pack_i32(None) == b""
    assert pack_i32(data) == data  # bytes pass through
    assert pack_i32(range(3)) == struct.pack("<3i", 0, 1, 2)
    prompt = [i for i in ids if i >= 0]  # a prompt's ids are never negative
    j = make_job(id="j", reply="p", prompt_token_ids=prompt)
    assert j.tokens == struct.pack(f"<{len(prompt)}i", *prompt)
    assert decode_job(encode_job(j)).prompt_token_ids == prompt


def test_token_ids_from_numpy():
    np = pytest.importorskip("numpy")
    for dtype in ("<i8", ">i4", "<i2", "<u2"):
        a = np.array([1, 2, 300, 7], dtype=dtype)
        assert pack_i32(a) == struct.pack("<4i", 1, 2, 300, 7), dtype


def test_logprobs_are_little_endian_float32():
    vals = [-0.5, -1.25, 0.0, -3.0e-8, -100.0]
    data = pack_f32(vals)
    assert data == struct.pack("<5f", *vals)
    assert len(data) == 4 * len(vals)
    back = unpack_f32(data)
    assert back == [struct.unpack("<f", struct.pack("<f", v))[0] for v in vals]
    # float32 rounding, not float64
    assert unpack_f32(pack_f32([0.1]))[0] != 0.1
    assert unpack_f32(pack_f32([0.1]))[0] == pytest.approx(0.1, rel=1e-7)
    np = pytest.importorskip("numpy")
    assert pack_f32(np.array(vals, dtype="<f8")) == data


def test_wire_has_no_pickle():
    """Arbitrary objects are not serializable: no pickle fallback."""
    class Thing:
        pass

    with pytest.raises((TypeError, msgspec.EncodeError)):
        encode_job(Job(id="j", reply="p", text="a", meta=Thing()))


def test_token_spec_fast_path_builds_the_same_job():
    """job_from_spec builds {prompt_token_ids, sampling, meta} specs without the general
    checks: the job must be the one the general path builds, and bad input still refused."""
    from rollq.protocol import job_from_spec

    sp = SamplingParams(max_tokens=8, n=2)
    fast = job_from_spec({"prompt_token_ids": [1, 2, 3], "sampling": sp, "meta": {"k": 1}}, "j1", "p", 1024, True)
    slow = make_job(id="j1", reply="p", prompt_token_ids=[1, 2, 3], sampling=sp, meta={"k": 1}, max_prompt_bytes=1024, tracked=True)
    fast.submitted = slow.submitted = 0.0
    assert encode_job(fast) == encode_job(slow)
    with pytest.raises(InvalidJob, match="exceeds the limit"):
        job_from_spec({"prompt_token_ids": list(range(300))}, "j", "p", 1000)
    with pytest.raises(InvalidJob, match="int32"):
        job_from_spec({"prompt_token_ids": [1, 2**31]}, "j", "p")
    with pytest.raises(InvalidJob, match="1-256"):
        job_from_spec({"prompt_token_ids": [1]}, "x" * 257, "p", tracked=True)
    with pytest.raises(InvalidJob, match="temperature"):
        job_from_spec({"prompt_token_ids": [1], "sampling": {"temperature": -1}}, "j", "p")
    with pytest.raises(InvalidJob):  # empty prompts take the general path, which refuses them
        job_from_spec({"prompt_token_ids": []}, "j", "p")


def _nested(depth: int) -> list:
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("depth", [985, 1000])
def test_deeply_nested_entries_are_protocol_errors_not_crashes(depth):
    """A 1 KB entry whose meta nests 1,000 levels used to raise RecursionError out of the
    decoder (and end the consumer); any decode failure must be a ProtocolError/InvalidJob."""
    import msgpack

    raw = msgpack.packb([SCHEMA_VERSION, "j", "p", "hi", None, None, {}, None, None, None, 0.0, _nested(depth)])
    with pytest.raises((ProtocolError, InvalidJob)):
        decode_job(raw)
    # Deeper than any encoder writes: one-element arrays, byte by byte.
    head = msgpack.packb([SCHEMA_VERSION, "j", "p", "hi", None, None, {}, None, None, None, 0.0, None])[:-1]
    with pytest.raises((ProtocolError, InvalidJob)):
        decode_job(head + b"\x91" * 100_000 + b"\x90")
    with pytest.raises(InvalidJob, match="nests deeper"):
        make_job(id="j", reply="p", prompt="hi", meta=_nested(depth))
    with pytest.raises(InvalidJob, match="nests deeper"):
        job_from_spec({"prompt_token_ids": [1, 2], "meta": _nested(depth)}, "j", "p")


def test_huge_ids_and_replies_are_refused_briefly():
    big = "x" * 40_000
    with pytest.raises(InvalidJob) as ei:
        decode_job(encode_job(Job(id=big, reply="p", text="hi")))
    assert len(str(ei.value)) < 300
    with pytest.raises(InvalidJob, match="impossible reply") as ei:
        decode_job(encode_job(Job(id="j", reply="r\n" + big, text="hi")))
    assert len(str(ei.value)) < 400
    # Nobody to tell for an invalid reply, and no 40 KB id handed on to logs.
    assert peek_id(encode_job(Job(id="j", reply="bad\n", text="hi"))) == (None, None)
    assert peek_id(encode_job(Job(id=big, reply="p", text="hi"))) == (None, "p")


def test_n_times_max_tokens_is_bounded_at_admission_and_at_decode():
    """n=1024, max_tokens=65535 with logprobs passed every check and made a ~537 MB result
    Redis refused; the product is bounded where jobs are built and where they are read."""
    with pytest.raises(InvalidJob, match="n x max_tokens"):
        SamplingParams.from_dict({"n": 1024, "max_tokens": 65535, "logprobs": 0})
    job = Job(id="j", reply="p", text="hi", sampling=SamplingParams(n=1024, max_tokens=65535))
    with pytest.raises(InvalidJob, match="n x max_tokens"):
        decode_job(encode_job(job))
    assert SamplingParams.from_dict({"n": 64, "max_tokens": 8192}).n == 64
