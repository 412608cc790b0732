"""RL loop: synchronous generate/stop/update against rollq's async loop, same trainer and task.

    python benchmarks/rl_loop.py [--steps 40] [--lags 1 2] [--replicas 1] [--seed 0 | --seeds 0 1 2]
                                 [--model-size tiny|small|medium] [--out benchmarks/results/rl_loop]
    python benchmarks/rl_loop.py --stress [--tis-cap 2] [--out benchmarks/results/rl_loop_stress]
    python benchmarks/rl_loop.py --task positional --seeds 0 1 2 --shuffle [--steps 400]
    python benchmarks/rl_loop.py --task positional --sync-only --lr 1e-3   # the sync arm alone

One process, one embedded Redis, the same replicas for every run (each run gets a fresh
queue; the replicas are reset to the initial weights by publishing them as the run's first
version). Runs, each from the same initial weights and prompt seed:

- ``sync``: submit a batch that needs the current version, wait for all of it, train, publish,
  repeat (the pattern of TorchRL AsyncVLLM users: generation stops while the trainer works);
- ``async-lag1``, ``async-lag2``: rollq's loop (``rollq.rl.loop``) under a staleness bound.

Reported, as ratios to ``sync``: time to reach reward 0.8 (trailing mean of 3 steps), rollout
tokens/s, the fraction of wall time the replicas sat idle (no job running), final reward
(mean of the last 5 steps). The JSON also has every step's generate wait / train / publish.

Off-policy under stress (``--stress``: ``--lags 4 8 --min-tokens 32 --max-tokens 64 --arms
ratio no-ratio tis``, each settable on its own): completions of 32-64 tokens (a length drawn
per job) under a staleness bound of 4 and 8 versions, so weight swaps land mid-generation
(update policy ``keep``: a request continues on the new weights, its tokens stamped with the
version that generated each). Each async lag runs once per arm of the trainer's importance
ratio against the behaviour logprobs (:class:`rollq.rl.GrpoConfig`):

- ``ratio``: PPO's clipped ratio against the behaviour logprobs (the default);
- ``no-ratio``: the ratio fixed at 1 (``importance_ratio=False``), the control;
- ``tis``: truncated importance weighting, the ratio capped at ``--tis-cap`` (``tis_cap``).

And once per update policy of ``--policies`` (default ``keep``): ``keep`` (a request continues
on the new weights), ``abort`` (the queue's ``abort`` policy: requests in flight are aborted at
the swap and rerun from scratch) and ``abort-resume`` (aborted, then continued from the
tokens they had, their context re-prefilled at the new version:
``WeightSyncSettings.abort_resume``).

Reported per run: the share of tokens that span a swap (their version differs from their
sample's first token's), the |behaviour - trainer| logprob difference by token lag (0, 1,
2+; at the trainer's weights when it trains on them), the mean clip fraction (tokens where the
clip was active), ratio and TIS figures, the reward. The JSON keeps every step's ``diff_*``,
``diff_by_lag``, ``clip_frac`` and ratio stats (``runs[].per_step``).

Agreement by confidence: the single-version agreement is also split by the behaviour
probability of each token (p >= 0.9, 0.5-0.9, < 0.5; ``diff_by_confidence``). Rounding errors
in a logprob grow as the token's probability falls, and a policy that turned near-deterministic
agrees almost exactly whatever the kernels: runs whose policies end at different confidence
(sync against async) compare bucket by bucket, not by one mean.

Seeds: ``--seeds 0 1 2`` runs every arm once per seed with the same replicas; ratios are to
the same seed's sync run, and ``by_arm`` has each arm's mean, min and max over the seeds.
``--shuffle`` draws the order of the arms per seed (recorded as ``order``). ``--warmup-steps N``
first runs every arm once for N steps, not measured (recorded as ``warmup``): what a process pays
once (the engine's kernels compiled at their first use, the first swap's kernel, the trainer's
first steps of each loss) then lands on no measured arm; without it the first arm of the
command pays it (on an H100 about 1 s of the first runs' few seconds to reward 0.8). Each run reports
steps to reward 0.8 and seconds per step apart (time to 0.8 is their product, roughly), the
trainer's time with the diagnostic agreement forwards at older versions shown apart
(``step_agree_s``, part of ``step_train_s``), and the waste: tokens the engines generated per
token the trainer got (1.0: nothing thrown away; the ``abort`` policy reruns what it aborted).

Tasks (``--task``): ``bucket`` (the default; ``rollq demo``'s task) or ``positional`` (``rollq
demo --task positional``: its recipe's 4-layer tiny model, and its steps, groups, group size,
learning rate and decay unless given; every run then also reports ``reward_heldout``, the mean
reward of 8 samples of each held-out digit string at the run's final version, as the demo does).

Cores: on vLLM's CPU backend the trainer and the replicas compete for cores. By default each
replica gets a core of its own, the last ones (``VLLM_CPU_OMP_THREADS_BIND``), and, once the
engines are up, this process (trainer, event loop, vLLM's front end) is pinned to the rest with
one torch thread, where the machine has the cores for it (:func:`rollq.rl.cores.plan_cores`, as
``rollq demo`` does; ``--no-pin``: leave placement to the OS).

Processes: by default the replicas' vLLM front ends, consumers and weight followers run in
this process's event loop, beside the trainer's thread, so the two take turns at one
interpreter lock (a step of a few thousand PyTorch operators waits to take it back after each;
``benchmarks/step_contention.py``). ``--replica-process`` hosts them in a child process
(:class:`rollq.rl.replica_host.ReplicasProcess`), as a deployment runs replicas apart from
its trainer; this process then keeps the trainer, the producer and the publisher. Each run
reports the CPU time this process's event loop took while the steps trained, as a share of
their time (``train_loop_cpu_share``): the work the step's operators wait behind.

``--model-size small|medium`` builds a larger random Qwen2-shaped model (vocab 1024) with
``rollq.testing.tiny_model.build_tiny_model``; meant for a GPU (the trainer then runs on CUDA).

One GPU: the trainer (this process) and each replica's engine core (a process of vLLM's) have
CUDA contexts of their own, and a GPU runs one context at a time, so without MPS their kernels
take turns in time slices and async's overlap of training with generation buys little wall
time (``benchmarks/gpu_share.py``). ``--mps`` starts a CUDA MPS daemon of the run's own
(:class:`rollq.rl.mps.MpsDaemon`) before anything touches the GPU; the trainer and the engines
are its clients and their kernels run side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import shutil
import sys
import time
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollq.demo import RECIPES, heldout_reward, lr_at, model_for, resolve  # noqa: E402  (after the path insert)

log = logging.getLogger("rl_loop")

#: --task: the tasks this benchmark runs (their recipes: rollq.demo.RECIPES).
TASKS = ("bucket", "positional")

#: --model-size -> build_tiny_model arguments (None: the cached tiny model).
SIZES = {
    "tiny": None,
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4},
    "medium": {"hidden": 1024, "layers": 16, "heads": 16, "kv_heads": 8},
}


def model_dir(size: str, task: str = "bucket") -> str:
    from rollq.testing.tiny_model import build_tiny_model, default_model_dir, ensure_tiny_model

    if task != "bucket":
        return model_for(task)  # the task's recipe decides the model
    if SIZES[size] is None:
        return str(ensure_tiny_model())
    return str(build_tiny_model(default_model_dir().parent / f"random-qwen2-{size}", **SIZES[size]))


#: --arms: the trainer's treatment of the importance ratio (see the module doc).
ARMS = ("ratio", "no-ratio", "tis")
#: --policies: how a replica applies a version mid-generation (see the module doc).
POLICIES = ("keep", "abort", "abort-resume")


def grpo_config(arm: str, a: argparse.Namespace):
    from rollq.rl import GrpoConfig

    if arm == "no-ratio":
        return GrpoConfig(lr=a.lr, importance_ratio=False)
    if arm == "tis":
        return GrpoConfig(lr=a.lr, tis_cap=a.tis_cap)
    return GrpoConfig(lr=a.lr)


def make_task(vocab_size: int, min_tokens: int, max_tokens: int, name: str = "bucket"):
    """The bucket task with completions of ``min_tokens..max_tokens`` tokens (a length drawn per
    job; the reward, the in-bucket fraction, does not depend on it); ``positional``: that task
    (its completions are always 4 tokens)."""
    from rollq.rl import BucketTask
    from rollq.rl.tasks import make_task as task_named

    if name != "bucket":
        return task_named(name, vocab_size)
    if min_tokens == max_tokens:
        return BucketTask(vocab_size=vocab_size, length=max_tokens)

    class VariableLengthTask(BucketTask):
        def job_specs(self, tokenizer, rng, count, group_size):
            specs = super().job_specs(tokenizer, rng, count, group_size)
            for spec in specs:
                spec["sampling"] = dict(spec["sampling"], max_tokens=rng.randint(min_tokens, max_tokens))
            return specs

    return VariableLengthTask(vocab_size=vocab_size, length=max_tokens)


#: StepRecord fields kept per step in the JSON.
PER_STEP = ("step", "version", "reward", "wait_s", "train_s", "publish_s", "elapsed_s", "tokens", "lags", "swap_tokens",
            "loss", "clip_frac", "diff_sum", "diff_max", "diff_tokens", "diff_by_lag", "diff_by_confidence", "loss_stats")


def _rounded(v):
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


async def one_run(name: str, mode: str, max_lag: int, a: argparse.Namespace, srv_url: str, replicas, model: str,
                  tokenizer, device: str, arm: str = "ratio", policy: str = "keep") -> dict:
    import torch

    from rollq.rl import GrpoTrainer, LoopConfig, run_loop
    from rollq.weightsync.trainer.publisher import WeightPublisher

    seed = a.seed
    queue = f"rl-{name}"
    root = tempfile.mkdtemp(prefix=f"rollq-rl-{name}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    await replicas.attach(queue, weights_root=root, abort_resume=policy == "abort-resume")
    torch.manual_seed(seed)
    trainer = GrpoTrainer.from_pretrained(model, grpo_config(arm, a), seed=seed)
    trainer.model.to(getattr(torch, a.trainer_dtype))
    trainer.rebase(0)  # the snapshot of version 0 in the trainer's dtype
    trainer.to(device)
    # Over ipc no memmap copy is written beside each version (the replicas share this host); an
    # async trainer steps in place while the replica may still copy, so it exposes the publisher's
    # own snapshot, or leases its tensors (--ipc-expose lease: each step waits for the copies;
    # direct: and the replicas copy them straight into their live weights at the swap).
    pub = WeightPublisher(srv_url, queue, root=None if a.transport == "ipc" else root, keep=4, trainer_id=f"trainer-{name}",
                          ipc_snapshot=mode != "sync" and a.ipc_expose == "snapshot", ipc_lease=a.ipc_expose in ("lease", "direct"))
    # Every run starts from the initial weights: publish them as version 1 to the replicas.
    rec = await pub.publish_weights(trainer.state_dict(), transport=a.transport)
    trainer.rebase(rec.version)
    await replicas.wait_version(rec.version)
    task = make_task(len(tokenizer), a.min_tokens, a.max_tokens, a.task)
    cfg = LoopConfig(steps=a.steps, groups_per_step=a.groups, group_size=a.group_size, mode=mode, max_lag=max_lag, seed=seed,
                     transport=a.transport, update_policy="keep" if policy == "keep" else "abort",
                     agree_every=a.agree_every)

    def on_step(r) -> None:
        for g in trainer.optimizer.param_groups:  # the next step's rate (the task's schedule)
            g["lr"] = lr_at(a.lr, a.decay_after, r.step + 1, a.lr_min)
        if r.step % 10 == 0 or r.step == a.steps - 1:
            log.info("%s step %d reward %.3f wait %.3fs train %.3fs publish %.3fs", name, r.step, r.reward, r.wait_s, r.train_s, r.publish_s)

    made0 = (await replicas.snapshot()).generated_tokens
    try:
        report = await run_loop(srv_url, queue, trainer, task, tokenizer, pub, cfg, on_step=on_step, producer_id=f"trainer-{name}")
        after = await replicas.snapshot()
        made = after.generated_tokens - made0
        report.updates = [u for u in after.updates if u.version > rec.version]  # not the reset
        heldout = (await heldout_reward(srv_url, queue, task, tokenizer, 8, trainer.version)
                   if hasattr(task, "heldout_specs") else None)
    finally:
        await pub.close()
        ROOTS.append(root)  # removed once the replicas stopped (they may still read its slots)
    s = report.summary()
    s["name"] = name
    s["arm"] = arm
    s["task"] = a.task
    if heldout is not None:
        s["reward_heldout"] = round(heldout, 4)
    # Tokens the engines generated per token the trainer got (1.0: nothing thrown away; the
    # abort policy reruns what it aborted; the last step's jobs still running are counted too).
    s["generated_tokens"] = made
    s["waste"] = round(made / s["rollout_tokens"], 3) if s["rollout_tokens"] else None
    s["update_policy"] = policy
    # The replicas' updates split from announcement to serving (medians, ms): WeightFollower's timeline.
    waits = [w for w in (u.waits() for u in report.updates) if w]
    s["update_waits_ms"] = {k: round(1000 * sorted(w[k] for w in waits)[len(waits) // 2], 2) for k in waits[0]} if waits else None
    s["seed"] = seed
    s.update(served_dtype=after.served_dtype, trainer_dtype=trainer.dtype, converted_from=after.converted_from)
    steps = report.per_step()
    s["per_step"] = [{k: _rounded(d[k]) for k in PER_STEP} for d in steps]
    stats = [d["loss_stats"] for d in steps if d["loss_stats"]]
    s["ratio_mean"] = _rounded(sum(x["ratio_mean"] for x in stats) / len(stats)) if stats else None
    s["ratio_max"] = _rounded(max(x["ratio_max"] for x in stats)) if stats else None
    s["tis_frac_mean"] = _rounded(sum(x["tis_frac"] for x in stats) / len(stats)) if stats else None
    return s


#: Weight roots of the runs (in /dev/shm where there is one: RAM), removed at the end.
ROOTS: list[str] = []


def ratios(runs: list[dict]) -> list[dict]:
    """Each run's figures as ratios to the ``sync`` run of its seed."""
    base_of = {r.get("seed"): r for r in runs if r["mode"] == "sync"}

    def ratio(x, y):
        return None if x is None or y in (None, 0) else round(x / y, 3)

    out = []
    for r in runs:
        base = base_of.get(r.get("seed"), runs[0])
        out.append({
            "run": r["name"],
            "time_to_reward_0.8": ratio(r["time_to_reward_0.8_s"], base["time_to_reward_0.8_s"]),
            "rollout_tokens_per_s": ratio(r["rollout_tokens_per_s"], base["rollout_tokens_per_s"]),
            "replica_idle_fraction": ratio(r["replica_idle_fraction"], base["replica_idle_fraction"]),
            "final_reward": ratio(r["reward_last"], base["reward_last"]),
        })
    return out


