"""The submit fast path builds and encodes exactly what the general path does.

Sampling dicts are validated once per content (``protocol.validated_sampling``), and token
specs are built by one loop (``protocol.token_jobs``): neither may change a job's bytes or
let through a value ``SamplingParams.from_dict`` refuses.
"""

from __future__ import annotations

import enum

import msgspec
import pytest

from rollq.errors import InvalidJob
from rollq.producer.client import Producer
from rollq.protocol import SamplingParams, encode_job, validated_sampling


def test_equal_sampling_dicts_share_one_validated_object():
    a = validated_sampling({"max_tokens": 16, "temperature": 0.5, "stop": ["\n"]})
    b = validated_sampling({"max_tokens": 16, "temperature": 0.5, "stop": ["\n"]})
    assert a is b and a == SamplingParams.from_dict({"max_tokens": 16, "temperature": 0.5, "stop": ["\n"]})


class _Tokens(enum.IntEnum):
    SIXTEEN = 16


class _Plain(enum.Enum):
    SIXTEEN = 16


@pytest.mark.parametrize(
    "first, second",
    [
        ({"n": 1}, {"n": True}),  # True == 1, and refused
        ({"max_tokens": 16}, {"max_tokens": 16.0}),
        ({"max_tokens": 16}, {"max_tokens": _Plain.SIXTEEN}),  # encodes as 16, and refused
        ({"max_tokens": 16}, {"max_tokens": _Tokens.SIXTEEN}),
        ({"temperature": 0.0}, {"temperature": -0.0}),  # equal, encoded apart
        ({"stop": ["a"]}, {"stop": ("a",)}),
        ({"temperature": 1.0}, {"temperature": 1}),
        ({"seed": 1}, {"seed": 2**64}),
    ],
)
def test_a_memoised_dict_decides_nothing_for_a_dict_that_only_looks_equal(first, second):
    validated_sampling(first)  # now memoised
    try:
        expected: object = SamplingParams.from_dict(second)
    except InvalidJob as e:
        expected = e
    if isinstance(expected, InvalidJob):
        with pytest.raises(InvalidJob) as ei:
            validated_sampling(second)
        assert str(ei.value) == str(expected)
    else:
        got = validated_sampling(second)
        # The encodings tell -0.0 from 0.0, which == does not.
        assert got == expected and msgspec.msgpack.encode(got) == msgspec.msgpack.encode(expected)


def test_a_dict_changed_after_use_is_validated_again():
    d = {"max_tokens": 4}
    assert validated_sampling(d).max_tokens == 4
    d["max_tokens"] = 0
    with pytest.raises(InvalidJob, match="max_tokens"):
        validated_sampling(d)


def test_build_jobs_of_sampling_dicts_matches_build_job():
    specs = [
        {"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 2, "n": 4}},
        {"prompt_token_ids": [3], "sampling": {"max_tokens": 2, "n": 4}, "meta": {"i": 1}},
        {"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2, "n": 4}},
        {"prompt": "text", "sampling": {"max_tokens": 2, "n": 4}, "id": "mine"},
        {"prompt_token_ids": [4], "sampling": {"max_tokens": 2, "n": 4}, "replica": "r1"},
    ]
    p = Producer("redis://127.0.0.1:1/0", "q", producer_id="same")
    q = Producer("redis://127.0.0.1:1/0", "q", producer_id="same")
    fast = [msgspec.structs.replace(j, submitted=0.0) for j in p.build_jobs(specs)]
    slow = [msgspec.structs.replace(q.build_job(s), submitted=0.0) for s in specs]
    assert fast == slow
    assert list(map(encode_job, fast)) == list(map(encode_job, slow))
