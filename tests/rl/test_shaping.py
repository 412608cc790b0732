"""Reward shaping (``LengthTask(shaping=Shaping(...))``) and the loop's seam for it: the loop
trains on ``training_rewards`` and reports the exact ``rewards``; the agreement forward at
older versions every k-th step only (``LoopConfig.agree_every``). No vLLM."""

from __future__ import annotations

import random

import pytest
import torch

from rollq.protocol import Result, Sample, pack_f32, pack_i32
from rollq.rl import BucketTask, GrpoConfig, GrpoTrainer, LoopConfig
from rollq.rl.grpo import StepStats
from rollq.rl.task import ShapedTask, training_rewards
from rollq.rl.tasks import LengthTask, Shaping


def test_partial_reward_credits_each_half_of_the_skill_on_its_own():
    t = LengthTask(vocab_size=1024)  # EOS ids 3 and 0; quarter 2 is ids 512..767
    assert t.partial_reward(2, 3, [512, 600, 700, 3]) == 1.0  # both halves right
    assert t.partial_reward(2, 3, [512, 600, 700, 701, 702]) == 0.5  # in quarter, never stopped
    assert t.partial_reward(2, 3, [10, 20, 30, 3]) == 0.5  # stopped after exactly L, out of quarter
    assert t.partial_reward(2, 3, [10, 20, 3]) == 0.25  # stopped one short: 1 / (1 + 1), halved
    assert t.partial_reward(2, 3, [512, 600, 700, 701, 702, 3]) == pytest.approx((1 + 1 / 3) / 2)  # two long
    assert t.partial_reward(2, 3, [512, 600, 700], "stop") == 1.0  # stopped by the engine without EOS
    assert t.partial_reward(2, 3, [3]) == pytest.approx(1 / 8)  # stopped at once: nothing in quarter
    assert t.partial_reward(2, 3, []) == 0.0


def test_partial_reward_is_in_0_1_and_is_1_exactly_where_the_exact_reward_is():
    t = LengthTask(vocab_size=64, min_length=1, max_length=3)  # a small vocabulary: stops are common
    rng = random.Random(0)
    seen_one = 0
    for _ in range(20000):
        q, L = rng.randrange(4), rng.randint(1, 3)
        toks: list[int] = []
        while len(toks) < t.max_length + 1:
            toks.append(rng.randrange(64))
            if toks[-1] in t.eos_ids:
                break
        p, r = t.partial_reward(q, L, toks), t.reward(q, L, toks)
        assert 0.0 <= p <= 1.0 and (p == 1.0) == (r == 1.0), (q, L, toks)
        assert p >= r / 2  # the exact reward's content is in the partial one
        seen_one += r == 1.0
    assert seen_one > 10


def test_shaping_schedule_holds_then_anneals_linearly_to_the_exact_reward():
    sh = Shaping(hold=10, anneal=20)
    assert [sh.weight(s) for s in (0, 9, 10, 15, 20, 30, 1000)] == [0.0, 0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
    assert Shaping(hold=5, anneal=0).weight(4) == 0.0 and Shaping(hold=5, anneal=0).weight(5) == 1.0
    with pytest.raises(ValueError, match="hold"):
        Shaping(hold=-1)
    with pytest.raises(ValueError, match="anneal"):
        Shaping(anneal=-1)


def test_shaping_floor_keeps_the_partial_credit_after_the_anneal():
    sh = Shaping(hold=10, anneal=20, floor=0.25)
    assert [sh.weight(s) for s in (0, 10, 20, 25, 30, 1000)] == [0.0, 0.0, 0.5, 0.75, 0.75, 0.75]
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="floor"):
            Shaping(floor=bad)
    samples = [[512, 600, 700, 3], [512, 600, 3], [512, 3], [512, 600, 700, 701, 702]]
    task = LengthTask(vocab_size=1024, shaping=sh)
    r = _result(2, 3, samples)
    assert task.rewards(r) == [1.0, 0.0, 0.0, 0.0]  # the reported reward stays exact
    late = task.training_rewards(r, 1000)  # 0.75 * exact + 0.25 * partial, for good
    assert late == pytest.approx([1.0, 0.25 * 0.75, 0.25 * (1 + 1 / 3) / 2, 0.25 * 0.5])
    assert late[1] > late[2] > 0.0  # a near miss of the length beats a farther one: a gradient left


def _result(quarter, length, samples):
    return Result(id="j", meta={"quarter": quarter, "length": length},
                  samples=[Sample(tokens=pack_i32(s)) for s in samples])


def test_training_rewards_follow_the_schedule_and_rewards_stay_exact():
    samples = [[512, 600, 700, 3], [512, 600, 3], [10, 20, 30, 3], [512, 600, 700, 701, 702]]
    exact = [1.0, 0.0, 0.0, 0.0]
    partial = [1.0, 0.75, 0.5, 0.5]  # (in-quarter fraction + 1 / (1 + |n - L|) if it stopped) / 2
    plain, shaped = LengthTask(vocab_size=1024), LengthTask(vocab_size=1024, shaping=Shaping(hold=2, anneal=4))
    r = _result(2, 3, samples)
    assert plain.rewards(r) == shaped.rewards(r) == exact  # shaping never touches the reported reward
    assert plain.training_rewards(r, 0) == exact  # without shaping: the exact reward at every step
    assert shaped.training_rewards(r, 0) == pytest.approx(partial)
    assert shaped.training_rewards(r, 1) == pytest.approx(partial)  # still held
    assert shaped.training_rewards(r, 4) == pytest.approx([(e + p) / 2 for e, p in zip(exact, partial)])
    assert shaped.training_rewards(r, 6) == shaped.training_rewards(r, 600) == exact


