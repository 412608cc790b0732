"""A pure-PyTorch GRPO probe of the harder tasks: rollq's loss, advantages and logprobs, no vLLM.

The tiny model (``build_tiny_model``) samples its own groups with transformers, one step behind
the trainer (``--lag 1``, as the async loop at max lag 1), and trains with
:func:`rollq.rl.grpo_loss` / :func:`rollq.rl.group_advantages` / :func:`rollq.rl.token_logprobs`,
Adam, grad-norm clip 1.0, the demo's ``lr * decay_after / step`` decay (``--lr-min``: its floor). One thread (as the
demo's trainer). It iterates on a recipe in minutes; a recipe is confirmed through the real
loop (``rollq demo --task ...``), which is what benchmarks/README.md reports.

``--token-credit`` (positional only, probe-side): each output token's advantage is its own
reward (1/4 if in its digit's quarter) normalised within the group at its position, instead
of the sample's; the probe computes that loss itself (the same clipped surrogate).

    python benchmarks/probes/grpo_probe.py --task positional --layers 4 --lr 2e-3 --steps 600 --seed 2
    python benchmarks/probes/grpo_probe.py --task length --lr 5e-3 --group-size 16 --entropy-coef 0.01

Prints the 50-step mean reward as it goes (for ``length`` also the share of samples that
stopped, that stopped after exactly L tokens, and the in-quarter fraction of those that stopped) and one JSON line
at the end (``reward_last``: the last 20 steps; ``reward_heldout`` for positional: 8 samples of
every held-out string at the final weights).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from typing import Any

import torch

from rollq._torch_extras import hide_broken_torch_extras
from rollq.rl import group_advantages, grpo_loss, token_logprobs
from rollq.rl.tasks import LengthTask, PositionalTask, Shaping
from rollq.testing.tiny_model import build_tiny_model


def sample(model: Any, prompts: list[list[int]], n: int, max_tokens: int, eos: tuple[int, ...], gen: torch.Generator):
    """``n`` completions of each prompt (all prompts of one length) at temperature 1, stopping
    a row at an id in ``eos``; their tokens and sampled logprobs."""
    ids = torch.tensor([p for p in prompts for _ in range(n)])
    rows = ids.shape[0]
    out: list[list[int]] = [[] for _ in range(rows)]
    lps: list[list[float]] = [[] for _ in range(rows)]
    done = [False] * rows
    past, inp = None, ids
    with torch.no_grad():
        for _ in range(max_tokens):
            o = model(input_ids=inp, past_key_values=past, use_cache=True)
            past = o.past_key_values
            logp = torch.log_softmax(o.logits[:, -1].float(), -1)
            x = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            for i in range(rows):
                if not done[i]:
                    out[i].append(int(x[i]))
                    lps[i].append(float(logp[i, x[i]]))
                    done[i] = int(x[i]) in eos
            if all(done):
                break
            inp = x.unsqueeze(-1)
    return out, lps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=["positional", "length"], default="positional")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--decay-after", type=int, default=100, help="0: constant lr")
    ap.add_argument("--lr-min", type=float, default=0.0, help="the decay never goes below this (0: no floor)")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--token-credit", action="store_true")
    ap.add_argument("--shaping-hold", type=int, default=-1, help="length: train on LengthTask's Shaping (-1: off)")
    ap.add_argument("--shaping-anneal", type=int, default=0)
    ap.add_argument("--shaping-floor", type=float, default=0.0, help="length: the partial credit's lasting weight")
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=1e9)
    ap.add_argument("--model-dir", default="/tmp/rollq-probe-models")
    a = ap.parse_args()
    torch.set_num_threads(1)
    hide_broken_torch_extras()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(f"{a.model_dir}/layers{a.layers}", layers=a.layers)
    tok = AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    shaping = Shaping(a.shaping_hold, a.shaping_anneal, a.shaping_floor) if a.shaping_hold >= 0 else None
    task: Any = PositionalTask(vocab_size=len(tok)) if a.task == "positional" else LengthTask(vocab_size=len(tok), shaping=shaping)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    actors = [copy.deepcopy(model).eval()]
    rng, gen = random.Random(a.seed), torch.Generator().manual_seed(a.seed + 1)
    n, hist, diag, t0 = a.group_size, [], [], time.time()
    for step in range(a.steps):
        lr = max(a.lr * a.decay_after / step, a.lr_min) if a.decay_after and step > a.decay_after else a.lr
        for g in opt.param_groups:
            g["lr"] = lr
        if a.task == "positional":
            metas: list[Any] = [rng.choice(task.train_strings) for _ in range(a.groups)]
            prompts = [task.prompt_ids(tok, d) for d in metas]
            comps, behav = sample(actors[0], prompts, n, task.digits, (), gen)
            rewards = [task.reward(metas[i // n], c) for i, c in enumerate(comps)]
        else:
            metas = [(rng.randrange(task.quarters), rng.randint(task.min_length, task.max_length)) for _ in range(a.groups)]
            prompts = [task.prompt_ids(tok, q, L) for q, L in metas]
            comps, behav = sample(actors[0], prompts, n, task.max_length + 1, task.eos_ids, gen)
            rewards = [task.reward(*metas[i // n], c) for i, c in enumerate(comps)]
            train = [task.training_reward(*metas[i // n], c, None, step) for i, c in enumerate(comps)]
            for i, c in enumerate(comps):
                body, (q, L) = task.content(c), metas[i // n]
                diag.append((body is not None, body is not None and len(body) == L,
                             sum(task.quarter_of(t) == q for t in body) / max(1, len(body)) if body else 0.0, L,
                             len(body) if body is not None else -1))
        logp, mask = token_logprobs(model, [p for p in prompts for _ in range(n)], comps)
        b = torch.zeros_like(logp)
        for i, lp in enumerate(behav):
            b[i, : len(lp)] = torch.tensor(lp)
        R = torch.tensor(rewards).view(a.groups, n)
        T_R = torch.tensor(train).view(a.groups, n) if a.task == "length" else R
        if a.token_credit and a.task == "positional":
            T = torch.tensor([[float(task.quarter_of(t) == int(d)) / task.digits for d, t in zip(metas[i // n], c)]
                              for i, c in enumerate(comps)]).view(a.groups, n, -1)
            std = T.std(1, keepdim=True, unbiased=False)
            adv = torch.where(std > 1e-6, (T - T.mean(1, keepdim=True)) / (std + 1e-6), torch.zeros_like(T)).view(-1, T.shape[-1])
            ratio = torch.exp(logp - b)
            sur = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = -(sur * mask).sum() / mask.sum()
        else:
            loss, _ = grpo_loss(logp, b, group_advantages(T_R).view(-1), mask, entropy_coef=a.entropy_coef)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        actors.append(copy.deepcopy(model).eval())
        if len(actors) > a.lag + 1:
            actors.pop(0)
        hist.append(float(R.mean()))
        if step % 50 == 49:
            line = f"step {step + 1}: reward {sum(hist[-50:]) / 50:.3f} ({time.time() - t0:.0f} s)"
            if diag:
                d = diag[-50 * a.groups * n :]
                stopped = [x[2] for x in d if x[0]]
                line += (f"  stopped {len(stopped) / len(d):.2f} exact {sum(x[1] for x in d) / len(d):.2f}"
                         f" in-quarter (of those that stopped) {sum(stopped) / max(1, len(stopped)):.2f}")
                by_len = {L: [x for x in d if x[3] == L] for L in range(task.min_length, task.max_length + 1)}
                line += "  exact by L " + " ".join(f"{L}:{sum(x[1] for x in xs) / max(1, len(xs)):.2f}" for L, xs in by_len.items())
                line += "  mean stop by L " + " ".join(
                    f"{L}:{sum(x[4] for x in xs if x[4] >= 0) / max(1, sum(x[4] >= 0 for x in xs)):.1f}" for L, xs in by_len.items())
            print(line, flush=True)
        if time.time() - t0 > a.max_seconds:
            break
    held = None
    if a.task == "positional":
        comps, _ = sample(model.eval(), [task.prompt_ids(tok, s) for s in task.heldout_strings], 8, task.digits, (), gen)
        held = sum(task.reward(task.heldout_strings[i // 8], c) for i, c in enumerate(comps)) / len(comps)
    print(json.dumps({"args": vars(a), "steps": len(hist), "wall_s": round(time.time() - t0, 1),
                      "reward_last": round(sum(hist[-20:]) / len(hist[-20:]), 4), "reward_heldout": held,
                      "reward_by_50": [round(sum(hist[i : i + 50]) / len(hist[i : i + 50]), 3) for i in range(0, len(hist), 50)]}))


if __name__ == "__main__":
    main()
