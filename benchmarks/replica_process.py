"""Does hosting the replicas apart from the trainer speed up async's step? rl_loop.py both ways.

    python benchmarks/replica_process.py [--seeds 0 1 2] [--out benchmarks/results/replica_process] -- [rl_loop.py args]
    python benchmarks/replica_process.py --merge A.json B.json [--out ...]

Runs ``benchmarks/rl_loop.py`` once per seed and way, the two ways taking turns (their order
drawn per seed): replicas in the trainer's process and event loop (``Replicas``), and in a
child process (``--replica-process``, ``ReplicasProcess``). Each run is a whole rl_loop.py
command (its engines started anew; ``--warmup-steps`` as given after ``--``). Reported per
way and arm: seconds per step, the trainer's seconds per step (``step_train_s`` over the
steps: the time a GRPO step takes while the replicas serve), the CPU time the trainer
process's event loop took while the steps trained, as a share of their time
(``train_loop_cpu_share``: what the step's operators wait behind for the interpreter lock),
steps and time to reward 0.8,
and async's time to 0.8 over the same run's sync; then async's figures with the replicas apart
as ratios to in-process. ``--merge`` joins the rows of earlier outputs (seeds run in separate
commands, e.g. where one command may run only ten minutes) into one summary.

Example (one GPU, the figures of issue 27):

    python3 benchmarks/replica_process.py --seeds 0 1 2 -- --model-size medium --transport ipc --steps 40 \\
        --lags 1 --lr 1e-3 --agree-every 10 --arms tis --mps --warmup-steps 3
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WAYS = {"in-process": [], "replica-process": ["--replica-process"]}


def run_one(way: str, seed: int, rest: list[str], tmp: str) -> dict:
    out = f"{tmp}/{way}-s{seed}"
    cmd = [sys.executable, str(HERE / "rl_loop.py"), *rest, "--seeds", str(seed), "--out", out, *WAYS[way]]
    print(f"replica_process: {way} seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(out + ".json").read_text())


def rows(way: str, res: dict) -> list[dict]:
    sync = next(r for r in res["runs"] if r["mode"] == "sync")
    out = []
    for r in res["runs"]:
        n = len(r["per_step"])
        t, ts = r["time_to_reward_0.8_s"], sync["time_to_reward_0.8_s"]
        out.append({"way": way, "seed": r["seed"], "run": r.get("run", r["name"]), "s_per_step": r["seconds_per_step"],
                    "train_s_per_step": round(r["step_train_s"] / n, 4), "steps_to_0.8": r["steps_to_reward_0.8"],
                    "time_to_0.8_s": t, "vs_sync": round(t / ts, 3) if t and ts else None, "final_reward": r["reward_last"],
                    "loop_cpu_share": r.get("train_loop_cpu_share")})
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def summary(all_rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["way"], r["run"]) for r in all_rows}):
        rs = [r for r in all_rows if (r["way"], r["run"]) == key]
        out.append({"way": key[0], "run": key[1], "seeds": len(rs),
                    **{k: _mean([r.get(k) for r in rs]) for k in ("s_per_step", "train_s_per_step", "steps_to_0.8", "time_to_0.8_s",
                                                                   "vs_sync", "final_reward", "loop_cpu_share")},
                    "vs_sync_each": [r["vs_sync"] for r in rs]})
    return out


def markdown(res: dict) -> str:
    lines = [f"# Replicas in the trainer's process or apart: `{res['command']}`", "",
             f"rl_loop.py arguments: `{' '.join(res['rl_loop_args'])}`; order per seed: {res['order']}.", "",
             "| way | run | seeds | s per step | trainer s per step | event loop CPU while training | steps to 0.8 | time to 0.8 (s) | "
             "/ same run's sync (each seed) | final reward |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["summary"]:
        lines.append(f"| {r['way']} | {r['run']} | {r['seeds']} | {r['s_per_step']} | {r['train_s_per_step']} | {r['loop_cpu_share']} | "
                     f"{r['steps_to_0.8']} | "
                     f"{r['time_to_0.8_s']} | {r['vs_sync']} ({r['vs_sync_each']}) | {r['final_reward']} |")
    lines += ["", "Apart over in-process, same arm (ratio of the means):", "", "| run | s per step | trainer s per step |",
              "| --- | --- | --- |"]
    by = {(r["way"], r["run"]): r for r in res["summary"]}
    for (way, run), r in by.items():
        base = by.get(("in-process", run))
        if way == "replica-process" and base and base["s_per_step"] and base["train_s_per_step"]:
            lines.append(f"| {run} | {r['s_per_step'] / base['s_per_step']:.3f} | {r['train_s_per_step'] / base['train_s_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", default="benchmarks/results/replica_process")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join these earlier outputs instead of running")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.merge:
        parts = [json.loads(Path(p).read_text()) for p in a.merge]
        if len({tuple(p["rl_loop_args"]) for p in parts}) != 1:
            ap.error("--merge: the outputs ran rl_loop.py with different arguments")
        all_rows = [r for p in parts for r in p["rows"]]
        res = {"command": " + ".join(p["command"] for p in parts), "rl_loop_args": parts[0]["rl_loop_args"],
               "order": {k: v for p in parts for k, v in p["order"].items()}, "rows": all_rows, "summary": summary(all_rows)}
        write(a.out, res)
        return
    if any(x in rest for x in ("--seeds", "--seed", "--out", "--replica-process")):
        ap.error("--seeds, --seed, --out and --replica-process are this script's to set")
    all_rows, order = [], {}
    with tempfile.TemporaryDirectory(prefix="rollq-replica-process-") as tmp:
        for seed in a.seeds:
            ways = list(WAYS)
            random.Random(f"ways-{seed}").shuffle(ways)
            order[seed] = ways
            for way in ways:
                all_rows += rows(way, run_one(way, seed, rest, tmp))
    res = {"command": "python benchmarks/replica_process.py " + " ".join(argv), "rl_loop_args": rest, "order": order,
           "rows": all_rows, "summary": summary(all_rows)}
    write(a.out, res)


def write(out: str, res: dict) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(out + ".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