def by_arm(runs: list[dict]) -> list[dict]:
    """Runs of the same arm over the seeds: each figure's mean, min and max, and the time to
    reward 0.8 as a ratio to the same seed's sync run (None where either did not reach it)."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r.get("run", r["name"]), []).append(r)
    sync = {r.get("seed"): r for r in runs if r["mode"] == "sync"}
    out = []
    for name, rs in groups.items():
        row: dict = {"run": name, "seeds": [r.get("seed") for r in rs]}
        for key in ("reward_last", "reward_heldout", "wall_s", "time_to_reward_0.8_s", "steps_to_reward_0.8", "seconds_per_step",
                    "logprob_abs_diff_mean", "rollout_tokens_per_s", "waste"):
            xs = [r[key] for r in rs if r.get(key) is not None]
            row[key] = {"mean": _rounded(sum(xs) / len(xs)), "min": _rounded(min(xs)), "max": _rounded(max(xs)),
                        "n": len(xs)} if xs else None
        t = [r["time_to_reward_0.8_s"] / sync[r.get("seed")]["time_to_reward_0.8_s"] for r in rs
             if r.get("time_to_reward_0.8_s") and sync.get(r.get("seed"), {}).get("time_to_reward_0.8_s")]
        row["time_to_0.8_vs_sync"] = [round(x, 3) for x in t]
        out.append(row)
    return out


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _bucket_cells(by: dict, keys) -> list[str]:
    """A table's cells of a run's ``{bucket: {mean, tokens}}`` figures: ``mean (tokens)``, ``-`` where none."""
    return [f"{_g(by[k]['mean'])} ({by[k]['tokens']})" if k in by else "-" for k in keys]


def markdown(res: dict) -> str:
    lines = [
        f"# RL loop: sync vs rollq async ({res['model_size']} model, {res['replicas']} replica(s), {res['steps']} steps)",
        "",
        f"`{res['command']}` on {res['machine']}; cores: {res['cores']}"
        + ("" if not res.get("mps") else f"; CUDA MPS (servers {res['mps']['servers']})")
        + ("; replicas in a process of their own (--replica-process)" if res.get("replica_process")
           else "; replicas in the trainer's process and event loop")
        + ("" if not res.get("warmup") else "; warmed up first, not measured: "
           + ", ".join(f"{w['run']} {w['steps']} steps {w['wall_s']} s" for w in res["warmup"])) + ".",
        "",
        "| run | time to reward 0.8 | steps to 0.8 | s per step | rollout tokens/s | replica idle | final reward | held-out reward | wall | lag histogram | generate wait / train (of it agreement) / publish (s, all steps) | event loop CPU while training | trainer / served dtype | logprob \\|diff\\| mean / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["runs"]:
        t = r["time_to_reward_0.8_s"]
        conv = f" (converts {', '.join(r['converted_from'])})" if r.get("converted_from") else ""
        lines.append(
            f"| {r['name']} | {'not reached' if t is None else f'{t:.1f} s'} | {r.get('steps_to_reward_0.8') or '-'} | "
            f"{_g(r.get('seconds_per_step'))} | {r['rollout_tokens_per_s']:.0f} | "
            f"{r['replica_idle_fraction']:.2f} | {r['reward_last']:.3f} | {_g(r.get('reward_heldout'))} | {r['wall_s']:.1f} s | {r['lag_histogram']} | "
            f"{r['step_wait_s']:.1f} / {r['step_train_s']:.1f} ({r.get('step_agree_s', 0.0):.1f}) / {r['step_publish_s']:.1f} | "
            f"{_g(r.get('train_loop_cpu_share'))} | "
            f"{r.get('trainer_dtype')} / {r.get('served_dtype')}{conv} | "
            f"{_g(r.get('logprob_abs_diff_mean'))} / {_g(r.get('logprob_abs_diff_max'))} |"
        )
    lines += ["", "Ratios to sync:", "", "| run | time to 0.8 | tokens/s | idle fraction | final reward |", "| --- | --- | --- | --- | --- |"]
    for q in res["ratios"]:
        lines.append(f"| {q['run']} | {q['time_to_reward_0.8']} | {q['rollout_tokens_per_s']} | {q['replica_idle_fraction']} | {q['final_reward']} |")
    lines += [
        "",
        f"Off-policy figures (completions of {res['min_tokens']}-{res['max_tokens']} tokens; TIS cap {res['tis_cap']}). "
        "|diff| by lag: mean |behaviour - trainer| logprob at the trainer's weights when it trained on the tokens "
        "(tokens compared); clip: mean share of tokens where the clip was active; ratio: against the behaviour logprobs.",
        "",
        "| run | arm | update policy | waste (generated / delivered) | tokens spanning a swap | \\|diff\\| lag 0 | lag 1 | lag 2+ | clip | ratio mean / max | TIS capped | final reward | time to 0.8 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["runs"]:
        lag = _bucket_cells(r.get("logprob_abs_diff_by_lag", {}), ("0", "1", "2+"))
        t = r["time_to_reward_0.8_s"]
        lines.append(
            f"| {r['name']} | {r['arm']} | {r.get('update_policy', 'keep')} | {_g(r.get('waste'))} | {r['swap_tokens']} of {r['rollout_tokens']} ({100 * r['swap_token_share']:.1f}%) | "
            f"{' | '.join(lag)} | {r['clip_frac_mean']:.3f} | {_g(r.get('ratio_mean'))} / {_g(r.get('ratio_max'))} | "
            f"{_g(r.get('tis_frac_mean'))} | {r['reward_last']:.3f} | {'not reached' if t is None else f'{t:.1f} s'} |"
        )
    lines += [
        "",
        "Agreement by the behaviour probability p of the sampled token (single-version samples, at their version): "
        "mean |behaviour - trainer| logprob (tokens compared).",
        "",
        "| run | p >= 0.9 | 0.5 <= p < 0.9 | p < 0.5 |",
        "| --- | --- | --- | --- |",
    ]
    for r in res["runs"]:
        cells = _bucket_cells(r.get("logprob_abs_diff_by_confidence", {}), ("p>=0.9", "0.5<=p<0.9", "p<0.5"))
        lines.append(f"| {r['name']} | {' | '.join(cells)} |")
    if len(res.get("seeds", [])) > 1:
        lines += ["", f"Over seeds {res['seeds']} (mean [min, max]):", "",
                  "| run | final reward | held-out reward | time to 0.8 (s) | time to 0.8 / same seed's sync | steps to 0.8 | s per step | wall (s) | logprob \\|diff\\| mean |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

        def agg(x) -> str:
            return "-" if x is None else f"{_g(x['mean'])} [{_g(x['min'])}, {_g(x['max'])}]" + (f" ({x['n']} runs)" if x["n"] < len(res["seeds"]) else "")

        for row in res["by_arm"]:
            lines.append(f"| {row['run']} | {agg(row['reward_last'])} | {agg(row['reward_heldout'])} | {agg(row['time_to_reward_0.8_s'])} | "
                         f"{row['time_to_0.8_vs_sync'] or '-'} | {agg(row['steps_to_reward_0.8'])} | {agg(row['seconds_per_step'])} | "
                         f"{agg(row['wall_s'])} | {agg(row['logprob_abs_diff_mean'])} |")
    return "\n".join(lines) + "\n"


def run_plan(a: argparse.Namespace) -> list[tuple[str, str, int, str, str]]:
    """The runs of one seed, in the order given: ``(name, mode, max lag, arm, update policy)``."""
    plan = [("sync", "sync", 0, "ratio", "keep")]
    for lag in [] if a.sync_only else a.lags:
        for arm in a.arms:
            for policy in a.policies:
                name = f"async-lag{lag}" + ("" if a.arms == ["ratio"] else f"-{arm}")
                name += "" if a.policies == ["keep"] else f"-{policy}"
                plan.append((name, "async", lag, arm, policy))
    return plan


async def warm_up(a: argparse.Namespace, seed: int, srv_url: str, replicas, model: str, tokenizer, device: str) -> list[dict]:
    """Every run of the plan once for ``--warmup-steps`` steps, not measured; each one's wall time."""
    out: list[dict] = []
    if a.warmup_steps <= 0:
        return out
    steps, a.steps, a.seed = a.steps, a.warmup_steps, seed
    try:
        for name, mode, lag, arm, policy in run_plan(a):
            t0 = time.perf_counter()
            await one_run(f"warmup-{name}", mode, lag, a, srv_url, replicas, model, tokenizer, device, arm, policy)
            out.append({"run": name, "steps": a.warmup_steps, "wall_s": round(time.perf_counter() - t0, 2)})
            log.info("warm-up %s: %d steps in %.1fs (not measured)", name, a.warmup_steps, out[-1]["wall_s"])
    finally:
        a.steps = steps
    return out


