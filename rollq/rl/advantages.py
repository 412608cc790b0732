"""GRPO's advantages: each group's rewards centred on its mean and scaled (by the group's own
std, the batch's, or not at all), the part of :mod:`rollq.rl.grpo` that turns a step's rewards
into the per-sample weights of its policy gradient.

>>> group_advantages(torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
tensor([[-1.0000,  1.0000,  1.0000, -1.0000]])
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SCALE_REWARDS", "group_advantages"]


#: How :func:`group_advantages` scales a group's centred rewards (``GrpoConfig.scale_rewards``).
SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: str = "group") -> torch.Tensor:
    """Group-normalised advantages of a ``[groups, n]`` reward tensor: each reward minus its
    row's mean, 0 for a row whose rewards are all equal (no signal), divided by

    - ``scale="group"`` (GRPO): the row's own std (population std);
    - ``"batch"``: one std, of every row's centred rewards together;
    - ``"none"`` (Dr. GRPO): nothing. A row whose rewards differ only a little then moves the
      policy only a little, where dividing by its own tiny std would give it full-size
      advantages.

    >>> r = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.0, 0.1]])
    >>> group_advantages(r)
    tensor([[-1.0000,  1.0000],
            [ 0.0000,  0.0000],
            [-1.0000,  1.0000]])
    >>> group_advantages(r, scale="none")
    tensor([[-0.5000,  0.5000],
            [ 0.0000,  0.0000],
            [-0.0500,  0.0500]])
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS}, got {scale!r}")
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    centred = torch.where(std > eps, rewards - mean, torch.zeros_like(rewards))
    if scale == "group":
        return centred / (std + eps)
    if scale == "batch":
        return centred / (centred.std(unbiased=False) + eps)
    return centred


def _advantages(rewards: Sequence[Sequence[float]], scale: str = "group") -> torch.Tensor:
    """Per-sample advantages, flat, group by group (:func:`group_advantages`; groups of
    different sizes, e.g. with a failed sample, are centred each on its own; with
    ``scale="batch"`` the std is then taken over all of them)."""
    if len({len(r) for r in rewards}) == 1:
        return group_advantages(torch.tensor([list(r) for r in rewards], dtype=torch.float32), scale=scale).reshape(-1)
    per = "group" if scale == "group" else "none"
    flat = torch.cat([group_advantages(torch.tensor([list(r)], dtype=torch.float32), scale=per)[0] for r in rewards])
    return flat / (flat.std(unbiased=False) + 1e-6) if scale == "batch" else flat
