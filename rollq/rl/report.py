"""What a run of the RL loop measured: :class:`StepRecord` per step, :class:`LoopReport` for
the run (its :meth:`~LoopReport.summary` makes the figures of ``rollq demo`` and
``benchmarks/rl_loop.py``), and the replicas' :func:`busy_fraction`."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .behavior import CONFIDENCE_BUCKETS, merge_buckets

if TYPE_CHECKING:
    from .loop_config import LoopConfig

__all__ = ["LoopReport", "StepRecord", "busy_fraction", "mean"]


@dataclass
class StepRecord:
    """One step of the loop (times in seconds)."""

    step: int
    #: Trainer version the step's gradient was computed at.
    version: int
    reward: float
    #: Policy lag of each group trained on (trainer version minus the group's version_start).
    lags: list[int]
    #: Waiting for the batch's results (the trainer stood still).
    wait_s: float
    train_s: float
    publish_s: float
    #: Seconds since the loop started, at the end of the step.
    elapsed_s: float
    tokens: int
    #: Distinct version_start of the groups trained on.
    sample_versions: list[int] = field(default_factory=list)
    failed: int = 0
    #: Tokens whose version differs from their sample's first token's (a swap landed before
    #: them, mid-sample), or is not known exactly.
    swap_tokens: int = 0
    #: Samples (episodes, for a multi-turn task) whose tokens came from more than one version.
    spanning: int = 0
    loss: float = 0.0
    clip_frac: float = 0.0
    diff_sum: float = 0.0
    diff_max: float = 0.0
    diff_tokens: int = 0
    #: :attr:`~rollq.rl.grpo.StepStats.diff_by_lag`: ``{"0"|"1"|"2+": [sum, max, tokens]}``.
    diff_by_lag: dict[str, list[float]] = field(default_factory=dict)
    #: Of ``train_s``, the diagnostic agreement forwards (:attr:`~rollq.rl.grpo.StepStats.agree_s`).
    agree_s: float = 0.0
    #: CPU time of the event loop's thread while the step trained in a thread of its own: the
    #: work (replicas hosted in this process, producer, publisher) the step's operators wait
    #: behind for the interpreter lock; an upper bound on that wait's cause, since it counts
    #: C code run without the lock too.
    loop_cpu_s: float = 0.0
    #: :attr:`~rollq.rl.grpo.StepStats.diff_by_confidence`: the agreement by behavior probability.
    diff_by_confidence: dict[str, list[float]] = field(default_factory=dict)
    #: The loss's other stats (``ratio_mean``, ``ratio_max``, ``tis_frac``; :func:`~rollq.rl.grpo.grpo_loss`).
    loss_stats: dict[str, float] = field(default_factory=dict)


@dataclass
class LoopReport:
    """Everything a run measured; :meth:`summary` makes the figures of ``rollq demo``."""

    config: LoopConfig
    steps: list[StepRecord]
    wall_s: float
    random_policy_reward: float
    #: Wall-clock window of the loop (unix seconds) and (replica, started, finished) of each job.
    window: tuple[float, float] = (0.0, 0.0)
    jobs: list[tuple[str, float, float]] = field(default_factory=list)
    #: The followers' UpdateStats (filled by the caller that owns the replicas).
    updates: list[Any] = field(default_factory=list)
    #: The trainer's version at the end (= versions published after the initial one).
    final_version: int = 0

    def reward_by_step(self) -> list[float]:
        return [s.reward for s in self.steps]

    def time_to_reward(self, target: float, window: int = 3) -> float | None:
        """Seconds until the trailing mean of ``window`` step rewards first reached ``target``."""
        n = self.steps_to_reward(target, window)
        return self.steps[n - 1].elapsed_s if n else None

    def steps_to_reward(self, target: float, window: int = 3) -> int | None:
        """Steps (1-based) until the trailing mean of ``window`` step rewards first reached
        ``target`` (:meth:`time_to_reward` in steps)."""
        r = self.reward_by_step()
        for i in range(len(r)):
            seg = r[max(0, i - window + 1) : i + 1]
            if len(seg) == min(window, len(r)) and sum(seg) / len(seg) >= target:
                return i + 1
        return None

    def summary(self) -> dict[str, Any]:
        r = self.reward_by_step()
        lags = Counter(lag for s in self.steps for lag in s.lags)
        dn = sum(s.diff_tokens for s in self.steps)
        tokens = sum(s.tokens for s in self.steps)
        train_s = sum(s.train_s for s in self.steps)
        by_lag: dict[str, list[float]] = {}
        by_conf: dict[str, list[float]] = {}
        for s in self.steps:
            merge_buckets(by_lag, s.diff_by_lag)
            merge_buckets(by_conf, s.diff_by_confidence)
        upd = [u.update_s for u in self.updates]
        pause = [u.pause_s for u in self.updates]
        return {
            "mode": self.config.mode,
            "publish": self.config.publish,
            "max_lag": self.config.max_lag if self.config.mode == "async" else 0,
            "steps": len(self.steps),
            "groups_per_step": self.config.groups_per_step,
            "group_size": self.config.group_size,
            "reward_by_step": [round(x, 4) for x in r],
            "reward_first": round(mean(r[:3]), 4),
            "reward_last": round(mean(r[-5:]), 4),
            "random_policy_reward": self.random_policy_reward,
            "versions": self.final_version,
            "versions_sampled": sorted({v for s in self.steps for v in s.sample_versions}),
            "lag_histogram": {str(k): lags[k] for k in sorted(lags)},
            "weight_update_s": round(mean(upd), 4),
            "weight_update_s_max": round(max(upd, default=0.0), 4),
            "pause_s": round(mean(pause), 4),
            "pause_s_max": round(max(pause, default=0.0), 4),
            "update_transports": dict(Counter(u.transport for u in self.updates)),
            "rollout_tokens": tokens,
            "rollout_tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "replica_idle_fraction": round(1.0 - busy_fraction(self.jobs, self.window), 4),
            "logprob_abs_diff_mean": sum(s.diff_sum for s in self.steps) / dn if dn else None,
            "logprob_abs_diff_max": max((s.diff_max for s in self.steps), default=0.0) if dn else None,
            "logprob_tokens_compared": dn,
            "logprob_abs_diff_by_lag": _bucket_means(by_lag, ("0", "1", "2+")),
            "logprob_abs_diff_by_confidence": _bucket_means(by_conf, [k for k, _, _ in CONFIDENCE_BUCKETS]),
            "swap_tokens": sum(s.swap_tokens for s in self.steps),
            "swap_token_share": round(sum(s.swap_tokens for s in self.steps) / tokens, 4) if tokens else 0.0,
            "spanning_samples": sum(s.spanning for s in self.steps),
            "clip_frac_mean": round(mean([s.clip_frac for s in self.steps]), 4),
            "time_to_reward_0.8_s": None if (t8 := self.time_to_reward(0.8)) is None else round(t8, 3),
            "steps_to_reward_0.8": self.steps_to_reward(0.8),
            "seconds_per_step": round(self.wall_s / len(self.steps), 4) if self.steps else None,
            "failed_jobs": sum(s.failed for s in self.steps),
            "step_wait_s": round(sum(s.wait_s for s in self.steps), 3),
            "step_train_s": round(train_s, 3),
            "step_agree_s": round(sum(s.agree_s for s in self.steps), 3), "agree_every": self.config.agree_every,
            "train_loop_cpu_share": round(sum(s.loop_cpu_s for s in self.steps) / train_s, 4) if train_s else None,
            "step_publish_s": round(sum(s.publish_s for s in self.steps), 3),
            "wall_s": round(self.wall_s, 3),
        }

    def per_step(self) -> list[dict[str, Any]]:
        """The per-step records as plain dicts (JSON)."""
        return [asdict(s) for s in self.steps]


def _bucket_means(acc: dict[str, list[float]], order: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{bucket: {mean, max, tokens}}`` of ``[sum, max, tokens]`` buckets, in ``order``."""
    return {k: {"mean": acc[k][0] / acc[k][2], "max": acc[k][1], "tokens": int(acc[k][2])} for k in order if k in acc}


def busy_fraction(jobs: Sequence[tuple[str, float, float]], window: tuple[float, float]) -> float:
    """Mean over replicas of the share of ``window`` in which the replica ran at least one job.

    >>> busy_fraction([("a", 0, 2), ("a", 1, 3), ("b", 0, 1)], (0, 4))
    0.5
    """
    t0, t1 = window
    if t1 <= t0 or not jobs:
        return 0.0
    by: dict[str, list[tuple[float, float]]] = {}
    for rep, s, e in jobs:
        by.setdefault(rep, []).append((max(s, t0), min(e, t1)))
    shares = []
    for spans in by.values():
        spans.sort()
        busy, end = 0.0, t0
        for s, e in spans:
            s = max(s, end)
            if e > s:
                busy += e - s
                end = e
        shares.append(busy / (t1 - t0))
    return sum(shares) / len(shares)


def mean(xs: Sequence[float]) -> float:
    """The mean of ``xs`` (0.0 when empty)."""
    return sum(xs) / len(xs) if xs else 0.0
