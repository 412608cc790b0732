"""Advantages, the clipped loss, logprob recomputation and the trainer step (pure torch)."""

from __future__ import annotations

import math

import json

import pytest
import torch

from rollq.protocol import LogprobSource, Result, Sample, SamplingParams, pack_f32, pack_i32
from rollq.rl import (
    GrpoConfig,
    GrpoTrainer,
    SamplingTransformError,
    busy_fraction,
    group_advantages,
    grpo_loss,
    logprob_agreement,
    plot_run,
    single_version,
    token_logprobs,
)


def test_group_advantages_are_normalised_per_group_and_zero_without_spread():
    r = torch.tensor([[0.0, 0.25, 0.5, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r)
    assert torch.allclose(a[0].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(a[0].std(unbiased=False), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(a[1], torch.zeros(4))
    assert a[0].argsort().tolist() == [0, 1, 2, 3]


def test_advantages_scaled_by_the_batch_or_not_at_all_keep_small_spreads_small():
    """Dr. GRPO's point: a group whose rewards barely differ gets full-size advantages from its
    own std, and tiny ones with ``scale="none"`` or ``"batch"``; the order within each group,
    and the zero of a group without spread, stay."""
    r = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.20, 0.21, 0.20, 0.21], [0.3, 0.3, 0.3, 0.3]])
    g, n, b = (group_advantages(r, scale=k) for k in ("group", "none", "batch"))
    assert g[1].abs().max() == pytest.approx(1.0, abs=1e-3)
    assert n[1].abs().max() == pytest.approx(0.005, abs=1e-6) and n[0].abs().max() == pytest.approx(0.5)
    centred = r - r.mean(-1, keepdim=True)
    assert torch.allclose(b, centred / centred.std(unbiased=False), atol=1e-5)
    for a in (g, n, b):
        assert torch.equal(a[2], torch.zeros(4)) and a[0].argsort().tolist() == g[0].argsort().tolist()
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages(r, scale="std")
    with pytest.raises(ValueError, match="^scale_rewards must be one of"):
        GrpoConfig(scale_rewards="std")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_trainer_scales_advantages_as_configured(tiny_model_path, monkeypatch, scale):
    """``GrpoConfig.scale_rewards`` reaches the advantages of a real step: the groups' rewards
    go through ``group_advantages`` with that scale, and the step's update follows them."""
    import rollq.rl.advantages as grpo

    torch.set_num_threads(1)
    seen = []

    def spy(rewards, eps=1e-6, scale="group"):
        seen.append((rewards.tolist(), scale))
        return group_advantages(rewards, eps, scale)

    monkeypatch.setattr(grpo, "group_advantages", spy)
    tr = GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=1e-3, scale_rewards=scale), seed=0)
    prompt = [21] * 6
    samples = _sample(tr.model, prompt, 4, 4, torch.Generator().manual_seed(5))
    batch = [(prompt, Result(id="a", samples=samples, version_start=tr.version, version_end=tr.version))] * 2
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.step(batch, [[0.0, 1.0, 0.0, 1.0], [0.20, 0.21, 0.20, 0.21]])
    assert [k for _, k in seen] == [scale]
    assert seen[0][0] == [pytest.approx([0.0, 1.0, 0.0, 1.0]), pytest.approx([0.20, 0.21, 0.20, 0.21])]
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_loss_gradient_raises_logprobs_of_good_samples_and_lowers_bad_ones():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, st = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss.backward()
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()  # descent raises row 0, lowers row 1
    assert torch.allclose(logp.grad.abs(), torch.full((2, 3), 1 / 6))
    assert st["clip_frac"] == 0.0 and st["ratio_mean"] == pytest.approx(1.0)


def test_loss_clips_the_ratio_and_ignores_masked_tokens():
    # ratio e^0.5 > 1.2 with a positive advantage: clipped, no gradient; masked tokens: none either.
    logp = torch.full((1, 2), 0.5, requires_grad=True)
    loss, st = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[True, False]]), clip_eps=0.2)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    assert loss.item() == pytest.approx(-1.2) and st["clip_frac"] == 1.0
    # the same ratio with a negative advantage is not clipped (pessimistic bound): gradient flows
    logp = torch.full((1, 1), 0.5, requires_grad=True)
    grpo_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))[0].backward()
    assert logp.grad.item() == pytest.approx(torch.exp(torch.tensor(0.5)).item())


