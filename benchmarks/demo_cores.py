"""A CPU demo run with the trainer and the replica on cores of their own, against placement left
to the OS, in one run (``rollq.rl.cores``; ``rollq demo`` pins by default, ``--no-pin`` not).

    python benchmarks/demo_cores.py [--task length] [--steps 150] [--pairs 2] [--out PATH]

Each pair runs ``rollq demo --task T --replicas 1 --steps N --json`` twice, pinned and
``--no-pin``, the order alternating from pair to pair; each run starts its own Redis and
vLLM replica. Per run: seconds per step, the trainer's seconds per step
(``step_train_s / steps``), the replica's idle fraction and rollout tokens/s; the table
gives each arm's median and the ratio pinned / unpinned. Results: ``<out>.json``, ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("seconds_per_step", "train_s_per_step", "replica_idle_fraction", "rollout_tokens_per_s")


def run_demo(task: str, steps: int, pin: bool, plot: Path) -> dict:
    cmd = [sys.executable, "-m", "rollq.cli", "demo", "--task", task, "--replicas", "1", "--steps", str(steps),
           "--json", "--plot", str(plot)] + ([] if pin else ["--no-pin"])
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    s = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "pin": pin, "cores": s.get("cores"), "command_s": round(time.perf_counter() - t0, 1),
        "seconds_per_step": s["seconds_per_step"], "train_s_per_step": round(s["step_train_s"] / s["steps"], 4),
        "replica_idle_fraction": s["replica_idle_fraction"], "rollout_tokens_per_s": s["rollout_tokens_per_s"],
        "reward_last": s["reward_last"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="length", choices=["bucket", "positional", "length", "two_turn"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/demo_cores"))
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(a.pairs):
        for pin in ((True, False) if i % 2 == 0 else (False, True)):
            r = run_demo(a.task, a.steps, pin, Path(tempfile.gettempdir()) / "rollq-demo-cores.png")
            print(json.dumps(r), file=sys.stderr)
            runs.append(r)
    arms = {pin: {k: statistics.median(r[k] for r in runs if r["pin"] == pin) for k in KEYS} for pin in (True, False)}
    res = {
        "command": "python benchmarks/demo_cores.py " + " ".join(sys.argv[1:]),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "task": a.task, "steps": a.steps, "runs": runs,
        "pinned": arms[True], "unpinned": arms[False],
        "ratio": {k: round(arms[True][k] / arms[False][k], 3) if arms[False][k] else None for k in KEYS},
    }
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"# `{res['command']}`", "",
             f"{res['cpus']} CPUs; `rollq demo --task {a.task} --replicas 1 --steps {a.steps}`, "
             f"{a.pairs} pair(s), order alternating; medians per arm.", "",
             "| | " + " | ".join(KEYS) + " |", "| --- |" + " --- |" * len(KEYS)]
    for name, arm in (("pinned", arms[True]), ("--no-pin", arms[False])):
        lines.append(f"| {name} | " + " | ".join(f"{arm[k]:.4g}" for k in KEYS) + " |")
    lines.append("| ratio | " + " | ".join(f"{res['ratio'][k]}" for k in KEYS) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
