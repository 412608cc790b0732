"""The ``rollq`` command line.

    rollq redis [--cluster N]                    embedded redis-server (or N-master cluster); prints its URL
    rollq consume --engine echo|vllm ...         run one replica
    rollq submit FILE.jsonl [--wait]             submit jobs (one JSON object per line)
    rollq status [--json] [--watch S]            queue depth, in flight, replicas (every queue in use)
    rollq dlq list|requeue|purge [--json]        dead letters (of every shard)
    rollq queue create NAME --shards K           record a queue's shard count before its clients start
    rollq check --id REPLICA                     liveness probe: exit 0 if its lease is live
    rollq dashboard [--port P]                   live web dashboard, JSON API, /metrics
    rollq top                                    live terminal view
    rollq demo [--task T] [--json]               an async GRPO run that learns (embedded Redis, vLLM, trainer)

``--url`` defaults to ``$ROLLQ_REDIS_URL``; ``--queue`` to ``default`` (``status``, ``dashboard``
and ``top``: every queue in use, from the registry producers and consumers keep).
"""

from __future__ import annotations

import argparse
import os

from ..connection import RETRYABLE
from ..errors import RedisAuthError, ShardCountMismatch
from ..settings import read_url_file
from . import consume, queues, server, submit
from .common import err_console, setup_logging


def cmd_demo(a: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(a)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, each registered by its module."""
    p = argparse.ArgumentParser(prog="rollq", description="Redis-Streams job queue feeding vLLM replicas")
    p.add_argument("--log-level", default=os.environ.get("ROLLQ_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in (server, consume, submit, queues):
        module.register(sub)
    s = sub.add_parser("demo", help="end-to-end demo: an async GRPO run through rollq (embedded Redis, vLLM replicas, trainer)")
    s.add_argument("--engine", choices=["echo", "vllm"], default="vllm",
                   help="vllm: train the tiny model; echo: queue only (no weights, nothing trained)")
    s.add_argument("--task", choices=["bucket", "positional", "length", "two_turn"], default="bucket",
                   help="bucket: the quick run; positional, length, two_turn: harder tasks (rollq/rl/tasks), each with its "
                        "own recipe (model, steps, groups, lr) for the options left out")
    s.add_argument("--replicas", type=int, default=2)
    s.add_argument("--steps", type=int, help="trainer steps (policy versions published; default: the task's, 40 for bucket)")
    s.add_argument("--groups", type=int, help="GRPO groups (jobs) per step (default: the task's, 16 for bucket)")
    s.add_argument("--group-size", type=int, help="samples per group (sampling n; default: the task's, 8 for bucket)")
    s.add_argument("--max-lag", type=int, default=1, help="staleness bound in policy versions")
    s.add_argument("--transport", choices=["memmap", "gloo", "nccl", "ipc"], default="memmap",
                   help="weight sync: memmap files, a gloo (CPU) / NCCL (GPU) broadcast, or ipc (the trainer's "
                        "tensors shared with the replicas on its host: CUDA IPC or CPU shared memory)")
    s.add_argument("--lr", type=float, help="Adam learning rate (default: the task's, 5e-3 for bucket)")
    s.add_argument("--lr-min", type=float,
                   help="floor of the lr decay (default: the task's, 0 for every task: the plain decay)")
    s.add_argument("--entropy-coef", type=float,
                   help="entropy bonus, GrpoConfig.entropy_coef (default: the task's, 0 for every task)")
    s.add_argument("--scale-rewards", choices=["group", "batch", "none"],
                   help="advantages: a group's centred rewards over its own std (GRPO), the batch's std, or none "
                        "(Dr. GRPO); GrpoConfig.scale_rewards (default: the task's, group for every task)")
    s.add_argument("--explore-max", type=float,
                   help="length: sample a prompt whose groups all earn one wrong reward hotter, up to this "
                        "temperature (rollq.rl.tasks.Exploration; 1: off; default: the task's recipe)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--trainer-threads", type=int, default=1, help="CPU: torch threads of the trainer")
    s.add_argument("--no-pin", dest="pin", action="store_false",
                   help="CPU: leave placement to the OS (default: each replica on a core of its own, the last "
                        "ones, and the trainer on the rest, where there are more cores than replicas)")
    s.add_argument("--dtype", default="auto",
                   help="the replicas' served dtype (auto: float32 on CPU, the checkpoint's own on GPU)")
    s.add_argument("--mps", action="store_true",
                   help="GPU: run the trainer and the replicas' engines as clients of a CUDA MPS daemon of the demo's "
                        "own, so that training and generation on one GPU run side by side instead of taking turns")
    s.add_argument("--replica-process", action="store_true",
                   help="host the replicas (vLLM front ends, consumers, weight followers) in a child process of their "
                        "own, apart from the trainer's, as a deployment runs them (rollq.rl.ReplicasProcess)")
    s.add_argument("--plot", default="rollq-demo.png", help="PNG of reward and policy lag (a .json beside it)")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    s.set_defaults(fn=cmd_demo)

    from ..dashboard.cli import register

    register(sub)  # rollq dashboard, rollq top
    from ..serve.cli import register as register_serve

    register_serve(sub)  # rollq serve
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level)
    try:
        if getattr(a, "url_file", None) and not getattr(a, "url", None):
            a.url = read_url_file(a.url_file)
        return a.fn(a) or 0
    except KeyboardInterrupt:
        return 130
    except (RedisAuthError, ShardCountMismatch, ValueError) as e:  # a wrong password, an unreadable URL file,
        # --shards other than the queue's recorded count
        err_console().print(f"rollq: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except RETRYABLE as e:  # commands that need Redis once (submit, status, dlq) and cannot reach it
        err_console().print(f"rollq: cannot reach Redis: {e}", markup=False, highlight=False, soft_wrap=True)
        return 3