def test_single_version_is_the_span_when_it_is_one_version():
    assert single_version(Result(id="a", version_start=2, version_end=2)) == 2
    assert single_version(Result(id="a", version_start=2, version_end=3)) is None


def test_single_version_reads_per_token_versions():
    from rollq.protocol import UNKNOWN_START, Sample, pack_i32

    before = Sample(tokens=pack_i32([1, 2, 3]), versions=[(2, 0), (3, 3)])  # 3 came after the last token
    across = Sample(tokens=pack_i32([1, 2, 3]), versions=[(2, 0), (3, 1)])
    unknown = Sample(tokens=pack_i32([1, 2, 3]), versions=[(2, 0), (3, UNKNOWN_START)])
    assert single_version(Result(id="a", version_start=2, version_end=3, samples=[before, before])) == 2
    assert single_version(Result(id="a", version_start=2, version_end=3, samples=[before, across])) is None
    assert single_version(Result(id="a", version_start=2, version_end=3, samples=[unknown])) is None


def test_busy_fraction_unions_overlapping_jobs_per_replica():
    assert busy_fraction([("a", 0, 2), ("a", 1, 3), ("b", 0, 1)], (0, 4)) == 0.5
    assert busy_fraction([], (0, 1)) == 0.0


# -- with the tiny Hugging Face model ---------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    torch.set_num_threads(1)
    return GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=5e-3), seed=0)


def _sample(model, prompt, n, length, gen, temperature=1.0, source=None):
    """Sample ``n`` completions from ``model`` itself at ``temperature``, with the logprobs of
    the distribution sampled from (labelled ``source``)."""
    ids = torch.tensor([prompt] * n)
    lps = []
    with torch.no_grad():
        for _ in range(length):
            lp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float() / temperature, -1)
            t = torch.multinomial(lp.exp(), 1, generator=gen)
            lps.append(lp.gather(-1, t))
            ids = torch.cat([ids, t], 1)
    toks, lps = ids[:, len(prompt):], torch.cat(lps, 1)
    return [Sample(tokens=pack_i32(toks[i].tolist()), logprobs=pack_f32(lps[i].tolist()), lp_source=source)
            for i in range(n)]


def test_token_logprobs_of_a_padded_batch_equal_one_sequence_at_a_time(trainer):
    m = trainer.model
    prompts, comps = [[5, 6, 7], [9] * 8], [[100, 200], [300, 400, 500, 600]]
    with torch.no_grad():
        logp, mask = token_logprobs(m, prompts, comps)
        for i, (p, c) in enumerate(zip(prompts, comps)):
            one, _ = token_logprobs(m, [p], [c])
            assert torch.allclose(logp[i, : len(c)], one[0], atol=1e-5)
    assert mask.tolist() == [[True, True, False, False], [True] * 4]


def test_shared_prompts_give_the_whole_rows_logprobs_and_gradients(trainer):
    """A group's samples share their prompt's decoder pass (one key/value cache gathered to
    every row): logprobs and gradients equal those of running every row whole, with prompts of
    several lengths (one token among them), empty completions, per-row temperatures and the
    weights of another version."""
    m = trainer.model
    gen = torch.Generator().manual_seed(3)
    base = [[5, 6, 7], [9] * 8, [11], [12, 13, 14]]
    prompts = [p for p in base for _ in range(3)]
    comps = [torch.randint(4, 1000, (int(k),), generator=gen).tolist() for k in torch.randint(0, 6, (12,), generator=gen)]
    comps[0] = []
    temps = [(0.7, 1.0, 2.0)[i % 3] for i in range(12)]
    weights = torch.randn(12, 5, generator=gen)
    got = {}
    for share in (True, False):
        m.zero_grad(set_to_none=True)
        logp, mask = token_logprobs(m, prompts, comps, temperature=temps, share_prompts=share)
        (logp * weights[:, : logp.shape[1]]).sum().backward()
        got[share] = logp.detach(), mask, [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    (a, mask_a, grads_a), (b, mask_b, grads_b) = got[True], got[False]
    assert torch.equal(mask_a, mask_b) and a.shape == (12, 5)
    assert (a - b).abs().max() < 1e-5
    for ga, gb in zip(grads_a, grads_b):
        # float rounding scales with the terms summed into each entry, not with the entry: an
        # embedding row's gradient sums many rows' terms that cancel (2.4e-6 apart on a tensor
        # whose entries reach 8.6, with transformers 5.19), so the bound is relative to the tensor
        assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6 * max(1.0, float(gb.abs().max())))
    other = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in m.state_dict().items()}
    with torch.no_grad():
        x, _ = token_logprobs(m, prompts, comps, other, temps)
        y, _ = token_logprobs(m, prompts, comps, other, temps, share_prompts=False)
    assert (x - y).abs().max() < 1e-5 and (x - a).abs().max() > 1e-3  # the other weights were used