def write_results(a: argparse.Namespace, res: dict) -> None:
    """``<out>.json`` and ``<out>.md``."""
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(a.out + ".md").write_text(markdown(res))


async def main_async(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rollq.rl import Replicas
    from rollq.rl.replica_host import ReplicasProcess
    from rollq.rl.cores import available_cores, pin_process, plan_cores
    from rollq.server import RedisServer

    model = model_dir(a.model_size, a.task)
    tokenizer = AutoTokenizer.from_pretrained(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ncpu = len(available_cores())  # before this process is pinned to its share
    plan = plan_cores(a.replicas) if a.pin and device == "cpu" else None
    binds = list(plan.replicas) if plan else None
    cores = (f"trainer + event loop pinned to cores {list(plan.trainer)} (1 torch thread); replicas on cores "
             f"{list(plan.replicas)} (VLLM_CPU_OMP_THREADS_BIND)" if plan
             else f"no pinning ({ncpu} cores{'' if a.pin else ', --no-pin'}; device {device})")
    if a.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by the replicas' engine processes
    with RedisServer() as srv:
        kw = dict(weights_root=None, count=a.replicas, model=model, max_model_len=256, cpu_binds=binds, reconcile_interval=1.0,
                  dtype=a.dtype, ipc_prestage=a.ipc_prestage, ipc_direct=a.ipc_expose == "direct")
        # --replica-process: the replicas' front ends, consumers and followers in a child process
        # (its event loop beside the trainer's cores on CPU), not in this one's event loop.
        replicas = (ReplicasProcess(srv.url, "rl-start", pin=list(plan.trainer) if plan else None, **kw) if a.replica_process
                    else Replicas(srv.url, "rl-start", **kw))
        await replicas.start()
        try:
            log.info("%d replica(s) up in %.1fs (%s)", a.replicas, replicas.start_s, cores)
            if plan:
                torch.set_num_threads(1)
                pin_process(plan.trainer)
            if a.batch_invariant:  # the same kernel overrides for the trainer's forward passes
                from vllm.model_executor.layers.batch_invariant import init_batch_invariance

                init_batch_invariance()
            runs = []
            seeds = a.seeds or [a.seed]
            orders = []
            warmup = await warm_up(a, seeds[0], srv.url, replicas, model, tokenizer, device)
            for seed in seeds:
                a.seed = seed
                tag = f"-s{seed}" if len(seeds) > 1 else ""
                plan = run_plan(a)
                if a.shuffle:  # the order of the arms, drawn per seed (and recorded)
                    random.Random(f"order-{seed}").shuffle(plan)
                orders.append([p[0] for p in plan])
                for name, mode, lag, arm, policy in plan:
                    runs.append(await one_run(name + tag, mode, lag, a, srv.url, replicas, model, tokenizer, device, arm, policy))
                    runs[-1]["run"] = name
            # Written before the replicas stop: an engine that hangs on shutdown loses no figures.
            mps = None if a.mps_daemon is None else {"servers": a.mps_daemon.servers()}
            res = {
                "command": "python benchmarks/rl_loop.py " + " ".join(sys.argv[1:]),
                "machine": f"{platform.machine()}, {ncpu} cores, {device}",
                "cores": cores,
                "task": a.task,
                "model_size": a.model_size,
                "lr_decay_after": a.decay_after,
                "replicas": a.replicas,
                "steps": a.steps,
                "groups_per_step": a.groups,
                "group_size": a.group_size,
                "lr": a.lr,
                "agree_every": a.agree_every,
                "seed": seeds[0],
                "seeds": seeds,
                "stress": a.stress,
                "min_tokens": a.min_tokens,
                "max_tokens": a.max_tokens,
                "arms": a.arms,
                "tis_cap": a.tis_cap,
                "policies": a.policies,
                "order": orders,
                "warmup": warmup,
                "engine_start_s": round(replicas.start_s, 1),
                "batch_invariant": a.batch_invariant,
                "mps": mps,
                "replica_process": a.replica_process,
                "runs": runs,
                "ratios": ratios(runs),
                "by_arm": by_arm(runs),
            }
            write_results(a, res)
        finally:
            await replicas.stop()
            for root in ROOTS:
                shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=TASKS, default="bucket",
                    help="bucket (rollq demo's task) or positional (its recipe's model, schedule and held-out reward)")
    ap.add_argument("--steps", type=int, help="steps per run (default: the task's recipe: 40 for bucket)")
    ap.add_argument("--groups", type=int, help="groups per step (default: the task's recipe: 16)")
    ap.add_argument("--group-size", type=int, help="samples per group (default: the task's recipe: 8)")
    ap.add_argument("--lags", type=int, nargs="+", help="async runs' max lag (default 1 2; --stress: 4 8)")
    ap.add_argument("--stress", action="store_true",
                    help="off-policy under stress: the defaults become --lags 4 8 --min-tokens 32 --max-tokens 64 "
                         "--arms ratio no-ratio tis (each still settable)")
    ap.add_argument("--min-tokens", type=int, help="shortest completion (default 4; --stress: 32)")
    ap.add_argument("--max-tokens", type=int, help="longest completion, a length drawn per job (default 4; --stress: 64)")
    ap.add_argument("--arms", nargs="+", choices=ARMS,
                    help="the async runs' importance-ratio arms (default ratio; --stress: all three)")
    ap.add_argument("--tis-cap", type=float, default=2.0, help="the tis arm's cap on the importance ratio")
    ap.add_argument("--shuffle", action="store_true",
                    help="run the arms of each seed in a random order (drawn from the seed, recorded as 'order'), "
                         "so that drift of the machine over the command does not favour the arms that run first")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="first run every arm once for this many steps, not measured (recorded as 'warmup'), so that "
                         "what the process pays once lands on no measured arm (0: none)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=["keep"],
                    help="the async runs' update policies: keep (requests continue on the new weights), abort "
                         "(rerun from scratch), abort-resume (continue from their tokens after a re-prefill)")
    ap.add_argument("--sync-only", action="store_true",
                    help="only the sync arm (e.g. a control of sync at other learning rates; no async runs)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--transport", choices=["memmap", "ipc"], default="memmap",
                    help="weight sync: memmap files in /dev/shm, or ipc (the trainer's tensors shared with the replicas)")
    ap.add_argument("--ipc-expose", choices=["snapshot", "lease", "direct"], default="snapshot",
                    help="with --transport ipc: the async trainer exposes the publisher's snapshot of each version "
                         "(WeightPublisher(ipc_snapshot=True)), or leases its own tensors (ipc_lease=True: no copy, "
                         "each optimizer step first waits for the replicas' copies), or leases them and the replicas "
                         "copy them straight into their live weights at the swap (direct: WeightSyncSettings.ipc_direct)")
    ap.add_argument("--ipc-prestage", action="store_true",
                    help="with --transport ipc: the replicas' workers start each copy when the version is announced "
                         "(WeightSyncSettings.ipc_prestage)")
    ap.add_argument("--lr", type=float, help="Adam's learning rate (default: the task's recipe: 5e-3 for bucket)")
    ap.add_argument("--agree-every", type=int,
                    help="the diagnostic agreement forward at older versions every k-th step only, in every arm "
                         "(LoopConfig.agree_every; default: the task's recipe, every step for bucket and positional)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+",
                    help="run every arm once per seed, with the same replicas (ratios per seed, and each arm's "
                         "mean/min/max over the seeds); overrides --seed")
    ap.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="no core pinning")
    ap.add_argument("--dtype", default="auto",
                    help="the replicas' served dtype (auto: float32 on CPU, the checkpoint's own on GPU)")
    ap.add_argument("--trainer-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the trainer's weights (bfloat16 with --dtype bfloat16: the bf16-to-bf16 setup)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="GPU: vLLM's batch-invariant kernels in the replicas (VLLM_BATCH_INVARIANT=1) and its kernel "
                         "overrides in the trainer's torch too (matmul, log_softmax, mean), to measure how close that "
                         "brings the two and what it costs in tokens/s")
    ap.add_argument("--mps", action="store_true",
                    help="GPU: run the trainer and the replicas' engines as clients of a CUDA MPS daemon of the run's "
                         "own (rollq.rl.mps.MpsDaemon), so that their kernels run side by side on one GPU instead of "
                         "taking turns in time slices")
    ap.add_argument("--replica-process", action="store_true",
                    help="host the replicas (vLLM front ends, consumers, weight followers) in a child process "
                         "(rollq.rl.replica_host.ReplicasProcess), as a deployment runs them apart from the trainer, "
                         "instead of in this process's event loop beside the trainer's thread")
    ap.add_argument("--out", default="benchmarks/results/rl_loop")
    a = ap.parse_args()
    for key, normal, stress in (("lags", [1, 2], [4, 8]), ("min_tokens", 4, 32), ("max_tokens", 4, 64),
                                ("arms", ["ratio"], list(ARMS))):
        if getattr(a, key) is None:
            setattr(a, key, stress if a.stress else normal)
    resolve(a)  # the task's recipe fills what the command line left out, as in rollq demo
    a.decay_after = RECIPES[a.task]["decay_after"]
    if a.task != "bucket" and (a.model_size != "tiny" or a.stress):
        ap.error(f"--task {a.task} runs its recipe's model, without --stress")
    if not 1 <= a.min_tokens <= a.max_tokens:
        ap.error(f"--min-tokens {a.min_tokens} / --max-tokens {a.max_tokens}: need 1 <= min <= max")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from rollq.rl.mps import MpsDaemon

    # The daemon starts before anything in this process or its children touches CUDA.
    with MpsDaemon() if a.mps else contextlib.nullcontext() as daemon:
        a.mps_daemon = daemon
        print(markdown(asyncio.run(main_async(a))))


if __name__ == "__main__":  # AsyncLLM starts processes: this guard is needed
    main()
