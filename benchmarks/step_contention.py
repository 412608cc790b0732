"""A GRPO trainer step alone and beside a thread that holds the interpreter part of the time:

    python benchmarks/step_contention.py [--busy 0.2 0.5] [--before REV|DIR] [--device cpu|cuda]
                                         [--model-size tiny|small|medium] [--reps 12]
                                         [--out benchmarks/results/step_contention]

The RL loop trains in a thread of the process whose event loop serves the replicas (their
vLLM clients, the consumers, the producer). PyTorch's Python bindings release the
interpreter lock around every operator, so a training step of a few thousand operators asks
for the lock back a few thousand times; while another thread runs Python, each such request
can wait up to ``sys.getswitchinterval()``. Here a thread alternates bursts of pure Python (1
ms) with sleeps, holding the lock ``--busy`` of the time (0: no thread), while the step runs
on ``rollq demo``'s bucket-task batch shape (16 groups of 8 samples, prompts of 12 tokens,
completions of 4, one version old, no agreement forward, as an async lag-1 step).
``--before`` adds :class:`GrpoTrainer` of another revision (a git revision, or a folder
holding its ``rollq`` package: ``git archive REV rollq | tar -x -C DIR``), its steps taking
turns with the working tree's, for a change to the step. Medians of ``--reps``; results go
to ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _report import write_results  # noqa: E402
from ab_revision import import_revision  # noqa: E402

GROUPS, SIZE, PROMPT, COMPLETION = 16, 8, 12, 4
#: Length of each burst of Python work of the busy thread.
BURST_S = 0.001


def make_batch(pkg, version: int, vocab: int, rng: random.Random) -> list[tuple[list[int], object]]:
    """One step's groups as ``pkg``'s results (its own protocol classes), one version old."""
    proto = pkg.protocol
    out = []
    for g in range(GROUPS):
        prompt = [rng.randrange(4, vocab) for _ in range(PROMPT)]
        samples = [proto.Sample(tokens=proto.pack_i32([rng.randrange(4, vocab) for _ in range(COMPLETION)]),
                                logprobs=proto.pack_f32([-rng.random() * 3 for _ in range(COMPLETION)]))
                   for _ in range(SIZE)]
        out.append((prompt, proto.Result(id=f"g{g}", samples=samples, version_start=version - 1, version_end=version - 1)))
    return out


def busy(stop: threading.Event, share: float) -> None:
    """Bursts of pure Python work of :data:`BURST_S` between sleeps, ``share`` of the time."""
    x = 0
    idle = BURST_S * (1 - share) / share
    while not stop.is_set():
        end = time.perf_counter() + BURST_S
        while time.perf_counter() < end:
            for i in range(100):
                x = (x * 31 + i) % 1000003
        time.sleep(idle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=float, nargs="+", default=[0.2, 0.5],
                    help="shares of the time the other thread holds the interpreter (0 < x < 1); 'alone' always runs")
    ap.add_argument("--before", help="git revision (or folder with its rollq package) whose trainer takes turns with this one's")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", default="medium", choices=("tiny", "small", "medium"))
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_contention"))
    a = ap.parse_args()
    if any(not 0 < x < 1 for x in a.busy):
        ap.error("--busy takes shares between 0 and 1")
    from rl_loop import model_dir

    roots = [("after" if a.before else "tree", "rollq")]
    if a.before:
        roots.insert(0, ("before", import_revision(a.before).__name__))
    pkgs = {name: SimpleNamespace(rl=importlib.import_module(f"{root}.rl"), protocol=importlib.import_module(f"{root}.protocol"))
            for name, root in roots}
    model = model_dir(a.model_size)
    trainers = {name: pkg.rl.GrpoTrainer.from_pretrained(model, pkg.rl.GrpoConfig(lr=1e-4, tis_cap=2.0), seed=0).to(a.device)
                for name, pkg in pkgs.items()}
    vocab = next(iter(trainers.values())).model.config.vocab_size
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    rng = random.Random(0)

    def step(name: str) -> float:
        tr = trainers[name]
        batch = make_batch(pkgs[name], tr.version, vocab, rng)
        rewards = [[float(rng.random() < 0.5) for _ in range(SIZE)] for _ in range(GROUPS)]
        sync()
        t0 = time.perf_counter()
        tr.step(batch, rewards, agreement=False)
        sync()
        return time.perf_counter() - t0

    times: dict[tuple[float, str], list[float]] = {}
    for share in [0.0, *a.busy]:
        stop = threading.Event()
        spinner = threading.Thread(target=busy, args=(stop, share), daemon=True)
        if share:
            spinner.start()
        try:
            for name in pkgs:  # warm-up
                step(name)
            for _ in range(a.reps):
                for name in pkgs:
                    times.setdefault((share, name), []).append(step(name))
                    print(f"busy {share} {name} {times[(share, name)][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        finally:
            stop.set()
            if spinner.is_alive():
                spinner.join()
    alone = {name: statistics.median(times[(0.0, name)]) for name in pkgs}
    rows = [{"busy": share, "trainer": name, "median_ms": round(statistics.median(v) * 1e3, 2),
             "min_ms": round(min(v) * 1e3, 2), "max_ms": round(max(v) * 1e3, 2),
             "over_alone": round(statistics.median(v) / alone[name], 3)} for (share, name), v in times.items()]
    data = {"command": "python benchmarks/step_contention.py " + " ".join(sys.argv[1:]), "device": a.device,
            "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None, "model_size": a.model_size,
            "before": a.before, "reps": a.reps, "switch_interval_s": sys.getswitchinterval(),
            "batch": {"groups": GROUPS, "group_size": SIZE, "prompt": PROMPT, "completion": COMPLETION}, "rows": rows}
    md = ["# A GRPO step alone and beside a thread holding the interpreter part of the time", "",
          f"`{data['command']}` ({a.device}{', ' + data['gpu'] if data['gpu'] else ''}; {a.model_size} model; "
          f"{GROUPS} x {SIZE} samples, prompt {PROMPT}, completion {COMPLETION}; median of {a.reps}"
          f"{', the trainers taking turns' if a.before else ''})", "",
          "| other thread busy | trainer | ms [min, max] | over alone |", "| --- | --- | --- | --- |"]
    md += [f"| {r['busy']:.0%} | {r['trainer']} | {r['median_ms']} [{r['min_ms']}, {r['max_ms']}] | {r['over_alone']} |" for r in rows]
    write_results(a.out, data, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
