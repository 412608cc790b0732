"""results_to_llm_tensordict fed to TorchRL's own GRPOLoss (a real TransformersWrapper around
the tiny model, no engine): the layout's padding keeps the prompt out of the importance ratio."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl")
import torch  # noqa: E402

from rollq.protocol import Result, Sample, pack_f32, pack_i32  # noqa: E402
from rollq.torchrl import results_to_llm_tensordict  # noqa: E402


@pytest.fixture(scope="module")
def actor(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from torchrl.modules.llm import TransformersWrapper

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                               return_log_probs=True, pad_output=False)


def _results(actor, prompts, completions):
    """One result per prompt (one sample each) whose behaviour logprobs are the actor's own."""
    draft = [Result(id=f"j{i}", samples=[Sample(tokens=pack_i32(c), logprobs=pack_f32([0.0] * len(c)))])
             for i, c in enumerate(completions)]
    td = results_to_llm_tensordict(draft, prompts=prompts)
    with torch.no_grad():
        scored = actor(td.select(("tokens", "full"), ("masks", "all_attention_mask")))
    full = scored.get(("log_probs", "full"), as_list=True)
    return [Result(id=f"j{i}", samples=[Sample(tokens=pack_i32(c), logprobs=pack_f32(full[i][-len(c):].tolist()))])
            for i, c in enumerate(completions)]


@pytest.mark.parametrize("masking", ["generic", "sft"])
def test_grpo_loss_sees_no_clipping_when_the_policy_is_the_behaviour_policy(actor, masking):
    from torchrl.objectives.llm import GRPOLoss

    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    completions = [[100, 200, 300], [7, 8, 9, 10]]
    td = results_to_llm_tensordict(_results(actor, prompts, completions), prompts=prompts)
    td.set("advantage", torch.tensor([[[1.0]], [[-1.0]]]))
    loss = GRPOLoss(actor, masking_strategy=masking, clip_epsilon=0.2, entropy_bonus=False)
    out = loss(td)
    # The same weights score the same tokens: every ratio is 1 (a 0.0 pad over the prompt made
    # "generic" masking take the prompt positions into the ratio, and clip most of them).
    assert float(out.clip_fraction) == 0.0
    assert torch.isfinite(out.loss_objective).all()
    full = td.get(("log_probs", "full"), as_list=True)
    assert all(bool(f[: len(p)].isnan().all()) for f, p in zip(full, prompts))  # TorchRL's pad
