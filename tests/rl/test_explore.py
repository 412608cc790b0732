"""Per-prompt exploration (``rollq.rl.tasks.Exploration``): a prompt whose GRPO group all earn
one wrong reward is sampled hotter; the loop tells the task how each step's groups went
(``AdaptiveTask.observe``, with the exact rewards), and through vLLM the hotter jobs' logprobs stay the trainer's."""

from __future__ import annotations

import random

import pytest

from rollq.rl.task import AdaptiveTask, BucketTask, observe_groups
from rollq.rl.tasks import Exploration, LengthTask, Shaping


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class _Res:
    def __init__(self, q, n):
        self.meta = {"quarter": q, "length": n}


def test_a_collapsed_wrong_group_heats_its_prompt_up_to_the_cap():
    ex = Exploration(boost=1.25, max_temperature=1.8)
    temps = []
    for _ in range(4):
        ex.observe("p", [0.2] * 8)
        temps.append(ex.temperature("p"))
    assert temps == [1.25, 1.5625, 1.8, 1.8]
    assert ex.temperature("q") == 1.0 and ex.hot() == {"p": 1.8}


def test_spread_cools_a_prompt_and_a_solved_group_resets_it():
    ex = Exploration(boost=1.25, max_temperature=2.0)
    for _ in range(4):
        ex.observe("p", [0.0, 0.0])
    assert ex.temperature("p") == 2.0
    ex.observe("p", [0.0, 0.5])  # spread: the advantage is back, one step cooler
    assert ex.temperature("p") == 1.6
    ex.observe("p", [1.0, 1.0])  # every sample right: nothing to explore for
    assert ex.temperature("p") == 1.0 and ex.hot() == {}
    ex.observe("p", [0.0, 1.0])  # spread at 1 stays at 1
    assert ex.temperature("p") == 1.0
    ex.observe("p", [])  # an empty group says nothing
    assert ex.temperature("p") == 1.0


def test_exploration_refuses_settings_that_cannot_heat():
    with pytest.raises(ValueError, match="boost"):
        Exploration(boost=1.0)
    with pytest.raises(ValueError, match="max_temperature"):
        Exploration(max_temperature=0.5)
    # vLLM refuses a temperature above 2: a job sampled hotter would be dead-lettered.
    with pytest.raises(ValueError, match=r"max_temperature must be in \[1, 2.0\]"):
        Exploration(max_temperature=3.0)


def test_length_jobs_of_a_collapsed_prompt_are_sampled_hotter_and_the_final_evaluation_is_not():
    task = LengthTask(vocab_size=1024, exploration=Exploration(boost=1.5, max_temperature=2.0))
    assert isinstance(task, AdaptiveTask) and not isinstance(BucketTask(), AdaptiveTask)
    # (quarter 1, L 2) collapsed onto one wrong reward; (quarter 2, L 3) had spread.
    observe_groups(task, [_Res(1, 2), _Res(2, 3)], [[0.25] * 4, [0.0, 0.5, 0.0, 0.0]], 0)
    specs = task.job_specs(_Tok(), random.Random(0), 400, 4)
    temps = {(s["meta"]["quarter"], s["meta"]["length"]): s["sampling"]["temperature"] for s in specs}
    assert temps.pop((1, 2)) == 1.5 and set(temps.values()) == {1.0}
    assert {s["sampling"]["temperature"] for s in task.final_specs(_Tok(), 4)} == {1.0}
    # Without an Exploration the task is adaptive in form only: nothing changes.
    plain = LengthTask(vocab_size=1024)
    plain.observe([_Res(1, 2)], [[0.0] * 4], 0)
    assert {s["sampling"]["temperature"] for s in plain.job_specs(_Tok(), random.Random(0), 50, 4)} == {1.0}


def test_length_exploration_waits_for_the_end_of_the_shaping_hold():
    """In the hold the policy learns from partial credit alone and nearly every group's exact
    reward is 0: that is not a collapse, and nothing is heated."""
    task = LengthTask(vocab_size=1024, exploration=Exploration(boost=2.0), shaping=Shaping(hold=5, anneal=5))
    for step in range(5):
        task.observe([_Res(0, 4)], [[0.0] * 8], step)
    assert task.exploration.hot() == {}
    task.observe([_Res(0, 4)], [[0.0] * 8], 5)
    assert task.exploration.hot() == {(0, 4): 2.0}


def test_the_demo_turns_exploration_on_for_length_only():
    import argparse

    from rollq.demo import exploration, resolve

    a = resolve(argparse.Namespace(task="length", explore_max=1.7))
    assert exploration(a) is not None and exploration(a)["max_temperature"] == 1.7
    off = resolve(argparse.Namespace(task="length", explore_max=1.0))
    assert exploration(off) is None
    assert exploration(resolve(argparse.Namespace(task="bucket"))) is None


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_hot_length_jobs_through_vllm_keep_the_trainers_logprobs(
    vllm_engine_processed, tiny_model_path, redis_url, queue, tmp_path
):
    """The loop on the length task with an Exploration that heats every collapsed prompt at
    once (the untrained policy's exact reward is 0 on nearly every group): the replica serves
    those jobs at temperature 2 with the processed logprobs, and the trainer's logprobs at each
    sample's temperature agree with them as at temperature 1."""
    from tests.helpers.agreement import agreement_bounds
    from tests.rl.test_harder_tasks import _config, _run

    class _Seen(LengthTask):
        def observe(self, results, rewards, step):
            temps.extend(r.logprob_source.temperature for r in results)
            super().observe(results, rewards, step)

    temps: list[float] = []
    task = _Seen(vocab_size=1024, exploration=Exploration(boost=2.0, max_temperature=2.0))
    report, _ = await _run(vllm_engine_processed, tiny_model_path, redis_url, queue, tmp_path, task,
                           _config(6, 8), lr=5e-3)
    s = report.summary()
    assert s["failed_jobs"] == 0 and s["logprob_tokens_compared"] > 0
    assert 2.0 in temps and 1.0 in temps, temps  # the first jobs at 1, collapsed prompts' later ones at 2
    bound = agreement_bounds(vllm_engine_processed)
    assert s["logprob_abs_diff_mean"] <= bound.mean and s["logprob_abs_diff_max"] <= bound.max, s
