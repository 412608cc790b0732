"""A GRPO trainer step that reads its figures back one by one against once at its end, alone
and beside a busy Python thread, both in one run:

    python benchmarks/step_reads.py [--before REV|DIR] [--device cpu|cuda] [--model-size tiny|small|medium]
                                    [--reps 20] [--out benchmarks/results/step_reads]

The RL loop trains in a thread of the process whose event loop serves the replicas' results.
Each read of a GPU tensor's value (``float(t)``, a boolean-mask index, a blocking copy to the
GPU) waits for the device's queue, and then for the interpreter lock, which the busy thread
gives up only every ``sys.getswitchinterval()``. ``before`` is :class:`GrpoTrainer` at
``--before`` (a git revision, or a folder holding its ``rollq`` package: ``git archive REV
rollq | tar -x -C DIR``), ``after`` the working tree's, each with its own copy of the model;
their steps take turns on the same batch shape (``rollq demo``'s bucket task: 16 groups of 8
samples, prompts of 12 tokens, completions of 4, one version old, as an async lag-1 step
without the agreement forward). ``busy``: a thread spins in Python meanwhile. Medians of
``--reps``; results go to ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
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


def busy(stop: threading.Event) -> None:
    """Pure Python work, as an event loop decoding results keeps the interpreter."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x = (x * 31 + i) % 1000003


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="83edf7e", help="git revision (or folder with its rollq package) of 'before'")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-size", default="medium", choices=("tiny", "small", "medium"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_reads"))
    a = ap.parse_args()
    import importlib

    from rl_loop import model_dir

    old = import_revision(a.before)
    model = model_dir(a.model_size)
    pkgs = {name: SimpleNamespace(rl=importlib.import_module(f"{root}.rl"), protocol=importlib.import_module(f"{root}.protocol"))
            for name, root in (("before", old.__name__), ("after", "rollq"))}
    trainers = {name: pkg.rl.GrpoTrainer.from_pretrained(model, pkg.rl.GrpoConfig(lr=1e-4, tis_cap=2.0), seed=0).to(a.device)
                for name, pkg in pkgs.items()}
    vocab = trainers["after"].model.config.vocab_size
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

    times: dict[tuple[str, str], list[float]] = {}
    for cond in ("alone", "busy"):
        stop = threading.Event()
        spinner = threading.Thread(target=busy, args=(stop,), daemon=True)
        if cond == "busy":
            spinner.start()
        try:
            for name in pkgs:  # warm-up
                step(name)
                step(name)
            for _ in range(a.reps):
                for name in pkgs:
                    times.setdefault((cond, name), []).append(step(name))
        finally:
            stop.set()
            if spinner.is_alive():
                spinner.join()
    med = {f"{c}/{n}": statistics.median(v) for (c, n), v in times.items()}
    rows = []
    for cond in ("alone", "busy"):
        b, f = med[f"{cond}/before"], med[f"{cond}/after"]
        rows.append({"condition": cond, "before_ms": round(b * 1e3, 2), "after_ms": round(f * 1e3, 2), "after_over_before": round(f / b, 3),
                     "before_min_max_ms": [round(min(times[(cond, 'before')]) * 1e3, 2), round(max(times[(cond, 'before')]) * 1e3, 2)],
                     "after_min_max_ms": [round(min(times[(cond, 'after')]) * 1e3, 2), round(max(times[(cond, 'after')]) * 1e3, 2)]})
    data = {"command": "python benchmarks/step_reads.py " + " ".join(sys.argv[1:]), "device": a.device,
            "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None, "model_size": a.model_size,
            "before": a.before, "reps": a.reps, "switch_interval_s": sys.getswitchinterval(),
            "batch": {"groups": GROUPS, "group_size": SIZE, "prompt": PROMPT, "completion": COMPLETION}, "rows": rows}
    md = [f"# A GRPO step: figures read one by one (before: {a.before}) against once (after)", "",
          f"`{data['command']}` ({a.device}{', ' + data['gpu'] if data['gpu'] else ''}; {a.model_size} model; "
          f"{GROUPS} x {SIZE} samples, prompt {PROMPT}, completion {COMPLETION}; median of {a.reps}, taking turns)", "",
          "| condition | before ms [min, max] | after ms [min, max] | after / before |", "| --- | --- | --- | --- |"]
    md += [f"| {r['condition']} | {r['before_ms']} {r['before_min_max_ms']} | {r['after_ms']} {r['after_min_max_ms']} | "
           f"{r['after_over_before']} |" for r in rows]
    write_results(a.out, data, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
