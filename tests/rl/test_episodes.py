"""Multi-turn episodes: their assembly from one result per turn, the two-turn task, and the
trainer's step on whole episodes (pure Python and torch; the queue and vLLM run in
tests/rl/test_harder_tasks.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rollq.protocol import LogprobSource, Result, Sample, SamplingParams, pack_f32, pack_i32
from rollq.rl import NOT_GENERATED, GrpoConfig, GrpoTrainer, SamplingTransformError, Turn, assemble_episode
from rollq.rl.tasks import TwoTurnTask, make_task


def _result(job, tokens, logprobs, version, end=None, versions=None, source=None):
    s = Sample(tokens=pack_i32(tokens), logprobs=pack_f32(logprobs), versions=versions, lp_source=source)
    return Result(id=job, samples=[s], version_start=version, version_end=version if end is None else end, replica="r0")


def test_episode_token_ids_are_the_concatenation_and_the_mask_marks_the_completions():
    prompt, c1, env, c2 = [1, 2, 3], [500, 501], [40, 40], [600, 601]
    t1 = _result("a", c1, [-1.0, -2.0], 5)
    t2 = _result("b", c2, [-0.25, -0.5], 5)
    ep = assemble_episode(prompt, [Turn(t1, observation=env), Turn(t2)])
    assert ep.token_ids == prompt + c1 + env + c2
    assert ep.loss_mask == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2
    assert ep.completion(0) == c1 and ep.completion(1) == c2 and ep.observation(0) == env and ep.observation(1) == []
    assert ep.prompt_len == 3 and [(s.start, s.end, s.job_id) for s in ep.turns] == [(3, 5, "a"), (7, 9, "b")]
    model = [x for x, m in zip(ep.logprobs, ep.loss_mask) if m]
    assert model == [-1.0, -2.0, -0.25, -0.5]
    assert all(math.isnan(x) for x, m in zip(ep.logprobs, ep.loss_mask) if not m)
    assert ep.versions_used == [5] and ep.single_version == 5 and ep.swap_tokens == 0 and ep.version_start == 5


def test_an_episode_of_two_versions_reports_both_and_keeps_every_tokens_version():
    # Turn 1 at version 3; version 4 swapped in before turn 2's job started.
    ep = assemble_episode([9], [Turn(_result("a", [10, 11], [-1.0, -1.0], 3), observation=[7]),
                                Turn(_result("b", [12, 13], [-1.0, -1.0], 4))])
    assert ep.versions == [NOT_GENERATED, 3, 3, NOT_GENERATED, 4, 4]
    assert ep.versions_used == [3, 4] and ep.single_version is None and ep.swap_tokens == 2
    assert [(s.version_start, s.version_end) for s in ep.turns] == [(3, 3), (4, 4)]
    # A swap inside turn 2 as well (update policy keep): per-token versions of the sample.
    t2 = _result("b", [12, 13, 14], [-1.0] * 3, 4, end=5, versions=[(4, 0), (5, 2)])
    ep = assemble_episode([9], [Turn(_result("a", [10], [-1.0], 3), observation=[7]), Turn(t2)])
    assert ep.versions == [NOT_GENERATED, 3, NOT_GENERATED, 4, 4, 5] and ep.versions_used == [3, 4, 5]


def test_episode_assembly_refuses_turns_without_logprobs_or_at_different_temperatures():
    bare = Result(id="a", samples=[Sample(tokens=pack_i32([1, 2]))])
    with pytest.raises(ValueError, match="per-token logprobs"):
        assemble_episode([9], [Turn(bare)])
    hot = LogprobSource.of(SamplingParams(temperature=0.7, ignore_eos=True), "processed")
    with pytest.raises(SamplingTransformError, match="temperature"):
        assemble_episode([9], [Turn(_result("a", [1], [-1.0], 0), observation=[7]),
                               Turn(_result("b", [2], [-1.0], 0, source=hot))])
    with pytest.raises(ValueError, match="at least one turn"):
        assemble_episode([9], [])


# ----------------------------------------------------------------------------------------
# The two-turn task
# ----------------------------------------------------------------------------------------
class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_two_turn_reward_needs_turn_1_the_recall_and_the_environment():
    t = TwoTurnTask(vocab_size=1024)
    assert t.env_digit([512, 601]) == 1
    assert t.reward(2, [512, 601], [700, 300]) == 1.0        # recall quarter 2; environment 1 -> quarter 1
    assert t.reward(2, [512, 601], [700, 700]) == pytest.approx(2 / 3)   # ignored the environment
    assert t.reward(2, [512, 601], [0, 300]) == pytest.approx(2 / 3)     # did not recall turn 1
    assert t.reward(2, [0, 601], [700, 300]) == pytest.approx(2.5 / 3)   # turn 1 half in quarter 2
    assert t.reward(1, [512, 601], [700, 300]) == pytest.approx(2 / 3)   # turn 1 in the wrong quarter
    assert t.reward(2, [512, 601], []) == pytest.approx(1 / 3) and t.reward(2, [], [1, 2]) == 0.0


def test_two_turn_random_and_shortcut_levels_are_what_the_docstring_says():
    t = TwoTurnTask(vocab_size=1024)
    assert t.random_policy_reward == 0.25
    rng = random.Random(0)
    n = 20000
    mean = sum(t.reward(rng.randrange(4), [rng.randrange(1024) for _ in range(2)], [rng.randrange(1024) for _ in range(2)])
               for _ in range(n)) / n
    assert mean == pytest.approx(0.25, abs=0.01)
    # Perfect turn 1 and recall, the environment ignored (turn 2's second token in the prompt's quarter).
    ignore_env = sum(t.reward(q, [q * 256 + rng.randrange(256) for _ in range(2)], [q * 256, q * 256])
                     for q in range(4) for _ in range(2000)) / 8000
    assert ignore_env == pytest.approx(0.75, abs=0.01)
    # Unequal ranges (3 in a 10-id vocabulary: 4, 3, 3 ids): the exact formula against every episode.
    odd = TwoTurnTask(vocab_size=10, quarters=3, turn1_length=1)
    every = [odd.reward(q, [a], [b, c]) for q in range(3) for a in range(10) for b in range(10) for c in range(10)]
    assert odd.random_policy_reward == pytest.approx(sum(every) / len(every)) and odd.random_policy_reward != 1 / 3


def test_two_turn_follow_up_holds_turn_1_and_the_environment_then_ends():
    t = TwoTurnTask(vocab_size=1024)
    (spec,) = t.job_specs(_Tok(), random.Random(1), 1, 8)
    q = spec["meta"]["quarter"]
    prompt = spec["prompt_token_ids"]
    assert prompt == [ord(str(q))] * 4 and spec["sampling"]["n"] == 8 and spec["sampling"]["max_tokens"] == 2
    first = Turn(_result("a", [300, 601], [-1.0, -1.0], 0))
    obs, spec2 = t.follow_up(_Tok(), prompt, [first])
    assert obs == [ord("1")] * 4 and spec2["prompt_token_ids"] == prompt + [300, 601] + obs
    assert spec2["sampling"]["n"] == 1 and spec2["sampling"]["max_tokens"] == 2 and spec2["meta"] == {"env": 1}
    assert t.follow_up(_Tok(), prompt, [first, Turn(_result("b", [1, 2], [-1.0, -1.0], 0))]) is None
    assert t.jobs_per_group(8) == 9 and isinstance(make_task("two_turn", 1024), TwoTurnTask)


# ----------------------------------------------------------------------------------------
# The trainer on whole episodes (the tiny Hugging Face model)
# ----------------------------------------------------------------------------------------
def _sample(model, prompt, length, gen):
    """One completion sampled from ``model`` itself with its logprobs (temperature 1)."""
    ids, lps = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(length):
            lp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            t = torch.multinomial(lp.exp(), 1, generator=gen)
            lps.append(float(lp[0, t]))
            ids = torch.cat([ids, t], 1)
    return ids[0, len(prompt):].tolist(), lps


def test_trainer_step_on_episodes_spanning_a_swap_counts_each_turn_at_its_version(tiny_model_path):
    """Turn 1 sampled at version v, turn 2 at v + 1 (a weight update between the turns): the
    trainer at v + 1 counts turn 2's tokens at lag 0 (they agree to float tolerance with its
    own logprobs) and turn 1's at lag 1; prompt and environment tokens count nowhere."""
    torch.set_num_threads(1)
    tr = GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=5e-3), seed=0)
    task, tok = TwoTurnTask(vocab_size=1024), _Tok()
    gen = torch.Generator().manual_seed(0)
    v = tr.version
    prompt = task.prompt_ids(tok, 2)
    firsts = [_sample(tr.model, prompt, 2, gen) for _ in range(4)]
    # Any update makes version v + 1 (here: one step on these first turns alone).
    tr.step([(prompt, Result(id="x", samples=[Sample(tokens=pack_i32(c), logprobs=pack_f32(lp)) for c, lp in firsts],
                             version_start=v, version_end=v))], [[0.0, 1.0, 0.0, 1.0]])
    episodes = []
    for c1, lp1 in firsts:
        t1 = Turn(_result("a", c1, lp1, v))
        obs, spec2 = task.follow_up(tok, prompt, [t1])
        c2, lp2 = _sample(tr.model, spec2["prompt_token_ids"], 2, gen)
        episodes.append(assemble_episode(prompt, [Turn(t1.result, observation=obs), Turn(_result("b", c2, lp2, v + 1))]))
    assert all(e.versions_used == [v, v + 1] for e in episodes)
    st = tr.step_episodes([episodes], [[0.0, 1.0, 1.0, 0.0]])
    assert st.version == v + 1 and st.lags == [1]
    assert st.diff_by_lag["0"][2] == 8 and st.diff_by_lag["0"][1] < 1e-4   # turn 2: 4 episodes x 2 tokens
    assert st.diff_by_lag["1"][2] == 8 and st.diff_by_lag["1"][0] / 8 > 1e-4  # turn 1, one version old
    assert st.diff_tokens == 0  # no episode is of one version: none for the single-version agreement
    # Episodes of one version (both turns at v + 2, the trainer's version now): agreement on every model token.
    v2 = tr.version
    same = []
    for _ in range(2):
        c1, lp1 = _sample(tr.model, prompt, 2, gen)
        t1 = Turn(_result("a", c1, lp1, v2))
        obs, spec2 = task.follow_up(tok, prompt, [t1])
        c2, lp2 = _sample(tr.model, spec2["prompt_token_ids"], 2, gen)
        same.append(assemble_episode(prompt, [Turn(t1.result, observation=obs), Turn(_result("b", c2, lp2, v2))]))
    st = tr.step_episodes([same], [[0.0, 1.0]])
    assert st.diff_tokens == 8 and st.diff_max < 1e-4 and list(st.diff_by_lag) == ["0"]
    with pytest.raises(ValueError, match="episodes for"):
        tr.step_episodes([same], [[0.0]])
