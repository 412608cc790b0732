"""A trainer that publishes over the IPC transport, in its own process, for tests that kill it.

    python -m tests.weightsync.ipc_trainer_proc URL QUEUE MODEL_DIR [--shared]

Reads one command a line on stdin and answers one JSON line on stdout:

- ``publish SEED``: publish the model folder's checkpoint (SEED 0) or a perturbed copy of it
  (:func:`perturbed`) with ``transport="ipc"``; answers ``{"version": V, "timings": {...}}``
  once the version is committed (its tensors stay exposed until the next command says so).
- ``release``: stop exposing the current version (the process lives on); ``{"released": true}``.

``--shared``: the tensors are put in shared memory first (``share_memory_()``), so the
transport exposes them zero-copy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import torch

from rollq.weightsync import WeightPublisher
from rollq.weightsync.transports.ipc import release


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` plus seeded noise (seed 0: ``state`` itself)."""
    if seed == 0:
        return {k: v.clone() for k, v in state.items()}
    g = torch.Generator().manual_seed(seed)
    return {k: (v + torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) * 0.5) for k, v in state.items()}


async def main(a: argparse.Namespace) -> int:
    from tests.vllm_fixtures import checkpoint_state

    base = checkpoint_state(a.model)
    pub = WeightPublisher(a.url, a.queue, trainer_id="ipc-trainer")
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line:
                return 0
            if line[0] == "publish":
                state = perturbed(base, int(line[1]))
                if a.shared:
                    for t in state.values():
                        t.share_memory_()
                rec = await pub.publish_weights(state, transport="ipc")
                out: dict = {"version": rec.version, "timings": rec.timings}
            elif line[0] == "release":
                out = {"released": release(pub)}
            else:
                out = {"error": f"unknown command {line[0]!r}"}
            print(json.dumps(out), flush=True)
    finally:
        await pub.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="ipc_trainer_proc")
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("model")
    p.add_argument("--shared", action="store_true")
    sys.exit(asyncio.run(main(p.parse_args())))
