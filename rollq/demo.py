"""``rollq demo``: an async GRPO run that learns, on one machine, in one command.

An embedded redis-server, replicas (vLLM on the locally built tiny Qwen2 model, or the echo
engine for a queue-only look) and a trainer (a PyTorch + transformers copy of the same
model) in one process (``--replica-process``: the replicas in a child process of their own,
:class:`~rollq.rl.replica_host.ReplicasProcess`). The trainer keeps the queue full under a staleness bound, trains on
each batch of GRPO groups as it arrives and publishes every new policy version to the
replicas, which keep generating meanwhile (update policy ``keep``). The task
(:class:`~rollq.rl.task.BucketTask`) is learnable from random weights in a few dozen steps:
the summary shows the reward rising from the random policy's 0.25 towards 1, the policy lag
of what was trained on, weight-update times, and the agreement between the replicas'
behavior logprobs and the trainer's (the end-to-end check of weight sync).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any

from ._torch_extras import hide_broken_torch_extras

log = logging.getLogger("rollq.demo")

QUEUE = "demo"

#: Per task: the tiny model's shape (:func:`~rollq.testing.tiny_model.build_tiny_model`
#: arguments; {} is the default model) and the run's defaults where the command line leaves
#: them out. Why each recipe is what it is: benchmarks/README.md, "Harder tasks".
#: ``decay_after``: the learning rate is ``lr * min(1, decay_after / step)`` (None: constant),
#: never below ``lr_min`` (absent: 0, no floor).
#: ``entropy_coef``: :attr:`~rollq.rl.grpo.GrpoConfig.entropy_coef` (0: no entropy bonus).
#: ``scale_rewards``: :attr:`~rollq.rl.grpo.GrpoConfig.scale_rewards` (absent: ``"group"``).
#: ``shaping``: the task's reward-shaping schedule (:class:`~rollq.rl.tasks.Shaping` arguments;
#: absent: the task trains on its exact reward). ``agree_every``:
#: :attr:`~rollq.rl.loop_config.LoopConfig.agree_every` (absent: 1, the agreement forward every step).
#: ``explore``: :class:`~rollq.rl.tasks.Exploration` arguments (absent: every job at temperature 1).
RECIPES: dict[str, dict[str, Any]] = {
    "bucket": {"model": {}, "steps": 40, "groups": 16, "group_size": 8, "lr": 5e-3, "decay_after": None,
               "entropy_coef": 0.0},
    "positional": {"model": {"layers": 4}, "steps": 600, "groups": 16, "group_size": 8, "lr": 2e-3, "decay_after": 100,
                   "entropy_coef": 0.0},
    "length": {"model": {}, "steps": 1500, "groups": 8, "group_size": 32, "lr": 5e-3, "decay_after": 100,
               "entropy_coef": 0.0, "shaping": {"hold": 100, "anneal": 200, "floor": 0.2}, "agree_every": 10,
               "explore": {"max_temperature": 2.0}},
    "two_turn": {"model": {}, "steps": 60, "groups": 16, "group_size": 8, "lr": 5e-3, "decay_after": None,
                 "entropy_coef": 0.0},
}


def lr_at(lr: float, decay_after: int | None, step: int, lr_min: float = 0.0) -> float:
    """The learning rate of ``step``: constant, or ``lr * decay_after / step`` past ``decay_after``
    but never below ``lr_min``.

    >>> lr_at(2e-3, 100, 50), lr_at(2e-3, 100, 400), lr_at(2e-3, None, 400), lr_at(5e-3, 100, 1000, 1e-3)
    (0.002, 0.0005, 0.002, 0.001)
    """
    return lr if decay_after is None or step <= decay_after else max(lr * decay_after / step, lr_min)


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    """``a`` with the task's recipe filling the run options the command line left at None."""
    recipe = RECIPES[a.task]
    for key in ("steps", "groups", "group_size", "lr", "entropy_coef"):
        if getattr(a, key, None) is None:
            setattr(a, key, recipe[key])
    if getattr(a, "lr_min", None) is None:
        a.lr_min = recipe.get("lr_min", 0.0)
    if getattr(a, "scale_rewards", None) is None:
        a.scale_rewards = recipe.get("scale_rewards", "group")
    if getattr(a, "explore_max", None) is None:
        a.explore_max = recipe.get("explore", {}).get("max_temperature", 1.0)
    if getattr(a, "agree_every", None) is None:
        a.agree_every = recipe.get("agree_every", 1)
    return a


