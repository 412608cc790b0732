"""The logprob agreement check shared by the weight-sync tests through real vLLM: after an
update, a replica's behavior logprobs equal the trainer's at that version."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from rollq.rl import logprob_agreement, single_version

#: What float32 on CPU must reach (measured: ~3e-7 mean, ~3e-6 max on the tiny model).
AGREEMENT_MEAN = 1e-3
AGREEMENT_MAX = 1e-2


def trainer_model(path: str | Path) -> torch.nn.Module:
    """The tiny model as a trainer holds it (transformers, float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """A new "trainer version": every tensor moved by noise of the init's scale."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g) * scale for k, v in state.items()}


async def agreement(p: Any, model: torch.nn.Module, state: Any, version: int, prompts: Sequence[Sequence[int]],
                    sampling: dict[str, Any], timeout: float = 120) -> tuple[float, float, int]:
    """Generate ``prompts`` at ``version`` through producer ``p``; (mean, max, tokens) of the
    difference from ``model``'s logprobs with ``state`` loaded."""
    hs = await p.submit_many([{"prompt_token_ids": pr, "sampling": sampling, "min_version": version} for pr in prompts])
    results = await p.gather(hs, timeout=timeout)
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(single_version(r) == version for r in results), [r.policy_version for r in results]
    return logprob_agreement(model, results, prompts, state=state)
