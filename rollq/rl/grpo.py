"""GRPO on the trainer: advantages, the clipped loss, the trainer step, version snapshots.

One job is one GRPO group: the ``n`` samples of one prompt. Each sample's advantage is its
reward normalised within its group (``(r - mean) / std``; 0 when the group agrees), and the
loss is PPO's clipped surrogate on the importance ratio between the trainer's current
policy and the *behavior* policy, whose per-token logprobs the replica returned with the
sample (``sampling.logprobs=0``); :class:`GrpoConfig` can cap that ratio instead (truncated
importance weighting, ``tis_cap``) or fix it at 1 (``importance_ratio=False``, a control
arm). The ratio means something only when both are logprobs of the distribution the tokens
were drawn from. Each sample says what its logprobs are (:class:`~rollq.protocol.LogprobSource`):
vLLM's raw ``log_softmax`` of the logits (its default) is that distribution only at
temperature 1 with no top-p, top-k, min-p or penalties; a replica with
``VllmEngineConfig(logprobs_mode="processed_logprobs")`` returns the logprobs after them.
The trainer applies the same temperature to its own logits (``log_softmax(logits / T)``) and
refuses with :class:`~rollq.rl.behavior.SamplingTransformError`, naming the
field, a result whose transform it cannot reproduce (raw logprobs at T != 1, top-p, top-k,
min-p, penalties, greedy samples).

>>> import torch
>>> group_advantages(torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
tensor([[-1.0000,  1.0000],
        [ 0.0000,  0.0000]])

What the behavior logprobs are and how the trainer recomputes them is in
:mod:`rollq.rl.behavior`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .._torch_extras import hide_broken_torch_extras
from .advantages import SCALE_REWARDS, _advantages, group_advantages
from .behavior import (
    _behavior,
    _padded,
    agreement_terms,
    diff_by_confidence,
    diff_terms,
    merge_buckets,
    single_version,
    token_logprobs,
)

log = logging.getLogger(__name__)

__all__ = ["GrpoConfig", "GrpoTrainer", "StepStats", "group_advantages", "grpo_loss"]


# ----------------------------------------------------------------------------------------
# Pure functions: advantages and loss
# ----------------------------------------------------------------------------------------
def grpo_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    *,
    tis_cap: float | None = None,
    importance_ratio: bool = True,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped GRPO surrogate, averaged over the tokens where ``mask`` is set.

    ``logp`` (with grad) and ``behavior_logp`` are ``[samples, tokens]``; ``advantages`` is
    ``[samples]`` (one per sample, broadcast over its tokens). Three ways to treat the
    importance ratio ``exp(logp - behavior_logp)`` against the behavior policy:

    - default: PPO's clipped surrogate on that ratio;
    - ``tis_cap=C`` (truncated importance weighting, as TIS / MIS do): each token's
      policy-gradient term is weighted by ``min(ratio, C)``, detached; PPO's clip applies to
      the ratio against the trainer's own policy at this step (1 for rollq's one update per
      batch, so the clip stays inactive);
    - ``importance_ratio=False`` (a control arm): the ratio is fixed at 1, the gradient is
      the on-policy one ``advantage * grad(logp)``, whatever the behavior logprobs say.

    ``entropy_coef=c`` (> 0) adds an entropy bonus, estimated from the sampled tokens alone
    (no full distribution is needed): each token's advantage gains ``c * (-logp - b)``, its
    surprisal under the current policy (detached) minus ``b``, the mean surprisal of the
    batch's tokens (a baseline: it changes the variance, not the expectation). The expected
    gradient of that term is ``c`` times the gradient of the policy's entropy at the sampled
    contexts, so a token the policy has grown sure of is pushed back towards the others and a
    group whose samples all agree still gets a gradient. 0 (the default): no bonus, the loss
    is exactly the one above.

    Returns the loss and stats: ``clip_frac``, the share of tokens where the clip was active
    (the clipped term was the smaller one, so the token gave no gradient); ``ratio_mean`` and
    ``ratio_max`` of the ratio against the behavior logprobs (whichever way it is used);
    ``tis_frac``, the share of tokens whose ratio exceeded ``tis_cap`` (0 without it).

    >>> z = torch.zeros(2, 3)
    >>> loss, st = grpo_loss(z.requires_grad_(), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    >>> abs(float(loss)), st["clip_frac"]
    (0.0, 0.0)
    >>> logp = torch.tensor([[0.0, 2.0]], requires_grad=True)   # the second token: ratio e^2 = 7.4
    >>> loss, st = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), tis_cap=2.0)
    >>> loss.backward(); logp.grad                                # weights 1 and 2 (capped), / 2 tokens
    tensor([[-0.5000, -1.0000]])
    >>> st["tis_frac"], round(st["ratio_max"], 2)
    (0.5, 7.39)
    """
    if tis_cap is not None and not importance_ratio:
        raise ValueError("tis_cap: truncated importance weighting needs importance_ratio=True")
    mask_f = mask.to(logp.dtype)
    n = mask_f.sum().clamp(min=1)
    adv = advantages.unsqueeze(-1)
    if entropy_coef:
        surprisal = -logp.detach()
        adv = adv + entropy_coef * (surprisal - (surprisal * mask_f).sum() / n) * mask_f
    log_ratio = logp - behavior_logp
    if importance_ratio and tis_cap is None:
        ratio = torch.exp(log_ratio)
        weight = None
    else:  # the ratio against the trainer's own policy at this step: 1, with logp's gradient
        ratio = torch.exp(logp - logp.detach())
        weight = None if tis_cap is None else torch.exp(log_ratio.detach()).clamp(max=tis_cap)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if weight is not None:
        surrogate = weight * surrogate
    loss = -(surrogate * mask_f).sum() / n
    with torch.no_grad():
        active = (clipped < unclipped).to(mask_f.dtype) * mask_f  # min() took the clipped term
        behavior_ratio = torch.exp(log_ratio.detach())
        on = mask.bool()
        capped = (behavior_ratio > tis_cap).to(mask_f.dtype) * mask_f if tis_cap is not None else torch.zeros_like(mask_f)
        stats = {
            "clip_frac": float(active.sum() / n),
            "ratio_mean": float((behavior_ratio * mask_f).sum() / n),
            "ratio_max": float(behavior_ratio[on].max()) if bool(on.any()) else 0.0,
            "tis_frac": float(capped.sum() / n),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------
@dataclass
class GrpoConfig:
    """Hyperparameters of :class:`GrpoTrainer`; invalid values raise ValueError naming the field.

    >>> GrpoConfig(tis_cap=2.0).tis_cap
    2.0
    >>> GrpoConfig(tis_cap=0.5)
    Traceback (most recent call last):
    ...
    ValueError: tis_cap must be >= 1 (a cap below 1 would down-weight on-policy tokens), got 0.5
    """

    #: Adam learning rate.
    lr: float = 3e-3
    #: PPO clip range of the importance ratio.
    clip_eps: float = 0.2
    #: Gradient-norm clip (0: off).
    max_grad_norm: float = 1.0
    #: State dicts of the last versions kept to recompute logprobs of older samples.
    snapshots: int = 3
    #: Truncated importance weighting (TIS / MIS): the ratio against the behavior logprobs,
    #: capped at this value and detached, weights each token's policy gradient
    #: (:func:`grpo_loss`). None: PPO's clipped ratio against the behavior logprobs.
    tis_cap: float | None = None
    #: False: the importance ratio is fixed at 1 (the behavior logprobs only feed the
    #: diagnostics), the control arm that shows what the off-policy correction does.
    importance_ratio: bool = True
    #: Entropy bonus (:func:`grpo_loss`): each token's advantage gains this times its
    #: surprisal ``-logp`` minus the batch's mean surprisal, whose expected gradient is this
    #: times the entropy's. It keeps groups from all agreeing on a wrong answer (zero
    #: advantage, no gradient) while the policy sharpens. 0: off.
    entropy_coef: float = 0.0
    #: How a group's centred rewards are scaled into advantages (:func:`group_advantages`):
    #: ``"group"`` (its own std, GRPO), ``"batch"`` (the batch's std) or ``"none"`` (Dr. GRPO).
    scale_rewards: str = "group"

    def __post_init__(self) -> None:
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: off), got {self.max_grad_norm!r}")
        if not self.entropy_coef >= 0:  # also refuses NaN
            raise ValueError(f"entropy_coef must be >= 0 (0: off), got {self.entropy_coef!r}")
        if self.snapshots < 1:
            raise ValueError(f"snapshots must be >= 1, got {self.snapshots!r}")
        if self.tis_cap is not None:
            if not self.tis_cap >= 1:  # also refuses NaN
                raise ValueError(f"tis_cap must be >= 1 (a cap below 1 would down-weight on-policy tokens), got {self.tis_cap!r}")
            if not self.importance_ratio:
                raise ValueError("tis_cap: truncated importance weighting needs importance_ratio=True (the ratio-off "
                                 "control has no ratio to cap)")