def exploration(a: argparse.Namespace) -> dict[str, Any] | None:
    """The :class:`~rollq.rl.tasks.Exploration` arguments of a resolved run (None: off).

    >>> exploration(argparse.Namespace(task="bucket", explore_max=1.0)) is None
    True
    >>> exploration(argparse.Namespace(task="length", explore_max=1.5))
    {'max_temperature': 1.5}
    """
    if a.explore_max <= 1.0:
        return None
    return dict(RECIPES[a.task].get("explore", {}), max_temperature=a.explore_max)


def model_for(task: str) -> str:
    """The tiny model folder of ``task``'s recipe (other shapes live beside the default one)."""
    from .testing.tiny_model import default_model_dir, ensure_tiny_model

    shape = RECIPES[task]["model"]
    if not shape:
        return str(ensure_tiny_model())
    base = default_model_dir()
    tag = "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
    return str(ensure_tiny_model(base.with_name(f"{base.name}-{tag}"), **shape))


def _device(transport: str) -> str:
    import torch

    if transport == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--transport nccl needs a CUDA GPU; use gloo or memmap on CPU")
    return "cuda" if torch.cuda.is_available() else "cpu"


async def demo(a: argparse.Namespace, console: Any) -> dict[str, Any]:
    hide_broken_torch_extras()  # before transformers imports torchvision
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoTokenizer

    from .rl import GrpoConfig, GrpoTrainer, LoopConfig, Replicas, ReplicasProcess, plot_run, run_loop
    from .rl.cores import pin_process, plan_cores
    from .rl.tasks import Exploration, Shaping, make_task
    from .server import RedisServer

    a = resolve(a)
    learn = a.engine == "vllm"
    model_dir = model_for(a.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    recipe = RECIPES[a.task]
    shaping = recipe.get("shaping")
    explore = exploration(a) if learn else None
    extra: dict[str, Any] = {"shaping": Shaping(**shaping)} if shaping and learn else {}
    if explore is not None:
        if a.task != "length":
            raise SystemExit(f"--explore-max: the {a.task} task has no per-prompt exploration (length has)")
        try:
            extra["exploration"] = Exploration(**explore)
        except ValueError as e:
            raise SystemExit(f"--explore-max: {e}") from None
    task = make_task(a.task, len(tokenizer), **extra)
    heldout: float | None = None
    final: dict[str, Any] = {}
    broadcast = learn and a.transport in ("gloo", "nccl")
    cfg = LoopConfig(
        steps=a.steps, groups_per_step=a.groups, group_size=a.group_size, mode="async", max_lag=a.max_lag,
        transport="broadcast" if broadcast else ("ipc" if a.transport == "ipc" else "memmap"), seed=a.seed,
        agree_every=a.agree_every,
    )
    # On CPU the trainer and each replica get cores of their own where there are enough.
    device = _device(a.transport) if learn else None
    cores = plan_cores(a.replicas) if device == "cpu" and getattr(a, "pin", True) else None
    weights_root = tempfile.mkdtemp(prefix="rollq-demo-weights-")
    try:
        with RedisServer() as srv:
            console.print(f"[bold]redis[/] {srv.url}")
            kw: dict[str, Any] = dict(weights_root=weights_root, count=a.replicas, engine=a.engine, model=model_dir,
                                      broadcast=broadcast, dtype=a.dtype, cpu_binds=list(cores.replicas) if cores else None,
                                      logprobs_mode="processed_logprobs" if explore else "raw_logprobs")
            replica_process = getattr(a, "replica_process", False)
            replicas: Replicas | ReplicasProcess = (ReplicasProcess(srv.url, QUEUE, pin=list(cores.trainer) if cores else None, **kw)
                             if replica_process else Replicas(srv.url, QUEUE, **kw))
            with console.status(f"starting {a.replicas} {a.engine} replica(s)..."):
                await replicas.start()
            if cores is not None and not pin_process(cores.trainer):
                cores = None
            try:
                console.print(f"[bold]{a.replicas} {a.engine} replica(s)[/] ready in {replicas.start_s:.1f}s")
                if cores is not None:
                    console.print(f"[bold]cores[/] trainer {list(cores.trainer)}, replicas {list(cores.replicas)}")
                trainer = publisher = None
                if learn:
                    import torch

                    if device == "cpu":
                        torch.set_num_threads(a.trainer_threads)
                    grpo = GrpoConfig(lr=a.lr, entropy_coef=a.entropy_coef, scale_rewards=a.scale_rewards)
                    trainer = GrpoTrainer.from_pretrained(model_dir, grpo, seed=a.seed).to(device)
                    publisher = _publisher(srv.url, weights_root, a)
                with Progress(
                    TextColumn("[bold]steps"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console, transient=True,
                ) as prog:
                    bar = prog.add_task("", total=a.steps)

                    decay_after = recipe["decay_after"]

                    def on_step(rec: Any) -> None:
                        prog.update(bar, advance=1, description=f"reward {rec.reward:.3f}  v{rec.version}")
                        if trainer is not None:  # the next step's rate (the loop calls this between steps)
                            for g in trainer.optimizer.param_groups:
                                g["lr"] = lr_at(a.lr, decay_after, rec.step + 1, a.lr_min)

                    report = await run_loop(srv.url, QUEUE, trainer, task, tokenizer, publisher, cfg, on_step=on_step)
                if trainer is not None and hasattr(task, "heldout_specs"):
                    with console.status("held-out prompts..."):
                        heldout = await heldout_reward(srv.url, QUEUE, task, tokenizer, a.group_size, trainer.version)
                if trainer is not None and hasattr(task, "final_specs"):
                    with console.status("the final policy on every prompt..."):
                        specs = task.final_specs(tokenizer, a.group_size)
                        final = task.final_report(await generate(srv.url, QUEUE, specs, trainer.version))
                snap = await replicas.snapshot()
                report.updates = list(snap.updates)
                daemon = getattr(a, "mps_daemon", None)
                mps_servers = _mps_servers(daemon) if daemon is not None else None  # while its clients run
                served, converted = snap.served_dtype, snap.converted_from
                if publisher is not None:
                    await publisher.close()
            finally:
                await replicas.stop()
    finally:
        shutil.rmtree(weights_root, ignore_errors=True)
    summary = report.summary()
    if heldout is not None:
        summary["reward_heldout"] = round(heldout, 4)
    summary.update(final)
    summary.update(task=a.task, model=RECIPES[a.task]["model"] or "default", jobs=a.steps * a.groups, engine=a.engine,
                   replicas=a.replicas, transport=a.transport if learn else "none",
                   seed=a.seed, lr=a.lr if learn else None, lr_decay_after=recipe["decay_after"] if learn else None,
                   lr_min=a.lr_min if learn else None,
                   entropy_coef=a.entropy_coef if learn else None,
                   scale_rewards=a.scale_rewards if learn else None, shaping=shaping if learn else None,
                   explore=explore, engine_start_s=round(replicas.start_s, 1),
                   served_dtype=served, trainer_dtype=trainer.dtype if trainer is not None else None,
                   converted_from=converted, mps_servers=mps_servers, replica_process=replica_process,
                   cores={"trainer": list(cores.trainer), "replicas": list(cores.replicas)} if cores else None)
    try:
        png = plot_run(report.per_step(), a.plot, random_policy_reward=task.random_policy_reward,
                       title=f"rollq demo {a.task}: {a.engine}, {a.replicas} replicas, max lag {a.max_lag}, seed {a.seed}")
        summary["plot"] = str(png)
    except ModuleNotFoundError as e:  # matplotlib comes with the rl extra
        log.warning("no plot (%s); pip install 'rollq[rl]' for the reward plot", e)
        summary["plot"] = None
    return summary


async def heldout_reward(url: str, queue: str, task: Any, tokenizer: Any, group_size: int, version: int) -> float:
    """Mean reward of ``group_size`` samples on each held-out prompt of ``task``
    (``task.heldout_specs``), generated by the replicas of ``queue`` at ``version`` (the
    final policy) or later.

    >>> await heldout_reward(url, "demo", PositionalTask(), tokenizer, 8, trainer.version)   # doctest: +SKIP
    0.66
    """
    results = await generate(url, queue, task.heldout_specs(tokenizer, group_size), version)
    rewards = [x for r in results for x in task.rewards(r)]
    return sum(rewards) / len(rewards)


async def generate(url: str, queue: str, specs: list[dict[str, Any]], version: int) -> list[Any]:
    """The results of the jobs ``specs``, generated by the replicas of ``queue`` at
    ``version`` or later (an evaluation of the policy at ``version``); raises ``RuntimeError``
    if any job failed.

    >>> results = await generate(url, "demo", task.final_specs(tokenizer, 8), trainer.version)   # doctest: +SKIP
    """
    from .producer.client import Producer

    async with Producer(url, queue, producer_id="demo-eval") as p:
        specs = [dict(s, min_version=version) if version else s for s in specs]
        results = await p.gather(await p.submit_many(specs), timeout=600)
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} evaluation jobs failed, e.g. {errors[0].type}: {errors[0].message}")
    return results


def _publisher(url: str, weights_root: str, a: argparse.Namespace) -> Any:
    from .weightsync.trainer.publisher import WeightPublisher

    sender = None
    if a.transport in ("gloo", "nccl"):
        from .weightsync.nccl import BroadcastSender

        sender = BroadcastSender(num_workers=a.replicas, backend=a.transport, timeout=120)
    # keep=4 memmap slots: a replica still reading version v is not overwritten by v + 2. Over
    # ipc no memmap copy is written (the replicas share this host), and the trainer's tensors
    # are leased: the loop releases each version, once the replicas copied it, before the
    # trainer's next optimizer step changes them in place (no copy, no checksum).
    root = None if a.transport == "ipc" else weights_root
    return WeightPublisher(url, QUEUE, root=root, keep=4, trainer_id="demo-trainer", sender=sender,
                           ipc_lease=a.transport == "ipc")


#: Summary keys shown first in the table (the rest follow in order).
_HEADLINE = ("task", "reward_first", "reward_last", "reward_heldout", "reward_final", "random_policy_reward", "versions", "lag_histogram",
             "logprob_abs_diff_mean", "logprob_abs_diff_max", "weight_update_s", "pause_s",
             "rollout_tokens_per_s", "wall_s", "plot")


def _table(summary: dict[str, Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    t = Table(title="rollq demo", show_header=False)
    keys = [k for k in _HEADLINE if k in summary] + [k for k in summary if k not in _HEADLINE]
    for k in keys:
        v = summary[k]
        if k == "reward_by_step":
            v = " ".join(f"{x:.2f}" for x in v)
        elif k == "final_by_length":
            v = "  ".join(f"L={n}: {d['reward']:.2f}" for n, d in v.items())
        elif isinstance(v, float):
            v = f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:,.1f}" if abs(v) >= 1000 else f"{v:.4g}"
        t.add_row(Text(k), Text(str(v)))  # Text: no markup is interpreted in values
    return t


def _mps_servers(daemon: Any) -> list[int] | None:
    """The MPS servers ``daemon`` runs (its clients attached to them); None where it cannot say."""
    from .rl.mps import MpsUnavailable

    try:
        return daemon.servers()
    except MpsUnavailable as e:
        log.warning("the MPS daemon's servers: %s", e)
        return None


def run_demo(a: argparse.Namespace) -> int:
    from rich.console import Console

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the demo's output readable
    # vLLM logs to stdout by default; --json promises one object there. (Shutting an engine
    # down makes vLLM 0.32's output handler log an EngineDeadError traceback: noise, on stderr.)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    console = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        if getattr(a, "mps", False):
            from .rl.mps import MpsDaemon, MpsUnavailable

            try:  # before anything in this process or the engines' touches CUDA
                a.mps_daemon = stack.enter_context(MpsDaemon())
            except MpsUnavailable as e:
                console.print(f"rollq demo --mps: {e}", markup=False, highlight=False, soft_wrap=True)
                return 2
        summary = asyncio.run(demo(a, console))
    if a.json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        Console().print(_table(summary))
    return 0 if summary["failed_jobs"] == 0 and summary["steps"] == a.steps else 1
