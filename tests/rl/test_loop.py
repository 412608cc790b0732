"""LoopReport's off-policy figures from step records (no queue, no engine)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollq.rl import LoopConfig, LoopReport, StepRecord


def _step(i, tokens, swaps, by_lag, clip):
    return StepRecord(step=i, version=i, reward=0.25, lags=[0], wait_s=0.0, train_s=0.0, publish_s=0.0,
                      elapsed_s=float(i), tokens=tokens, swap_tokens=swaps, diff_by_lag=by_lag, clip_frac=clip)


def test_summary_reports_swaps_agreement_by_lag_and_clip():
    steps = [
        _step(0, 100, 0, {"0": [1e-5, 1e-6, 100]}, 0.0),
        _step(1, 300, 30, {"0": [2e-5, 3e-6, 100], "1": [20.0, 0.9, 100], "2+": [60.0, 2.0, 100]}, 0.2),
    ]
    s = LoopReport(config=LoopConfig(steps=2, publish=False), steps=steps, wall_s=1.0, random_policy_reward=0.25).summary()
    assert s["publish"] is False
    assert s["swap_tokens"] == 30 and s["swap_token_share"] == pytest.approx(30 / 400)
    by = s["logprob_abs_diff_by_lag"]
    assert list(by) == ["0", "1", "2+"]
    assert by["0"] == {"mean": pytest.approx(3e-5 / 200), "max": 3e-6, "tokens": 200}
    assert by["1"]["mean"] == pytest.approx(0.2) and by["2+"] == {"mean": pytest.approx(0.6), "max": 2.0, "tokens": 100}
    assert s["clip_frac_mean"] == pytest.approx(0.1)


def test_summary_reports_steps_and_seconds_to_reward_and_the_agreement_time_apart():
    rewards = [0.2, 0.5, 0.9, 0.9, 1.0, 0.2]
    steps = [StepRecord(step=i, version=i, reward=r, lags=[0], wait_s=0.1, train_s=0.3, publish_s=0.0, elapsed_s=2.0 * (i + 1), tokens=10,
                        agree_s=0.1, diff_by_confidence={"p<0.5": [0.5, 0.2, 10]}) for i, r in enumerate(rewards)]
    rep = LoopReport(config=LoopConfig(steps=6), steps=steps, wall_s=12.0, random_policy_reward=0.25)
    s = rep.summary()
    # trailing mean of 3: (0.9 + 0.9 + 1.0) / 3 at the fifth step; (0.5 + 0.9 + 0.9) / 3 < 0.8 before
    assert s["steps_to_reward_0.8"] == 5 and s["time_to_reward_0.8_s"] == 10.0
    assert s["seconds_per_step"] == 2.0
    assert s["step_train_s"] == pytest.approx(1.8) and s["step_agree_s"] == pytest.approx(0.6)
    assert s["logprob_abs_diff_by_confidence"] == {"p<0.5": {"mean": pytest.approx(0.05), "max": 0.2, "tokens": 60}}
    assert rep.steps_to_reward(0.99) is None and rep.time_to_reward(0.99) is None



# ----------------------------------------------------------------------------------------
# A multi-turn task through the loop's plumbing (echo replicas, no trainer)
# ----------------------------------------------------------------------------------------
class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_an_unknown_update_policy_is_refused():
    with pytest.raises(ValueError, match="update_policy"):
        LoopConfig(update_policy="restart")


async def test_the_loop_sets_its_update_policy_on_the_queue(redis_url, redis_client, queue):
    """The replicas read the queue's policy at each update: a run configured with ``abort``
    leaves ``abort`` there (and one with the default, ``keep``)."""
    from rollq.keys import QueueKeys
    from rollq.rl import BucketTask, Replicas, run_loop

    for policy in ("abort", "keep"):
        config = LoopConfig(steps=1, groups_per_step=2, group_size=2, seed=0, result_timeout=30, update_policy=policy)
        async with Replicas(redis_url, queue, weights_root=None, count=1, engine="echo"):
            await run_loop(redis_url, queue, None, BucketTask(vocab_size=1024, length=2), _Tok(), None, config)
        assert (await redis_client.hget(QueueKeys(queue).config, "update_policy")) in (policy, policy.encode())


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_the_loop_plays_two_turn_episodes_one_job_per_turn(redis_url, queue, mode):
    """Every step gets its groups whole: 4 groups of 3 episodes, each of two turns (one job for
    a group's first turns, one per episode for its second), 4 model tokens per episode."""
    from rollq.rl import Replicas, run_loop
    from rollq.rl.tasks import TwoTurnTask

    task = TwoTurnTask(vocab_size=1024)
    config = LoopConfig(steps=3, groups_per_step=4, group_size=3, mode=mode, seed=0, result_timeout=30)
    async with Replicas(redis_url, queue, weights_root=None, count=2, engine="echo"):
        report = await run_loop(redis_url, queue, None, task, _Tok(), None, config)
    s = report.summary()
    assert s["steps"] == 3 and s["failed_jobs"] == 0
    assert all(st.tokens == 4 * 3 * 4 and len(st.lags) == 4 for st in report.steps)
    assert len(report.jobs) == 3 * 4 * (1 + 3)  # every turn's job, with its replica and times
    assert all(0.0 <= st.reward <= 1.0 for st in report.steps)


class _Trainer:
    """Stands for GrpoTrainer: records the order of its steps and its ``before_update`` calls."""

    def __init__(self, events: list[str]):
        self.version, self.events = 1, events

    def step(self, batch, rewards, *, agreement=True, before_update=None):
        from rollq.rl.grpo import StepStats

        self.events.append("backward")
        if before_update is not None:
            before_update()
        self.events.append(f"optimizer step {self.version}")
        self.version += 1
        return StepStats(version=self.version - 1, reward_mean=0.0, loss=0.0, clip_frac=0.0, lags=[0])

    def advance(self):
        self.version += 1

    def state_dict(self):
        return {}


class _LeasingPublisher:
    """Stands for WeightPublisher(ipc_lease=True): records publishes and releases."""

    def __init__(self, events: list[str], lease: bool):
        self.events, self.ipc_lease = events, lease

    async def publish_weights(self, state, version=None, transport="memmap"):
        self.events.append(f"publish {version}")

    async def release_weights(self, timeout=30.0):
        await asyncio.sleep(0.01)  # on the loop's thread, while the trainer's thread waits
        self.events.append("release")
        return {}


@pytest.mark.parametrize("lease", [True, False])
async def test_a_leasing_publishers_version_is_released_before_each_optimizer_step(redis_url, queue, lease):
    """With ``WeightPublisher(ipc_lease=True)`` the trainer's thread waits, after its backward
    pass and before its optimizer changes the weights in place, for the publisher to release the
    version it last published (once the replicas copied it); without a lease it does not wait."""
    from rollq.rl import BucketTask, Replicas, run_loop

    events: list[str] = []
    # max_lag 10: no job waits for a version (the echo replicas follow none)
    config = LoopConfig(steps=3, groups_per_step=2, group_size=2, seed=0, result_timeout=30, transport="ipc", max_lag=10)
    async with Replicas(redis_url, queue, weights_root=None, count=1, engine="echo"):
        await run_loop(redis_url, queue, _Trainer(events), BucketTask(vocab_size=1024, length=2), _Tok(),
                       _LeasingPublisher(events, lease), config)
    per_step = ["backward", "release"] if lease else ["backward"]
    assert events == [e for v in (1, 2, 3) for e in (*per_step, f"optimizer step {v}", f"publish {v + 1}")], events


class _BurningPublisher(_LeasingPublisher):
    """A leasing publisher whose release takes 0.1 s of its thread's CPU time, on the event loop
    while the trainer's thread waits for it."""

    async def release_weights(self, timeout=30.0):
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        return {}


async def test_the_event_loops_cpu_time_while_a_step_trains_is_recorded(redis_url, queue):
    """Each step records the CPU time the event loop's thread took while the step trained in its
    thread (what the step's operators wait behind for the interpreter lock): here at least the
    0.1 s the publisher's release burns there during every step; the summary gives its share of
    the training time."""
    from rollq.rl import BucketTask, Replicas, run_loop

    config = LoopConfig(steps=3, groups_per_step=2, group_size=2, seed=0, result_timeout=30, transport="ipc", max_lag=10)
    async with Replicas(redis_url, queue, weights_root=None, count=1, engine="echo"):
        report = await run_loop(redis_url, queue, _Trainer([]), BucketTask(vocab_size=1024, length=2), _Tok(),
                                _BurningPublisher([], True), config)
    assert all(s.loop_cpu_s >= 0.1 for s in report.steps), [s.loop_cpu_s for s in report.steps]
    share = report.summary()["train_loop_cpu_share"]
    assert share == round(sum(s.loop_cpu_s for s in report.steps) / sum(s.train_s for s in report.steps), 4)
    assert 0 < share <= 1.0