@dataclass
class StepStats:
    """What one :meth:`GrpoTrainer.step` did."""

    #: Trainer version the gradient was computed at (the weights before the step).
    version: int
    reward_mean: float
    loss: float
    clip_frac: float
    #: Policy lag of each group trained on: ``version - result.version_start``.
    lags: list[int]
    #: Sum and max of |behavior - trainer| logprob differences, tokens compared (single-version samples).
    diff_sum: float = 0.0
    diff_max: float = 0.0
    diff_tokens: int = 0
    #: |behavior - trainer| at the trainer's current weights, by the lag of each token (the
    #: trainer version minus the version that generated it; ``"0"``, ``"1"``, ``"2+"``):
    #: ``[sum, max, tokens]``. Lag 0 is the weight-sync check; lags 1 and 2+ show how far
    #: off-policy the behavior logprobs are. Tokens of an unknown version are left out.
    diff_by_lag: dict[str, list[float]] = field(default_factory=dict)
    #: The agreement's tokens (those of ``diff_sum``) by the behavior probability of each
    #: (:func:`~rollq.rl.behavior.diff_by_confidence`): ``{bucket: [sum, max, tokens]}``.
    diff_by_confidence: dict[str, list[float]] = field(default_factory=dict)
    train_s: float = 0.0
    #: Of :attr:`train_s`, the seconds of the diagnostic agreement forwards at older versions'
    #: weights (:attr:`diff_sum`'s tokens not covered by the training forward itself).
    agree_s: float = 0.0
    #: The loss's stats beyond ``clip_frac`` (:func:`grpo_loss`): ``ratio_mean``,
    #: ``ratio_max``, ``tis_frac``.
    extra: dict[str, float] = field(default_factory=dict)


