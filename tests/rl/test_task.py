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


# ----------------------------------------------------------------------------------------
# The harder tasks (rollq/rl/tasks)
# ----------------------------------------------------------------------------------------
from rollq.rl.tasks import LengthTask, PositionalTask, make_task  # noqa: E402


def test_positional_reward_is_a_quarter_per_output_in_its_digits_quarter():
    t = PositionalTask(vocab_size=1024)
    assert t.reward("0123", [0, 256, 512, 768]) == 1.0
    assert t.reward("0123", [256, 512, 768, 0]) == 0.0
    assert t.reward("0123", [255, 511, 767, 1023]) == 1.0
    assert t.reward("0123", [0, 0, 0, 0]) == 0.25
    assert t.reward("3333", [768, 800, 0, 1023]) == 0.75
    assert t.reward("2031", [512, 0]) == 0.5  # missing outputs earn nothing
    assert t.reward("2031", [512, 0, 768, 256, 5, 6]) == 1.0  # extra outputs neither


def test_positional_shortcut_and_random_levels_are_what_the_issue_says():
    t = PositionalTask(vocab_size=1024)
    every = t.train_strings + t.heldout_strings
    assert len(every) == 256 and t.random_policy_reward == 0.25
    follow_last = sum(t.reward(s, [int(s[-1]) * 256] * 4) for s in every) / 256
    assert follow_last == 0.4375
    perfect = sum(t.reward(s, [int(c) * 256 + 7 for c in s]) for s in every) / 256
    assert perfect == 1.0


def test_positional_heldout_split_is_fixed_disjoint_and_covers_every_digit_at_every_position():
    t = PositionalTask(vocab_size=1024)
    assert len(t.heldout_strings) == 32 and not set(t.heldout_strings) & set(t.train_strings)
    assert t.heldout_strings == PositionalTask(vocab_size=4096).heldout_strings
    for j in range(4):
        assert {s[j] for s in t.train_strings} == set("0123")
    specs = t.job_specs(_Tok(), random.Random(0), 2000, 8)
    assert {s["meta"]["digits"] for s in specs} <= set(t.train_strings)
    assert len({s["meta"]["digits"] for s in specs}) == 224
    held = t.heldout_specs(_Tok(), 4)
    assert [s["meta"]["digits"] for s in held] == list(t.heldout_strings)


def test_positional_jobs_carry_their_digits_and_sample_fixed_length_groups():
    t = PositionalTask(vocab_size=1024, repeat=2)
    (s,) = t.job_specs(_Tok(), random.Random(3), 1, 8)
    d = s["meta"]["digits"]
    assert s["prompt_token_ids"] == [ord(c) for c in d for _ in range(2)]
    sp = s["sampling"]
    assert sp["n"] == 8 and sp["max_tokens"] == 4 and sp["ignore_eos"] and sp["temperature"] == 1.0
    r = Result(id="j", meta={"digits": "2031"}, samples=[Sample(tokens=pack_i32([512, 0, 768, 0]))])
    assert t.rewards(r) == [0.75] and t.prompt_of(_Tok(), r) == [ord(c) for c in "22003311"]


def test_length_reward_needs_the_stop_right_after_exactly_L_tokens():
    t = LengthTask(vocab_size=1024)  # EOS ids 3 and 0
    assert t.reward(2, 3, [512, 600, 700, 3]) == 1.0
    assert t.reward(2, 3, [512, 600, 700, 0]) == 1.0
    assert t.reward(2, 3, [512, 600, 3]) == 0.0  # one short
    assert t.reward(2, 3, [512, 600, 700, 701, 3]) == 0.0  # one long
    assert t.reward(2, 3, [512, 600, 700, 701]) == 0.0  # never stopped
    assert t.reward(2, 3, [512, 600, 700]) == 0.0  # cut at max_tokens without EOS: not stopped
    assert t.reward(2, 3, [512, 600, 700], "stop") == 1.0  # stopped by the engine without an EOS token
    assert t.reward(1, 4, [256, 0, 511, 1023, 3]) == 0.0  # the 0 is an EOS: content of 1 token
    assert t.reward(1, 4, [256, 5, 511, 1023, 3]) == 0.5
    assert t.reward(0, 2, [3]) == 0.0


def test_length_random_policy_reward_matches_uniform_sampling():
    t = LengthTask(vocab_size=64, min_length=1, max_length=3)  # a small vocabulary: stops are common
    rng = random.Random(0)
    total, n = 0.0, 40000
    for _ in range(n):
        q, L = rng.randrange(4), rng.randint(1, 3)
        toks = []
        while len(toks) < t.max_length + 1:
            toks.append(rng.randrange(64))
            if toks[-1] in t.eos_ids:
                break
        total += t.reward(q, L, toks)
    assert total / n == pytest.approx(t.random_policy_reward, abs=0.004)
    assert LengthTask(vocab_size=1024).random_policy_reward < 0.001


def test_length_jobs_stop_at_eos_and_carry_quarter_and_length():
    t = LengthTask(vocab_size=1024)
    specs = t.job_specs(_Tok(), random.Random(0), 500, 8)
    assert {s["meta"]["length"] for s in specs} == set(range(2, 9))
    assert {s["meta"]["quarter"] for s in specs} == {0, 1, 2, 3}
    s = specs[0]
    q, L = s["meta"]["quarter"], s["meta"]["length"]
    assert s["prompt_token_ids"] == [ord(str(q))] * 4 + [ord(str(L))] * 4
    assert s["sampling"]["ignore_eos"] is False and s["sampling"]["max_tokens"] == 9
    r = Result(id="j", meta={"quarter": 1, "length": 2},
               samples=[Sample(tokens=pack_i32([300, 301, 3])), Sample(tokens=pack_i32([300, 301, 302, 3])),
                        Sample(tokens=pack_i32([300, 1000]), finish_reason="stop")])
    assert t.rewards(r) == [1.0, 0.0, 0.5]


def test_length_final_evaluation_covers_every_prompt_and_says_where_samples_stopped():
    t = LengthTask(vocab_size=1024)
    specs = t.final_specs(_Tok(), 3)
    assert sorted((s["meta"]["quarter"], s["meta"]["length"]) for s in specs) == [
        (q, n) for q in range(4) for n in range(2, 9)]
    assert all(s["sampling"]["n"] == 3 for s in specs)
    good = Result(id="a", meta={"quarter": 1, "length": 2},
                  samples=[Sample(tokens=pack_i32([300, 301, 3])), Sample(tokens=pack_i32([300, 301, 302, 3])),
                           Sample(tokens=pack_i32([300] * 9), finish_reason="length")])
    other = Result(id="b", meta={"quarter": 0, "length": 5},
                   samples=[Sample(tokens=pack_i32([10, 11, 12, 13, 900, 3]))])
    rep = t.final_report([good, other])
    assert rep["final_by_length"] == {
        "2": {"reward": round(1 / 3, 4), "stopped": {"2": round(1 / 3, 4), "3": round(1 / 3, 4), "none": round(1 / 3, 4)}},
        "5": {"reward": 0.8, "stopped": {"5": 1.0}},
    }
    assert rep["reward_final"] == round((1.0 + 0.8) / 4, 4)


def test_tasks_by_name_and_bad_shapes_are_refused():
    assert isinstance(make_task("bucket", 1024), BucketTask)
    assert make_task("length", 2048).vocab_size == 2048
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope", 1024)
    with pytest.raises(ValueError):
        PositionalTask(quarters=11)
    with pytest.raises(ValueError):
        LengthTask(max_length=10)
