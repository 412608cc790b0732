"""Short forms of ``rollq demo --task positional`` and ``--task length``: GRPO through the
queue and one real vLLM replica (the session engine's 2-layer tiny model), fixed seed, a
clear rise (no timed assertions).

The full runs, and what they reach, are in benchmarks/README.md ("Harder tasks").
"""

from __future__ import annotations

import pytest
import torch

from rollq.demo import heldout_reward
from rollq.rl import GrpoConfig, GrpoTrainer, LoopConfig, Replicas, run_loop
from rollq.rl.tasks import LengthTask, PositionalTask
from rollq.weightsync import WeightPublisher
from tests.helpers.agreement import agreement_bounds

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


class _OneEngine(Replicas):
    """Replicas around the session engine (started and stopped by its fixture)."""

    def __init__(self, engine, url, queue, root):
        super().__init__(url, queue, weights_root=root, count=1, reconcile_interval=0.5)
        self.engines = [engine]


async def _run(engine, model_path, url, queue, tmp_path, task, config, lr, *, heldout=False):
    """Train the session engine's model on ``task`` from its own published weights; with
    ``heldout`` also score the held-out prompts at the final version. Leaves the engine on
    its starting weights. Returns the report and the held-out reward (or None)."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    trainer = GrpoTrainer.from_pretrained(str(model_path), GrpoConfig(lr=lr), seed=0)
    base = {k: v.clone() for k, v in trainer.state_dict().items()}
    replicas = _OneEngine(engine, url, queue, str(tmp_path / "w"))
    await replicas.attach(queue)
    pub = WeightPublisher(url, queue, root=str(tmp_path / "w"), keep=4)
    held = None
    try:
        rec = await pub.publish_weights(trainer.state_dict())
        trainer.rebase(rec.version)
        await replicas.wait_version(rec.version)
        report = await run_loop(url, queue, trainer, task, tokenizer, pub, config)
        if heldout:
            held = await heldout_reward(url, queue, task, tokenizer, config.group_size, trainer.version)
        rec = await pub.publish_weights(base)  # leave the shared engine as found
        await replicas.wait_version(rec.version)
    finally:
        await replicas.detach()
        await pub.close()
    return report, held


def _mean(xs):
    return sum(xs) / len(xs)


def _config(steps, group_size):
    return LoopConfig(steps=steps, groups_per_step=16, group_size=group_size, mode="async", max_lag=1, seed=0,
                      result_timeout=120)


async def test_positional_task_rises_past_random_and_is_scored_on_held_out_strings(
    vllm_engine, tiny_model_path, redis_url, queue, tmp_path
):
    """Output j must follow prompt digit j. 100 steps at lr 2e-3: the reward rises clearly
    off the random 0.25, and the held-out digit strings (never trained on) are scored by the
    replica at the final version, as ``rollq demo --task positional`` does."""
    task = PositionalTask(vocab_size=1024)
    report, held = await _run(vllm_engine, tiny_model_path, redis_url, queue, tmp_path, task, _config(100, 8),
                              lr=2e-3, heldout=True)
    r = report.reward_by_step()
    s = report.summary()
    assert all(0.0 <= x <= 1.0 for x in r)
    assert abs(_mean(r[:10]) - task.random_policy_reward) < 0.05, r
    assert _mean(r[-10:]) > _mean(r[:10]) + 0.06, r
    assert held is not None and held > task.random_policy_reward + 0.03, (held, r[-10:])
    assert s["failed_jobs"] == 0 and s["logprob_abs_diff_mean"] <= agreement_bounds(vllm_engine).mean, s


async def test_length_task_learns_to_stop_after_L_tokens_through_vllm(vllm_engine, tiny_model_path, redis_url, queue, tmp_path):
    """EOS on: completions of every length, padded and masked on the trainer. A uniform
    policy almost never stops after exactly L (reward ~5e-4); within 40 steps the policy
    learns to stop and the reward rises clearly off zero (a demo run: steps 0-4 0.0004,
    steps 30-39 0.021)."""
    task = LengthTask(vocab_size=1024)
    report, _ = await _run(vllm_engine, tiny_model_path, redis_url, queue, tmp_path, task, _config(40, 16), lr=5e-3)
    r = report.reward_by_step()
    s = report.summary()
    assert all(0.0 <= x <= 1.0 for x in r)
    assert _mean(r[:5]) < 0.005, r
    assert _mean(r[-10:]) > _mean(r[:5]) + 0.008, r
    # Variable lengths: EOS stops most samples before max_tokens (9) on the last steps.
    per_sample = sum(st.tokens for st in report.steps[-5:]) / (5 * 16 * 16)
    assert per_sample < task.max_length, per_sample
    assert s["failed_jobs"] == 0 and s["logprob_tokens_compared"] > 0
    assert s["logprob_abs_diff_mean"] <= agreement_bounds(vllm_engine).mean, s