class GrpoTrainer:
    """A Hugging Face causal LM trained with GRPO on groups that come back from the queue.

    ``step(batch)`` takes ``(prompt_ids, result)`` pairs (one GRPO group each) with their
    rewards, makes one Adam step, and advances :attr:`version` (the caller publishes the new
    weights as that version). Along the way it measures the logprob agreement of every group
    generated entirely at a version it still has weights for: the current one (from the
    training forward pass itself) or one of the last ``snapshots`` versions. The policy is
    taken at the samples' temperature (:func:`behavior_temperature`); a batch holding a
    result whose sampling transform the trainer cannot reproduce raises
    :class:`SamplingTransformError` before any update.

    >>> trainer = GrpoTrainer.from_pretrained(model_dir, GrpoConfig(lr=3e-3))   # doctest: +SKIP
    >>> stats = trainer.step(batch, rewards)                                   # doctest: +SKIP
    >>> await publisher.publish_weights(trainer.state_dict())                  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, config: GrpoConfig | None = None, version: int = 0):
        self.model = model
        self.config = config or GrpoConfig()
        self.version = version
        self.optimizer = torch.optim.Adam(model.parameters(), lr=self.config.lr)
        self._snapshots: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._snapshot()

    @classmethod
    def from_pretrained(cls, model_dir: str, config: GrpoConfig | None = None, seed: int = 0) -> GrpoTrainer:
        """Load ``model_dir`` with transformers in float32 (the weights the replicas start from: version 0)."""
        hide_broken_torch_extras()  # before transformers imports torchvision
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        return cls(model, config)

    def to(self, device: str | torch.device) -> GrpoTrainer:
        """Move the model, the kept snapshots of earlier versions and the optimizer's state
        to ``device`` (a trainer built on the CPU and trained on a GPU).

        >>> trainer = GrpoTrainer.from_pretrained(model_dir).to("cuda")   # doctest: +SKIP
        """
        self.model.to(device)
        for v, snap in self._snapshots.items():
            self._snapshots[v] = {k: t.to(device) for k, t in snap.items()}
        for st in self.optimizer.state.values():
            for k, t in list(st.items()):
                if isinstance(t, torch.Tensor) and k != "step":
                    st[k] = t.to(device)
        return self

    @property
    def dtype(self) -> str:
        """The dtype of the model's floating-point weights (torch name without ``torch.``)."""
        p = next(self.model.parameters(), None)
        return str(p.dtype).removeprefix("torch.") if p is not None else ""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights to publish, under the checkpoint's (Hugging Face) names."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def rebase(self, version: int) -> None:
        """Call the current weights ``version`` (e.g. after publishing them to replicas that
        had other weights); older snapshots are dropped."""
        self.version = version
        self._snapshots.clear()
        self._snapshot()

    def advance(self) -> None:
        """A new version with the same weights: a step that had nothing to train on (every job
        of its batch failed) still publishes, so the loop's version schedule holds."""
        self.version += 1
        self._snapshot()

    def weights_at(self, version: int) -> dict[str, torch.Tensor] | None:
        """The state dict of ``version`` if it is still kept."""
        return self._snapshots.get(version)

    def _snapshot(self) -> None:
        self._snapshots[self.version] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        while len(self._snapshots) > max(1, self.config.snapshots):
            self._snapshots.popitem(last=False)

    def step(
        self, batch: Sequence[tuple[Sequence[int], Any]], rewards: Sequence[Sequence[float]], *, agreement: bool = True,
        before_update: Callable[[], Any] | None = None,
    ) -> StepStats:
        """One GRPO update on ``batch`` (``(prompt_ids, result)`` per group) with per-sample
        ``rewards``. ``agreement=False`` skips the diagnostic forwards at older versions'
        weights (the agreement then covers only groups of the current version, which the
        training forward gives for free); the update is the same. ``before_update`` is called
        after the backward pass, right before the optimizer changes the weights in place (a
        leased IPC version is released there: ``WeightPublisher.release_weights``)."""
        t0 = time.perf_counter()
        prompts, comps, owner = [], [], []
        for g, (prompt, res) in enumerate(batch):
            for s in res.samples:
                prompts.append(prompt)
                comps.append(s.token_ids)
                owner.append(g)
        behavior, temps = _behavior([r for _, r in batch])  # refuses what it cannot reproduce
        adv = _advantages(rewards, self.config.scale_rewards)
        logp, mask = token_logprobs(self.model, prompts, comps, temperature=temps)
        b = _padded(behavior, logp)
        loss, st = self._loss(logp, b, adv, mask)
        by_lag = self._diff_by_lag(logp.detach(), b, mask, [vs for _, r in batch for vs in _versions(r)])
        # Agreement: groups generated entirely at the current version use this forward pass.
        lags = [self.version - res.version_start for _, res in batch]
        terms: list[tuple[torch.Tensor, torch.Tensor]] = []
        cur = [i for i, g in enumerate(owner) if single_version(batch[g][1]) == self.version]
        if cur:
            terms.append(diff_terms(logp[cur], b[cur], mask[cur]))
        older: dict[int, list[int]] = {}
        for g, (_, res) in enumerate(batch):
            v = single_version(res)
            if agreement and v is not None and v != self.version and v in self._snapshots:
                older.setdefault(v, []).append(g)
        ta = time.perf_counter()
        for v, groups in older.items():
            terms.append(agreement_terms(self.model, [batch[g][1] for g in groups], [batch[g][0] for g in groups], self._snapshots[v]))
        return self._update(loss, st, rewards, lags, terms, by_lag, t0, time.perf_counter() - ta if older else 0.0, before_update)

    def step_episodes(
        self, groups: Sequence[Any], rewards: Sequence[Sequence[float]], *, agreement: bool = True,
        before_update: Callable[[], Any] | None = None,
    ) -> StepStats:
        """One GRPO update on whole multi-turn episodes: ``groups`` holds one sequence of
        :class:`~rollq.rl.episodes.Episode` per GRPO group (an
        :class:`~rollq.rl.episodes.EpisodeGroup`'s ``episodes``), ``rewards`` one reward per
        episode. The loss runs over every turn's completion tokens (the episode's
        ``loss_mask``; prompt and environment tokens are context only), each token's ratio
        against the behavior logprob its turn's replica returned, its lag counted from the
        version that generated that very token. Agreement (``diff_*``) is measured on the
        episodes generated entirely at one version the trainer still has weights for (with
        ``agreement=False``: at the current version only, as in :meth:`step`).

        >>> stats = trainer.step_episodes([g.episodes for g in groups], [task.rewards(g) for g in groups])  # doctest: +SKIP
        """
        t0 = time.perf_counter()
        eps = [e for g in groups for e in g]
        if len(eps) != sum(len(r) for r in rewards):
            raise ValueError(f"{len(eps)} episodes for {sum(len(r) for r in rewards)} rewards")
        prompts = [e.token_ids[: e.prompt_len] for e in eps]
        rest = [e.token_ids[e.prompt_len :] for e in eps]
        logp, mask = token_logprobs(self.model, prompts, rest, temperature=[e.temperature for e in eps])
        model_tokens = _padded([[float(m) for m in e.loss_mask[e.prompt_len :]] for e in eps], logp) > 0
        mask = mask & model_tokens
        # Behavior logprobs of prompt and environment tokens are NaN: zero, and masked out.
        b = _padded([[x if m else 0.0 for x, m in zip(e.logprobs[e.prompt_len :], e.loss_mask[e.prompt_len :])] for e in eps], logp)
        loss, st = self._loss(logp, b, _advantages(rewards, self.config.scale_rewards), mask)
        detached = logp.detach()
        by_lag = self._diff_by_lag(detached, b, mask, [e.versions[e.prompt_len :] for e in eps])
        lags = [self.version - min(e.version_start for e in g) for g in groups if g]
        terms: list[tuple[torch.Tensor, torch.Tensor]] = []
        at: dict[int, list[int]] = {}
        for i, e in enumerate(eps):
            v = e.single_version
            if v is not None and (v == self.version or (agreement and v in self._snapshots)):
                at.setdefault(v, []).append(i)
        ta = time.perf_counter()
        for v, rows in at.items():
            if v == self.version:  # this forward pass
                terms.append(diff_terms(detached[rows], b[rows], mask[rows]))
            else:
                with torch.no_grad():
                    lp, _ = token_logprobs(self.model, [prompts[i] for i in rows], [rest[i] for i in rows], self._snapshots[v],
                                           [eps[i].temperature for i in rows])
                terms.append(diff_terms(lp, b[rows], mask[rows]))
        older = any(v != self.version for v in at)
        return self._update(loss, st, rewards, lags, terms, by_lag, t0, time.perf_counter() - ta if older else 0.0, before_update)

    def _loss(self, logp: torch.Tensor, behavior: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        return grpo_loss(logp, behavior, adv.to(logp.device), mask, cfg.clip_eps, tis_cap=cfg.tis_cap,
                         importance_ratio=cfg.importance_ratio, entropy_coef=cfg.entropy_coef)

    def _update(
        self, loss: torch.Tensor, st: dict[str, float], rewards: Sequence[Sequence[float]], lags: list[int],
        terms: list[tuple[torch.Tensor, torch.Tensor]], by_lag: dict[str, list[float]], t0: float, agree_s: float = 0.0,
        before_update: Callable[[], Any] | None = None,
    ) -> StepStats:
        """One Adam step on ``loss``; the next version; the step's stats (``terms``: the
        agreement's ``(|behavior - trainer|, behavior logprob)`` tokens, :func:`agreement_terms`)."""
        by_conf: dict[str, list[float]] = {}
        dsum, dmax, dn = 0.0, 0.0, 0
        for d, beh in terms:
            if d.numel():
                dsum, dmax, dn = dsum + float(d.sum()), max(dmax, float(d.max())), dn + int(d.numel())
                merge_buckets(by_conf, diff_by_confidence(d, beh))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        if before_update is not None:
            before_update()
        self.optimizer.step()
        trained_at = self.version
        self.version += 1
        self._snapshot()
        flat = [x for r in rewards for x in r]
        return StepStats(
            version=trained_at, reward_mean=sum(flat) / max(1, len(flat)), loss=float(loss.detach()),
            clip_frac=st.pop("clip_frac"), lags=lags, diff_sum=dsum, diff_max=dmax, diff_tokens=dn,
            diff_by_lag=by_lag, diff_by_confidence=by_conf, train_s=time.perf_counter() - t0, agree_s=agree_s, extra=st,
        )

    def _diff_by_lag(
        self, logp: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, versions: list[list[int]]
    ) -> dict[str, list[float]]:
        """``{bucket: [sum, max, tokens]}`` of |logp - behavior| by token lag (see :class:`StepStats`)."""
        lag = torch.full(logp.shape, -1, dtype=torch.long)
        for i, vs in enumerate(versions):
            row = torch.tensor(vs, dtype=torch.long)
            lag[i, : len(vs)] = torch.where(row >= 0, self.version - row, torch.full_like(row, -1))
        lag = lag.to(logp.device)
        d = (logp - behavior).abs()
        out: dict[str, list[float]] = {}
        for name, sel in (("0", lag == 0), ("1", lag == 1), ("2+", lag >= 2)):
            sel = sel & mask
            k = int(sel.sum())
            if k:
                out[name] = [float(d[sel].sum()), float(d[sel].max()), k]
        return out


def _versions(result: Any) -> list[list[int]]:
    """The per-token versions of each sample of ``result`` (-1: not known exactly)."""
    return [s.token_versions(result.version_start) for s in result.samples]