def test_the_seam_passes_exact_rewards_through_unless_the_task_shapes_them():
    exact = [[0.5, 0.25]]
    assert training_rewards(BucketTask(), ["r"], 3, exact) is exact  # no training_rewards: unchanged
    assert not isinstance(BucketTask(), ShapedTask) and isinstance(LengthTask(), ShapedTask)
    r = _result(2, 3, [[10, 20, 30, 3]])
    task = LengthTask(vocab_size=1024, shaping=Shaping(hold=1))
    assert training_rewards(task, [r], 0, [task.rewards(r)]) == [[0.5]]
    assert training_rewards(task, [r], 1, [task.rewards(r)]) == [[0.0]]


# ----------------------------------------------------------------------------------------
# Through the loop (echo replicas, a recording trainer)
# ----------------------------------------------------------------------------------------
class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class _RecordingTrainer:
    """Takes the loop's steps without a model: records the rewards and the agreement flag."""

    def __init__(self):
        self.version, self.calls = 0, []

    def step(self, batch, rewards, *, agreement=True):
        self.calls.append(([list(r) for r in rewards], agreement))
        self.version += 1
        return StepStats(version=self.version - 1, reward_mean=0.0, loss=0.0, clip_frac=0.0, lags=[])

    def advance(self):
        self.version += 1


async def test_the_loop_trains_on_shaped_rewards_and_reports_the_exact_ones(redis_url, queue):
    """Echo samples never stop (every one is cut at max_tokens) and repeat the prompt's digits,
    ids 48..57, all in quarter 0: the exact reward is 0 everywhere, the partial one 0.5 for
    the groups whose quarter is 0. The report says 0; the trainer got the partial rewards while
    the schedule held them, and the exact ones after; the agreement flag every 2nd step."""
    from rollq.rl import Replicas, run_loop

    task = LengthTask(vocab_size=1024, shaping=Shaping(hold=2, anneal=0))
    trainer = _RecordingTrainer()
    config = LoopConfig(steps=4, groups_per_step=8, group_size=2, seed=0, result_timeout=30, publish=False, agree_every=2)
    async with Replicas(redis_url, queue, weights_root=None, count=1, engine="echo"):
        report = await run_loop(redis_url, queue, trainer, task, _Tok(), None, config)
    s = report.summary()
    assert s["steps"] == 4 and s["failed_jobs"] == 0 and s["agree_every"] == 2
    assert s["reward_by_step"] == [0.0] * 4 and s["reward_last"] == 0.0
    assert [a for _, a in trainer.calls] == [True, False, True, False]
    held = [x for rw, _ in trainer.calls[:2] for r in rw for x in r]
    assert set(held) == {0.0, 0.5} and all(x == 0.0 for rw, _ in trainer.calls[2:] for r in rw for x in r)


def test_agree_every_is_validated():
    assert LoopConfig().agree_every == 1
    with pytest.raises(ValueError, match="agree_every"):
        LoopConfig(agree_every=0)


def test_trainer_step_without_agreement_makes_the_same_update_and_skips_only_the_older_forward(tiny_model_path):
    """Two trainers from the same weights take two steps on the same batch (the second at lag
    1): with ``agreement=False`` on the second step the weights are equal, and only the
    one-version-old groups' agreement (the extra forward) is missing."""
    torch.set_num_threads(1)
    a, b = (GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=5e-3), seed=0) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    batch, rewards = [], []
    for g in range(2):
        prompt = [20 + g] * 6
        ids = torch.tensor([prompt] * 4)
        with torch.no_grad():
            for _ in range(3):
                lp = torch.log_softmax(a.model(input_ids=ids).logits[:, -1].float(), -1)
                ids = torch.cat([ids, torch.multinomial(lp.exp(), 1, generator=gen)], 1)
            lps = torch.log_softmax(a.model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float(), -1)
            lps = lps.gather(-1, ids[:, len(prompt) :, None])[..., 0]
        samples = [Sample(tokens=pack_i32(ids[i, len(prompt) :].tolist()), logprobs=pack_f32(lps[i].tolist())) for i in range(4)]
        batch.append((prompt, Result(id=f"j{g}", samples=samples, version_start=0, version_end=0)))
        rewards.append([0.0, 1.0, 0.5, 0.25])
    for t in (a, b):
        t.step(batch, rewards)
    on, off = a.step(batch, rewards), b.step(batch, rewards, agreement=False)
    assert on.lags == off.lags == [1, 1] and on.loss == pytest.approx(off.loss)
    assert on.diff_tokens == 24 and on.diff_max < 1e-4 and on.agree_s > 0
    assert off.diff_tokens == 0 and off.agree_s == 0.0
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
