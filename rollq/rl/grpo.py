"""GRPO on the trainer: advantages, the clipped loss, logprob recomputation, version snapshots.

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
``VllmEngineConfig(logprobs_mode="processed_logprobs")`` returns the logprobs after them. The trainer applies the same temperature to its own logits
(``log_softmax(logits / T)``) and refuses with :class:`SamplingTransformError`, naming the
field, a result whose transform it cannot reproduce (raw logprobs at T != 1, top-p, top-k,
min-p, penalties, greedy samples).

>>> import torch
>>> group_advantages(torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
tensor([[-1.0000,  1.0000],
        [ 0.0000,  0.0000]])

:func:`logprob_agreement` is the end-to-end check of weight sync: the replica's behavior
logprobs of samples generated entirely at version ``v`` must equal the trainer's logprobs at
``v`` to float tolerance; a mis-loaded tensor shows up there first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .._torch_extras import hide_broken_torch_extras

log = logging.getLogger(__name__)

__all__ = [
    "GrpoConfig",
    "GrpoTrainer",
    "SamplingTransformError",
    "behavior_temperature",
    "StepStats",
    "group_advantages",
    "grpo_loss",
    "logprob_agreement",
    "single_version",
    "token_logprobs",
]


# ----------------------------------------------------------------------------------------
# Versions of samples
# ----------------------------------------------------------------------------------------
def single_version(result: Any) -> int | None:
    """The policy version that generated every token of ``result``, or None if several did.

    The one place that decides "entirely at version v": from the per-token versions of its
    samples (:meth:`rollq.protocol.Sample.single_version`), so a result whose span is
    ``(3, 4)`` but whose every token came before version 4 was swapped in counts as version 3.

    >>> from rollq.protocol import Result, Sample, pack_i32
    >>> one = Sample(tokens=pack_i32([5, 6]), versions=[(3, 0), (4, 2)])   # 4 began after the last token
    >>> two = Sample(tokens=pack_i32([5, 6]), versions=[(3, 0), (4, 1)])
    >>> single_version(Result(id="j", version_start=3, version_end=4, samples=[one]))
    3
    >>> single_version(Result(id="j", version_start=3, version_end=4, samples=[one, two])) is None
    True
    """
    if result.version_start == result.version_end:
        return result.version_start
    if not result.samples or any(s.versions is None for s in result.samples):
        return None  # a span without per-token marks: which tokens came from which is unknown
    got = {s.single_version(result.version_start) for s in result.samples}
    return got.pop() if len(got) == 1 else None


# ----------------------------------------------------------------------------------------
# What the behavior logprobs are
# ----------------------------------------------------------------------------------------
class SamplingTransformError(ValueError):
    """A result's behavior logprobs are not the probabilities its tokens were sampled from,
    and the trainer cannot compute the same ones: the message starts with the field."""


#: Temperatures below this are greedy in vLLM (its ``_SAMPLING_EPS``).
_GREEDY_BELOW = 1e-5


def behavior_temperature(result: Any) -> float:
    """The temperature ``T`` at which the trainer's ``log_softmax(logits / T)`` is the
    distribution of ``result``'s behavior logprobs; raises :class:`SamplingTransformError`
    naming the field where no such ``T`` exists.

    >>> from rollq.protocol import LogprobSource, Result, Sample, SamplingParams, pack_i32
    >>> def res(kind, **sp):
    ...     src = LogprobSource.of(SamplingParams(ignore_eos=True, **sp), kind)
    ...     return Result(id="j", samples=[Sample(tokens=pack_i32([5]), lp_source=src)])
    >>> behavior_temperature(res("processed", temperature=0.7))
    0.7
    >>> behavior_temperature(res("raw", temperature=0.7))
    Traceback (most recent call last):
    ...
    rollq.rl.grpo.SamplingTransformError: temperature=0.7: job 'j' holds vLLM's raw logprobs ...
    >>> behavior_temperature(res("processed", top_p=0.9))
    Traceback (most recent call last):
    ...
    rollq.rl.grpo.SamplingTransformError: top_p=0.9: the trainer cannot apply the same transform; ...
    """
    temps = {_sample_temperature(result.id, s.logprob_source) for s in result.samples}
    if len(temps) > 1:
        raise SamplingTransformError(f"temperature: the samples of job {result.id!r} were drawn at {sorted(temps)}")
    return temps.pop() if temps else 1.0


def _sample_temperature(job_id: str, src: Any) -> float:
    if src.temperature < _GREEDY_BELOW:
        raise SamplingTransformError(
            f"temperature={src.temperature!r}: job {job_id!r} was sampled greedily, which has no "
            "distribution to take a ratio with; sample at a temperature > 0")
    changed = src.transformed()
    if src.kind == "raw":
        if changed:
            raise SamplingTransformError(
                f"{changed[0]}: job {job_id!r} holds vLLM's raw logprobs (of the logits before "
                "the sampling transform), not the probabilities its tokens were sampled from; serve it "
                "from a replica with VllmEngineConfig(logprobs_mode='processed_logprobs'), or sample "
                "at temperature 1 with no top-p, top-k, min-p or penalties")
        return 1.0
    beyond = [c for c in changed if not c.startswith("temperature=")]
    if beyond:
        raise SamplingTransformError(
            f"{beyond[0]}: the trainer cannot apply the same transform; job {job_id!r} must be "
            "sampled with it at its neutral value (the trainer reproduces the temperature only)")
    return float(src.temperature)


# ----------------------------------------------------------------------------------------
# Pure functions: advantages and loss
# ----------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages of a ``[groups, n]`` reward tensor: ``(r - mean) / std``
    per row (population std), 0 for a row whose rewards are all equal (no signal)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    adv = (rewards - mean) / (std + eps)
    return torch.where(std > eps, adv, torch.zeros_like(adv))


def grpo_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    *,
    tis_cap: float | None = None,
    importance_ratio: bool = True,
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
# Logprobs of given tokens
# ----------------------------------------------------------------------------------------
class _PickedLogprobs(torch.nn.Module):
    """Logprobs of chosen tokens at chosen positions: the decoder runs on the whole batch, the
    LM head only on the positions that predict completion tokens (the head's matmul and its
    backward are most of the cost otherwise). A module, so ``functional_call`` can swap in
    the weights of another version (parameter names: ``lm.`` + the model's)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor, temp: torch.Tensor | None
    ) -> torch.Tensor:
        decoder = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model
        hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state
        h = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        logits = self.lm.get_output_embeddings()(h).float()
        if temp is not None:  # per row, in float32, as vLLM's sampler divides
            logits = logits / temp.view(-1, 1, 1)
        return torch.log_softmax(logits, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    state: Mapping[str, torch.Tensor] | None = None,
    temperature: float | Sequence[float] = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each completion's tokens after its prompt, in one right-padded batch.

    Returns ``(logp, mask)``, both ``[len(completions), longest completion]`` (float32).
    With ``state`` the model is evaluated at those weights (``torch.func.functional_call``)
    instead of its own. ``temperature`` (one, or one per completion): the logprobs are
    ``log_softmax(logits / T)``, those of sampling at ``T``. Gradients flow unless called
    under ``torch.no_grad()``.

    >>> logp, mask = token_logprobs(model, [[5, 6, 7]], [[100, 200]])   # doctest: +SKIP
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    n = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    longest = max((len(c) for c in completions), default=0)
    ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    pos = torch.zeros(n, max(1, longest), dtype=torch.long)
    tok = torch.zeros(n, max(1, longest), dtype=torch.long)
    mask = torch.zeros(n, max(1, longest), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        # The position predicting completion token j is len(prompt) + j - 1 (padding: any valid one).
        pos[i] = len(p) - 1
        pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        tok[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        mask[i, : len(c)] = True
    temps = [float(temperature)] * n if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if len(temps) != n:
        raise ValueError(f"{len(temps)} temperatures for {n} completions")
    dev = next(model.parameters()).device
    temp = None if all(t == 1.0 for t in temps) else torch.tensor(temps, dtype=torch.float32, device=dev)
    picker = _PickedLogprobs(model)
    args = (ids.to(dev), attn.to(dev), pos.to(dev), tok.to(dev), temp)
    if state is None:
        logp = picker(*args)
    else:
        logp = torch.func.functional_call(picker, {f"lm.{k}": v for k, v in state.items()}, args)
    mask = mask.to(dev)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    return logp[:, :longest], mask[:, :longest]


def _behavior(results: Sequence[Any]) -> tuple[list[list[float]], list[float]]:
    """The behavior logprobs of every sample of ``results`` and the temperature of each
    (:func:`behavior_temperature`; raises :class:`SamplingTransformError`)."""
    out, temps = [], []
    for r in results:
        t = behavior_temperature(r)
        for s in r.samples:
            lp = s.token_logprobs
            if lp is None or len(lp) != len(s.tokens) // 4:
                raise ValueError(f"job {r.id!r}: samples need per-token logprobs (submit with sampling logprobs=0)")
            out.append(lp)
            temps.append(t)
    return out, temps


def logprob_agreement(
    model: torch.nn.Module,
    results: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    state: Mapping[str, torch.Tensor] | None = None,
) -> tuple[float, float, int]:
    """Mean and max absolute difference between the replica's behavior logprobs and the
    trainer's logprobs of the same tokens, and the number of tokens compared.

    ``results[i]`` was generated from ``prompts[i]`` at the version whose weights are the
    model's (or ``state``). Callers pass only results generated entirely at that version
    (:func:`single_version`). The trainer's logprobs are taken at each result's
    :func:`behavior_temperature` (a result whose transform it cannot apply raises
    :class:`SamplingTransformError`). Float32 on CPU agrees to ~1e-6 per token on the tiny
    model; a stale or mis-loaded tensor gives differences of order 0.1 or more.

    >>> mean, worst, n = logprob_agreement(model, results, prompts)   # doctest: +SKIP
    """
    rows = [(prompts[i], s.token_ids) for i, r in enumerate(results) for s in r.samples]
    if not rows:
        return 0.0, 0.0, 0
    behavior, temps = _behavior(results)
    with torch.no_grad():
        logp, mask = token_logprobs(model, [p for p, _ in rows], [c for _, c in rows], state, temps)
    return _diff(logp, mask, behavior)


def _padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.shape, dtype=like.dtype)
    for i, lp in enumerate(rows):
        out[i, : len(lp)] = torch.tensor(lp, dtype=like.dtype)
    return out.to(like.device)


def _diff(logp: torch.Tensor, mask: torch.Tensor, behavior: list[list[float]]) -> tuple[float, float, int]:
    b = _padded(behavior, logp)
    d = (logp.detach() - b).abs()[mask]
    if d.numel() == 0:
        return 0.0, 0.0, 0
    return float(d.mean()), float(d.max()), int(d.numel())


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

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: off), got {self.max_grad_norm!r}")
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
    train_s: float = 0.0
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

    def step(self, batch: Sequence[tuple[Sequence[int], Any]], rewards: Sequence[Sequence[float]]) -> StepStats:
        """One GRPO update on ``batch`` (``(prompt_ids, result)`` per group) with per-sample ``rewards``."""
        t0 = time.perf_counter()
        prompts, comps, owner = [], [], []
        for g, (prompt, res) in enumerate(batch):
            for s in res.samples:
                prompts.append(prompt)
                comps.append(s.token_ids)
                owner.append(g)
        behavior, temps = _behavior([r for _, r in batch])  # refuses what it cannot reproduce
        widths = {len(r) for r in rewards}
        if len(widths) == 1:
            adv_g = group_advantages(torch.tensor([list(r) for r in rewards], dtype=torch.float32))
            adv = adv_g.reshape(-1)
        else:  # groups of different sizes (a failed sample): normalise each on its own
            adv = torch.cat([group_advantages(torch.tensor([list(r)], dtype=torch.float32))[0] for r in rewards])
        logp, mask = token_logprobs(self.model, prompts, comps, temperature=temps)
        b = _padded(behavior, logp)
        cfg = self.config
        loss, st = grpo_loss(logp, b, adv.to(logp.device), mask, cfg.clip_eps, tis_cap=cfg.tis_cap,
                             importance_ratio=cfg.importance_ratio)
        by_lag = self._diff_by_lag(logp.detach(), b, mask, [vs for _, r in batch for vs in _versions(r)])
        # Agreement: groups generated entirely at the current version use this forward pass.
        lags = [self.version - res.version_start for _, res in batch]
        dsum, dmax, dn = 0.0, 0.0, 0
        cur = [i for i, g in enumerate(owner) if single_version(batch[g][1]) == self.version]
        if cur:
            d = (logp.detach()[cur] - b[cur]).abs()[mask[cur]]
            dsum, dmax, dn = float(d.sum()), float(d.max()), int(d.numel())
        older: dict[int, list[int]] = {}
        for g, (_, res) in enumerate(batch):
            v = single_version(res)
            if v is not None and v != self.version and v in self._snapshots:
                older.setdefault(v, []).append(g)
        for v, groups in older.items():
            m, mx, n = logprob_agreement(self.model, [batch[g][1] for g in groups], [batch[g][0] for g in groups], self._snapshots[v])
            dsum, dmax, dn = dsum + m * n, max(dmax, mx), dn + n
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        trained_at = self.version
        self.version += 1
        self._snapshot()
        flat = [x for r in rewards for x in r]
        return StepStats(
            version=trained_at, reward_mean=sum(flat) / max(1, len(flat)), loss=float(loss.detach()),
            clip_frac=st.pop("clip_frac"), lags=lags, diff_sum=dsum, diff_max=dmax, diff_tokens=dn,
            diff_by_lag=by_lag, train_s=time.perf_counter() - t0, extra=st,
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
