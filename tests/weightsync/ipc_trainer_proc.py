"""A trainer that publishes over the IPC transport, in its own process, for tests that kill it.

    python -m tests.weightsync.ipc_trainer_proc URL QUEUE MODEL_DIR [--shared] [--root DIR]

Reads one command a line on stdin and answers one JSON line on stdout:

- ``publish SEED``: publish the model folder's checkpoint (SEED 0) or a perturbed copy of it
  (:func:`perturbed`) with ``transport="ipc"``; answers ``{"version": V, "timings": {...}}``
  once the version is committed (its tensors stay exposed until the next command says so).
- ``release``: stop exposing the current version (the process lives on); ``{"released": true}``.
- ``release_copied T``: ``WeightPublisher.release_weights(timeout=T)``: wait for the replicas
  on this host to have copied the version, then stop exposing it; ``{"copied": {replica: V}}``.
- ``bump X``: add X to every tensor of the last published state, in place (a trainer's next
  optimizer step right after publishing); ``{"bumped": X}``.

``--shared``: the tensors are put in shared memory first (``share_memory_()``), so the
transport exposes them zero-copy. ``--root``: the publisher's memmap store, which then holds a
memmap copy of every version too. ``--snapshot``: ``WeightPublisher(ipc_snapshot=True)``
(each version exposed as copies taken at publish). ``--lease``: ``WeightPublisher(ipc_lease=True)``
(the tensors exposed without checksums until ``release_copied``). ``--inplace``: every publish after the
first writes its values into the tensors of the first (as an optimizer step does), so every
version exposes the same storages.

Tests drive it through :func:`trainer`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any, AsyncIterator

import torch

from rollq.weightsync import WeightPublisher
from rollq.weightsync.transports.ipc_lease import release

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` plus seeded noise (seed 0: ``state`` itself)."""
    if seed == 0:
        return {k: v.clone() for k, v in state.items()}
    g = torch.Generator().manual_seed(seed)
    return {k: (v + torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) * 0.5) for k, v in state.items()}


class Trainer:
    """``tests.weightsync.ipc_trainer_proc`` in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def _ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        got = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        assert got, f"the trainer process exited (code {self.proc.returncode})"
        out: dict[str, Any] = json.loads(got)
        return out

    async def publish(self, seed: int) -> dict[str, Any]:
        """Publish the checkpoint (seed 0) or a perturbed copy; the committed version and timings."""
        return await self._ask(f"publish {seed}")

    async def release(self) -> None:
        assert (await self._ask("release")) == {"released": True}

    async def release_copied(self, timeout: float) -> dict[str, int]:
        """``WeightPublisher.release_weights``: ``{replica: version copied or served}``."""
        copied: dict[str, int] = (await self._ask(f"release_copied {timeout}"))["copied"]
        return copied

    async def bump(self, x: float) -> None:
        assert (await self._ask(f"bump {x}")) == {"bumped": x}

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()  # reaped: no zombie holds anything


@contextlib.asynccontextmanager
async def trainer(url: str, queue: str, model: Any, *args: str) -> AsyncIterator[Trainer]:
    """This module in a process of its own (killed at the end if still running)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.weightsync.ipc_trainer_proc", url, queue, str(model), *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    try:
        yield Trainer(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def main(a: argparse.Namespace) -> int:
    if a.cuda:  # the tensors of tests/weightsync/test_gpu.py's Fused model, on the GPU
        from tests.weightsync.test_gpu import ckpt

        base = ckpt(0.0, "cuda:0")
    else:
        from tests.vllm_fixtures import checkpoint_state

        base = checkpoint_state(a.model)
    pub = WeightPublisher(a.url, a.queue, trainer_id="ipc-trainer", root=a.root or None, ipc_snapshot=a.snapshot,
                          ipc_lease=a.lease)
    loop = asyncio.get_running_loop()
    state: dict[str, torch.Tensor] = {}
    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line:
                return 0
            if line[0] == "publish":
                new = ckpt(float(line[1]), "cuda:0") if a.cuda else perturbed(base, int(line[1]))
                if a.inplace and state:  # an optimizer step: the same storages, new values
                    with torch.no_grad():
                        for k, t in state.items():
                            t.copy_(new[k])
                    if a.cuda:
                        torch.cuda.synchronize()
                else:
                    state = new
                    if a.shared:
                        for t in state.values():
                            t.share_memory_()
                rec = await pub.publish_weights(state, transport="ipc")
                out: dict = {"version": rec.version, "timings": rec.timings}
            elif line[0] == "release":
                out = {"released": release(pub)}
            elif line[0] == "release_copied":
                out = {"copied": await pub.release_weights(timeout=float(line[1]))}
            elif line[0] == "bump":
                with torch.no_grad():
                    for t in state.values():
                        t.add_(float(line[1]))
                if a.cuda:
                    torch.cuda.synchronize()
                out = {"bumped": float(line[1])}
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
    p.add_argument("--root", default="")
    p.add_argument("--cuda", action="store_true", help="publish test_gpu.ckpt(SEED) from cuda:0 (MODEL_DIR unused)")
    p.add_argument("--snapshot", action="store_true", help="WeightPublisher(ipc_snapshot=True)")
    p.add_argument("--lease", action="store_true", help="WeightPublisher(ipc_lease=True)")
    p.add_argument("--inplace", action="store_true", help="every publish after the first writes into the same tensors")
    sys.exit(asyncio.run(main(p.parse_args())))
