"""The reward and policy-lag plot of an RL run: a PNG (matplotlib, Agg backend) beside a JSON
of the same data.

>>> png = plot_run(report.per_step(), "/tmp/rollq-demo.png", random_policy_reward=0.25)  # doctest: +SKIP
>>> # /tmp/rollq-demo.png and /tmp/rollq-demo.json
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

__all__ = ["plot_run"]


def plot_run(
    steps: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    random_policy_reward: float | None = None,
    title: str = "rollq GRPO run",
) -> Path:
    """Write ``path`` (PNG: reward per step above, mean and max policy lag below) and the data
    as ``path`` with a ``.json`` suffix. ``steps`` are :meth:`LoopReport.per_step` dicts
    (``step``, ``reward``, ``lags``). Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    xs = [int(s["step"]) for s in steps]
    reward = [float(s["reward"]) for s in steps]
    lag_mean = [sum(s["lags"]) / len(s["lags"]) if s["lags"] else 0.0 for s in steps]
    lag_max = [max(s["lags"], default=0) for s in steps]
    data = {"title": title, "step": xs, "reward": reward, "lag_mean": lag_mean, "lag_max": lag_max,
            "random_policy_reward": random_policy_reward}
    path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    ax1.plot(xs, reward, marker=".", label="mean reward of the step's samples")
    if random_policy_reward is not None:
        ax1.axhline(random_policy_reward, color="gray", linestyle="--", label=f"random policy ({random_policy_reward:g})")
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("reward")
    ax1.set_title(title)
    ax1.legend(loc="lower right")
    ax1.grid(alpha=0.3)
    ax2.step(xs, lag_mean, where="mid", label="mean")
    ax2.step(xs, lag_max, where="mid", linestyle=":", label="max")
    ax2.set_ylabel("policy lag")
    ax2.set_xlabel("trainer step")
    ax2.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log.info("plot written to %s", path)
    return path