def test_trainer_step_measures_agreement_lags_and_keeps_snapshots(trainer):
    gen = torch.Generator().manual_seed(0)
    v0 = trainer.version
    batch, rewards = [], []
    for b in range(4):
        prompt = [20 + b] * 8
        res = Result(id=f"j{b}", samples=_sample(trainer.model, prompt, 4, 4, gen), version_start=v0, version_end=v0, meta={"bucket": b})
        batch.append((prompt, res))
        rewards.append([float(i) / 3 for i in range(4)])
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    st = trainer.step(batch, rewards)
    assert st.version == v0 and trainer.version == v0 + 1 and st.lags == [0, 0, 0, 0]
    assert st.diff_tokens == 64 and st.diff_max < 1e-4  # same weights, same tokens
    assert any(not torch.equal(before[k], v) for k, v in trainer.state_dict().items())
    # The old version's weights are kept: agreement of the old samples is still exact there,
    # and clearly off at the new weights.
    old = trainer.weights_at(v0)
    assert old is not None and torch.equal(old["lm_head.weight"], before["lm_head.weight"])
    results, prompts = [r for _, r in batch], [p for p, _ in batch]
    mean, worst, n = logprob_agreement(trainer.model, results, prompts, state=old)
    assert n == 64 and worst < 1e-4
    mean_new, _, _ = logprob_agreement(trainer.model, results, prompts)
    assert mean_new > 10 * max(mean, 1e-6)
    # A second step on the same (now one version old) samples: lag 1, agreement from the snapshot.
    st2 = trainer.step(batch, rewards)
    assert st2.lags == [1, 1, 1, 1] and st2.diff_tokens == 64 and st2.diff_max < 1e-4


def _source(kind, **sampling):
    return LogprobSource.of(SamplingParams(ignore_eos=True, **sampling), kind)


def test_before_update_runs_after_the_backward_pass_and_before_the_weights_change(trainer):
    """``before_update`` (where the RL loop releases a leased IPC version) sees the gradients
    computed and the weights still those that were published."""
    gen = torch.Generator().manual_seed(1)
    prompt = [30] * 8
    res = Result(id="j", samples=_sample(trainer.model, prompt, 4, 4, gen), version_start=trainer.version,
                 version_end=trainer.version)
    published = {k: v.clone() for k, v in trainer.state_dict().items()}
    seen: list[tuple[bool, bool]] = []

    def before_update() -> None:
        unchanged = all(torch.equal(published[k], v) for k, v in trainer.state_dict().items())
        seen.append((unchanged, any(p.grad is not None for p in trainer.model.parameters())))

    trainer.step([(prompt, res)], [[0.0, 1.0, 0.0, 1.0]], before_update=before_update)
    assert seen == [(True, True)]
    assert any(not torch.equal(published[k], v) for k, v in trainer.state_dict().items())


