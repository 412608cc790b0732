"""The trainer's forward and backward over a GRPO batch: each distinct prompt through the decoder
once, its key/value cache shared by the group's samples (``token_logprobs``' default), against
every row run whole (``share_prompts=False``), interleaved in one run.

    python benchmarks/trainer_step.py [--device cpu|cuda] [--model-size tiny|small|medium]
                                      [--shapes length,positional,long] [--reps 8] [--threads 1]
                                      [--out benchmarks/results/trainer_step]

A shape is ``groups x group size``, a prompt length and completion lengths drawn uniformly
from a range (seeded): ``length`` is ``rollq demo --task length``'s batch (8 x 32, prompts of 8
tokens, completions of 2-9), ``positional`` that task's (16 x 16, 4 + 4), ``long`` an LLM-like
one (4 x 16, prompts of 512, completions of 32-128). Each repetition times ``token_logprobs``,
a loss and ``backward`` (what :meth:`~rollq.rl.grpo.GrpoTrainer.step` spends almost all of
its time on) for both arms back to back; the figures are medians. ``max_abs_diff`` is the
largest logprob difference between the arms (float rounding). ``--threads`` sets torch's CPU
threads (the demo's trainer runs on one core). Results: ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (groups, group size, prompt length, shortest completion, longest completion)
SHAPES = {
    "length": (8, 32, 8, 2, 9),
    "positional": (16, 16, 4, 4, 4),
    "long": (4, 16, 512, 32, 128),
}


def batch(shape: str, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    groups, size, plen, lo, hi = SHAPES[shape]
    rng = random.Random(seed)
    prompts, comps = [], []
    for _ in range(groups):
        p = [rng.randrange(4, vocab) for _ in range(plen)]
        for _ in range(size):
            prompts.append(p)
            comps.append([rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))])
    return prompts, comps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-size", default="tiny", choices=("tiny", "small", "medium"))
    ap.add_argument("--shapes", default="length,positional,long")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trainer_step"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from benchmarks.rl_loop import model_dir
    from rollq.rl.behavior import token_logprobs
    from rollq.rl.grpo import GrpoTrainer

    model = GrpoTrainer.from_pretrained(model_dir(a.model_size)).to(a.device).model
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)

    def once(prompts: list[list[int]], comps: list[list[int]], share: bool) -> tuple[float, torch.Tensor]:
        sync()
        t0 = time.perf_counter()
        logp, mask = token_logprobs(model, prompts, comps, share_prompts=share)
        (logp * mask).sum().backward()
        sync()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, logp.detach()

    rows = []
    for shape in a.shapes.split(","):
        prompts, comps = batch(shape, vocab)
        for share in (True, False):  # warm-up
            once(prompts, comps, share)
        times: dict[bool, list[float]] = {True: [], False: []}
        diff = 0.0
        for _ in range(a.reps):
            (ts, la), (tw, lb) = once(prompts, comps, True), once(prompts, comps, False)
            times[True].append(ts)
            times[False].append(tw)
            diff = max(diff, float((la - lb).abs().max()))
        shared, whole = statistics.median(times[True]), statistics.median(times[False])
        g, n, plen, lo, hi = SHAPES[shape]
        row = {"shape": shape, "groups": g, "group_size": n, "prompt_len": plen, "completion_len": [lo, hi],
               "shared_s": round(shared, 5), "whole_s": round(whole, 5), "speedup": round(whole / shared, 3),
               "max_abs_diff": diff}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    out = {"device": a.device, "model_size": a.model_size, "threads": a.threads, "reps": a.reps,
           "torch": torch.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=1))
    md = [f"Trainer forward + backward per GRPO batch ({a.model_size} model, {a.device}, {a.threads} thread(s), "
          f"median of {a.reps})", "",
          "| shape | groups x size | prompt | completion | shared prompts s | whole rows s | speedup | max logprob diff |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['shape']} | {r['groups']} x {r['group_size']} | {r['prompt_len']} | {r['completion_len'][0]}-"
           f"{r['completion_len'][1]} | {r['shared_s']:.4f} | {r['whole_s']:.4f} | {r['speedup']:.2f}x | "
           f"{r['max_abs_diff']:.1e} |" for r in rows]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
