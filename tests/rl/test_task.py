"""The toy task and its reward (pure Python, fast)."""

from __future__ import annotations

import random

import pytest

from rollq.protocol import Result, Sample, pack_i32
from rollq.rl import BucketTask


def test_buckets_are_equal_contiguous_ranges():
    t = BucketTask(vocab_size=1024, buckets=4)
    assert [t.bucket_of(i) for i in (0, 255, 256, 511, 512, 767, 768, 1023)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_reward_is_the_fraction_in_the_named_bucket_and_stays_in_0_1():
    t = BucketTask()
    assert t.reward(2, [512, 600, 767, 768]) == 0.75
    assert t.reward(0, [0, 1, 2, 3]) == 1.0
    assert t.reward(3, [0, 1, 2, 3]) == 0.0
    assert t.reward(1, []) == 0.0
    rng = random.Random(0)
    for _ in range(200):
        r = t.reward(rng.randrange(4), [rng.randrange(1024) for _ in range(4)])
        assert 0.0 <= r <= 1.0


def test_random_policy_reward_is_one_over_buckets_and_matches_uniform_sampling():
    t = BucketTask()
    assert t.random_policy_reward == 0.25
    rng = random.Random(1)
    mean = sum(t.reward(rng.randrange(4), [rng.randrange(1024) for _ in range(4)]) for _ in range(20000)) / 20000
    assert mean == pytest.approx(0.25, abs=0.01)


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_job_specs_carry_the_bucket_and_sample_groups_at_temperature_1_with_logprobs():
    t = BucketTask()
    specs = t.job_specs(_Tok(), random.Random(0), 32, 8)
    assert len(specs) == 32 and {s["meta"]["bucket"] for s in specs} == {0, 1, 2, 3}
    for s in specs:
        assert s["prompt_token_ids"] == [ord(str(s["meta"]["bucket"]))] * t.repeat
        sp = s["sampling"]
        assert sp["n"] == 8 and sp["temperature"] == 1.0 and sp["logprobs"] == 0
        assert sp["ignore_eos"] and sp["max_tokens"] == t.length


def test_rewards_of_a_result_come_from_its_meta_and_samples():
    t = BucketTask()
    r = Result(id="j", meta={"bucket": 1}, samples=[Sample(tokens=pack_i32([256, 300, 0, 1])), Sample(tokens=pack_i32([1, 2, 3, 4]))])
    assert t.rewards(r) == [0.5, 0.0]


def test_bad_task_shapes_are_refused():
    with pytest.raises(ValueError):
        BucketTask(buckets=1)