def test_trainer_takes_processed_logprobs_at_their_temperature(trainer):
    """Samples drawn at T=0.7 with the logprobs of that distribution: the trainer's step and
    agreement compare ``log_softmax(logits / 0.7)``, so they agree exactly; at T=1 they would not."""
    gen = torch.Generator().manual_seed(1)
    v0 = trainer.version
    batch = []
    for b in range(2):
        prompt = [40 + b] * 6
        samples = _sample(trainer.model, prompt, 4, 5, gen, 0.7, _source("processed", temperature=0.7))
        batch.append((prompt, Result(id=f"t{b}", samples=samples, version_start=v0, version_end=v0)))
    results, prompts = [r for _, r in batch], [p for p, _ in batch]
    mean, worst, n = logprob_agreement(trainer.model, results, prompts)
    assert n == 40 and worst < 1e-5, (mean, worst)
    with torch.no_grad():
        at_one, _ = token_logprobs(trainer.model, [p for p in prompts for _ in range(4)],
                                   [s.token_ids for r in results for s in r.samples])
    behaviour = torch.tensor([s.token_logprobs for r in results for s in r.samples])
    assert (at_one - behaviour).abs().mean() > 1e-2  # T=1 logprobs are another distribution
    st = trainer.step(batch, [[0.0, 1.0, 0.0, 1.0]] * 2)
    assert st.diff_tokens == 40 and st.diff_max < 1e-5 and st.extra["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("kind, sampling, field", [
    ("raw", {"temperature": 0.7}, "temperature=0.7"),
    ("raw", {"top_k": 5}, "top_k=5"),
    ("processed", {"temperature": 0.7, "top_p": 0.9}, "top_p=0.9"),
    ("processed", {"min_p": 0.05}, "min_p=0.05"),
    ("processed", {"top_k": 5}, "top_k=5"),
    ("processed", {"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ("processed", {"presence_penalty": 0.5}, "presence_penalty=0.5"),
    ("processed", {"temperature": 0.0}, "temperature=0.0"),
])
def test_trainer_refuses_logprobs_whose_transform_it_cannot_apply(trainer, kind, sampling, field):
    gen = torch.Generator().manual_seed(2)
    samples = _sample(trainer.model, [7, 8, 9], 2, 3, gen, 1.0, _source(kind, **sampling))
    res = Result(id="x", samples=samples, version_start=trainer.version, version_end=trainer.version)
    before = trainer.version
    with pytest.raises(SamplingTransformError, match=f"^{field}: "):
        logprob_agreement(trainer.model, [res], [[7, 8, 9]])
    with pytest.raises(SamplingTransformError, match=f"^{field}: "):
        trainer.step([([7, 8, 9], res)], [[0.0, 1.0]])
    assert trainer.version == before  # refused before any update


def test_min_tokens_counts_only_where_it_masks_stop_tokens():
    assert _source("processed", min_tokens=3).transformed() == []  # ignore_eos, no stop ids
    masked = LogprobSource.of(SamplingParams(min_tokens=3), "processed")
    assert masked.transformed() == ["min_tokens=3"]


def test_plot_writes_a_png_and_its_data(tmp_path):
    steps = [{"step": i, "reward": 0.25 + i / 10, "lags": [0, 1]} for i in range(5)]
    png = plot_run(steps, tmp_path / "run.png", random_policy_reward=0.25)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["reward"][-1] == pytest.approx(0.65) and data["lag_mean"] == [0.5] * 5


# -- the importance ratio: clip activity, truncation, the ratio-off control --------------
def test_clip_frac_counts_the_tokens_where_the_clip_was_active():
    # Per token: ratio e^0.5 (above 1 + eps) with advantage +1: clipped, no gradient;
    # the same ratio with advantage -1: the unclipped term is the smaller, the clip is idle;
    # ratio e^-0.5 (below 1 - eps) with advantage -1: clipped; ratio 1: idle; a masked token
    # with a huge ratio: not counted. Two active clips out of four tokens.
    logp = torch.tensor([[0.5, 0.0], [0.5, -0.5], [0.0, 3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.tensor([[True, False], [True, True], [True, False]])
    loss, st = grpo_loss(logp, torch.zeros(3, 2), adv, mask, clip_eps=0.2)
    loss.backward()
    assert st["clip_frac"] == pytest.approx(2 / 4)
    assert (logp.grad == 0).tolist() == [[True, True], [False, True], [False, True]]  # active clips: no gradient
    assert st["ratio_max"] == pytest.approx(float(torch.exp(torch.tensor(0.5))))


def test_truncated_importance_weighting_caps_the_weight_of_each_token():
    logp = torch.tensor([[0.0, 0.5, 2.0, -1.0]], requires_grad=True)
    behavior = torch.zeros(1, 4)
    loss, st = grpo_loss(logp, behavior, torch.tensor([1.0]), torch.ones(1, 4), tis_cap=1.5)
    loss.backward()
    ratio = torch.exp(logp.detach())
    weight = ratio.clamp(max=1.5)
    assert torch.allclose(logp.grad, -weight / 4)  # d/dlogp of -(w * exp(logp - sg(logp))) / n
    assert weight[0, 1:3].tolist() == [1.5, 1.5] and st["tis_frac"] == pytest.approx(2 / 4)  # e^0.5, e^2 capped
    assert st["clip_frac"] == 0.0  # the PPO clip applies to the step's own ratio, 1 here
    assert st["ratio_max"] == pytest.approx(float(ratio.max()))
    # Without the cap the token with ratio e^2 would have been clipped away (no gradient).
    logp2 = logp.detach().clone().requires_grad_()
    grpo_loss(logp2, behavior, torch.tensor([1.0]), torch.ones(1, 4))[0].backward()
    assert logp2.grad[0, 2] == 0.0 and logp.grad[0, 2] < 0


def test_grpo_config_refuses_options_that_mean_nothing():
    with pytest.raises(ValueError, match="^tis_cap must be >= 1"):
        GrpoConfig(tis_cap=0.9)
    with pytest.raises(ValueError, match="^tis_cap must be >= 1"):
        GrpoConfig(tis_cap=float("nan"))
    with pytest.raises(ValueError, match="^tis_cap: .*importance_ratio=True"):
        GrpoConfig(tis_cap=2.0, importance_ratio=False)
    with pytest.raises(ValueError, match="^clip_eps must be in"):
        GrpoConfig(clip_eps=0.0)
    with pytest.raises(ValueError, match="^lr must be > 0"):
        GrpoConfig(lr=0.0)
    with pytest.raises(ValueError, match="^snapshots must be >= 1"):
        GrpoConfig(snapshots=0)
    with pytest.raises(ValueError, match="^tis_cap: "):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), tis_cap=2.0, importance_ratio=False)


# -- the entropy bonus -------------------------------------------------------------------
def _categorical_bonus_grad(logits, coef, samples=20000, seed=0):
    """The gradient on ``logits`` of grpo_loss with zero advantages and ``entropy_coef=coef``
    over ``samples`` tokens drawn from ``softmax(logits)`` (one-token samples, on-policy)."""
    logits = logits.clone().requires_grad_()
    tokens = torch.multinomial(torch.softmax(logits.detach(), -1), samples, replacement=True,
                               generator=torch.Generator().manual_seed(seed))
    logp = torch.log_softmax(logits, -1)[tokens].unsqueeze(-1)
    loss, _ = grpo_loss(logp, logp.detach(), torch.zeros(samples), torch.ones(samples, 1), entropy_coef=coef)
    loss.backward()
    return logits.grad


def test_entropy_bonus_follows_the_entropy_gradient_from_sampled_tokens_alone():
    """Zero advantages (every group agreed): without the bonus no gradient at all; with it,
    descent on the loss follows the exact gradient of ``coef * entropy`` (estimated from the
    sampled tokens' logprobs only) and a sure policy becomes less sure."""
    logits = torch.tensor([3.0, 0.5, 0.0, -1.0])
    assert torch.equal(_categorical_bonus_grad(logits, 0.0), torch.zeros(4))
    g = _categorical_bonus_grad(logits, 0.1)
    x = logits.clone().requires_grad_()
    p = torch.softmax(x, -1)
    (-(0.1 * -(p * torch.log(p)).sum())).backward()  # the loss that maximises 0.1 * H exactly
    assert torch.nn.functional.cosine_similarity(g, x.grad, dim=0) > 0.95, (g, x.grad)
    assert g.norm() == pytest.approx(float(x.grad.norm()), rel=0.15)

    def entropy(z):
        q = torch.softmax(z, -1)
        return float(-(q * torch.log(q)).sum())

    assert entropy(logits - 1.0 * g) > entropy(logits) + 0.01


def test_entropy_bonus_off_leaves_the_loss_exactly_as_it_was_and_is_validated():
    logp = torch.tensor([[-0.1, -2.0], [-3.0, -0.5]], requires_grad=True)
    behavior = torch.tensor([[-0.2, -1.9], [-3.1, -0.4]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[True, True], [True, False]])
    base, st0 = grpo_loss(logp, behavior, adv, mask)
    off, st1 = grpo_loss(logp, behavior, adv, mask, entropy_coef=0.0)
    on, _ = grpo_loss(logp, behavior, adv, mask, entropy_coef=0.1)
    assert torch.equal(base, off) and st0 == st1 and float(on.detach()) != float(base.detach())
    assert GrpoConfig().entropy_coef == 0.0
    with pytest.raises(ValueError, match="^entropy_coef must be >= 0"):
        GrpoConfig(entropy_coef=-0.01)
    with pytest.raises(ValueError, match="^entropy_coef must be >= 0"):
        GrpoConfig(entropy_coef=float("nan"))


def _param_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_ratio_off_gives_the_on_policy_gradient_of_a_real_model(trainer):
    """With the ratio fixed at 1 the gradient is the on-policy one (behavior = the trainer's own
    logprobs) even when the behavior logprobs are far off; with the ratio it is not."""
    m = trainer.model
    gen = torch.Generator().manual_seed(3)
    prompt = [30] * 6
    samples = _sample(m, prompt, 4, 5, gen)
    comps = [s.token_ids for s in samples]
    adv = group_advantages(torch.tensor([[0.0, 1.0, 0.25, 0.5]]))[0]
    stale = torch.randn(4, 5, generator=gen) * 0.5  # behavior logprobs of another policy

    def grads(behavior, **kw):
        logp, mask = token_logprobs(m, [prompt] * 4, comps)
        b = logp.detach() if behavior is None else logp.detach() + behavior
        return _param_grads(m, grpo_loss(logp, b, adv, mask, **kw)[0])

    on_policy = grads(None)
    off = grads(stale, importance_ratio=False)
    with_ratio = grads(stale)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(on_policy, off))
    assert any(not torch.allclose(a, b, atol=1e-5) for a, b in zip(on_policy, with_ratio))
    m.zero_grad(set_to_none=True)


def test_agreement_is_split_by_the_behaviour_probability_of_each_token(tiny_model_path):
    """Single-version groups at the trainer's version (this forward pass) and at an older one
    (its snapshot): every compared token lands in one confidence bucket, the buckets add up
    to the agreement's totals, and each bucket holds the tokens of its probability range."""
    from rollq.rl.behavior import CONFIDENCE_BUCKETS

    torch.set_num_threads(1)
    tr = GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=5e-3), seed=0)
    gen = torch.Generator().manual_seed(5)
    prompt = [21] * 6
    samples = _sample(tr.model, prompt, 4, 6, gen)
    batch = [(prompt, Result(id="a", samples=samples, version_start=tr.version, version_end=tr.version))]
    probs = [math.exp(x) for s in samples for x in s.token_logprobs]
    at_v, from_snapshot = tr.step(batch, [[0.0, 1.0, 0.0, 1.0]]), tr.step(batch, [[0.0, 1.0, 0.0, 1.0]])
    assert at_v.agree_s == 0.0 and 0.0 < from_snapshot.agree_s < from_snapshot.train_s  # the extra forward, timed apart
    for st in (at_v, from_snapshot):
        assert st.diff_tokens == 24
        assert sum(b[2] for b in st.diff_by_confidence.values()) == 24
        assert sum(b[0] for b in st.diff_by_confidence.values()) == pytest.approx(st.diff_sum, rel=1e-6, abs=1e-9)
        for name, lo, hi in CONFIDENCE_BUCKETS:
            expected = sum(lo <= p < hi for p in probs)
            assert st.diff_by_confidence.get(name, [0, 0, 0])[2] == expected


def test_trainer_step_reports_ratio_tis_and_agreement_by_lag(tiny_model_path):
    torch.set_num_threads(1)
    tr = GrpoTrainer.from_pretrained(str(tiny_model_path), GrpoConfig(lr=5e-3, tis_cap=2.0), seed=0)
    gen = torch.Generator().manual_seed(4)
    v0 = tr.version
    prompt = [21] * 6
    samples = _sample(tr.model, prompt, 4, 4, gen)
    # One sample's last two tokens marked as generated one version later (a swap mid-sample).
    samples[0] = Sample(tokens=samples[0].tokens, logprobs=samples[0].logprobs, versions=[(v0, 0), (v0 + 1, 2)])
    batch = [(prompt, Result(id="a", samples=samples, version_start=v0, version_end=v0 + 1))]
    st = tr.step(batch, [[0.0, 1.0, 0.0, 1.0]])
    assert set(st.extra) == {"ratio_mean", "ratio_max", "tis_frac"}
    assert st.extra["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and st.extra["tis_frac"] == 0.0
    # Trained at v0: 14 tokens of lag 0 that agree to float tolerance; the two "newer" ones
    # count apart (lag -1: from a version the trainer had not made yet, no bucket).
    assert list(st.diff_by_lag) == ["0"] and st.diff_by_lag["0"][2] == 14 and st.diff_by_lag["0"][1] < 1e-4
    # A second step on the same samples: the trainer is one version on, lags 1 and 0.
    st2 = tr.step(batch, [[0.0, 1.0, 0.0, 1.0]])
    assert st2.diff_by_lag["1"][2] == 14 and st2.diff_by_lag["0"][2] == 2
    assert st2.diff_by_lag["1"][0] / 14 > 1e-4  # the weights moved: lag-1 logprobs are off
