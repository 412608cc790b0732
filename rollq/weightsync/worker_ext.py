"""vLLM worker extension: loads rollq weight versions inside every vLLM worker.

Pass ``worker_extension_cls="rollq.weightsync.worker_ext.RollqWorkerExtension"`` to the engine;
the replica then calls these methods by name through ``collective_rpc`` (one call per update
for all workers, never one per tensor). Methods run inside each worker process, next to the
model, so the weights never travel through the engine's RPC channel.

Loading: on GPU workers ``model.load_weights`` (the checkpoint-format loader every vLLM model
has); on the CPU backend, whose linear layers are repacked at start-up,
``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import torch

log = logging.getLogger(__name__)

#: Prefix of worker errors that mean "the stored version is corrupt" (see WeightFollower).
CORRUPT_TAG = "[rollq:CorruptWeights]"


class RollqWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    # -- loading -----------------------------------------------------------------------
    def _rollq_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device):
            return dev
        return torch.device("cpu")

    def _rollq_load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._rollq_device().type == "cpu" and hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=iter(list(items)), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=iter(items))

    def rollq_load_memmap(self, root: str, slot: str, version: int, checksum: str, verify: bool = True) -> dict[str, Any]:
        """Load committed ``version`` from a memmap slot; returns timings (seconds).

        On a GPU the tensors are copied to the device first and verified there (the checksum
        runs at memory bandwidth); on CPU they are verified in place.
        """
        from ..errors import CorruptWeights
        from .checksum import state_checksum
        from .memmap import MemmapStore

        dev = self._rollq_device()
        t0 = time.perf_counter()
        try:
            items = MemmapStore(root).read(slot, version=version, checksum=checksum, verify=verify and dev.type != "cuda")
            t1 = time.perf_counter()
            if dev.type == "cuda":
                items = [(n, t.to(dev, non_blocking=True)) for n, t in items]
                torch.cuda.synchronize(dev)
                if verify and state_checksum(items) != checksum:
                    raise CorruptWeights(f"version {version} in {slot}: checksum mismatch after copying to {dev}")
        except CorruptWeights as e:
            # Only a message crosses collective_rpc: tag it so the replica re-raises the type.
            raise RuntimeError(f"{CORRUPT_TAG} {e}") from e
        t2 = time.perf_counter()
        self._rollq_load(items)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t3 = time.perf_counter()
        self._rollq_version = version
        return {"read_s": t1 - t0, "copy_verify_s": t2 - t1, "load_s": t3 - t2}

    def rollq_stage_memmap(self, root: str, slot: str, version: int, checksum: str) -> dict[str, Any]:
        """Read, copy to the device and verify ``version`` while the engine keeps serving;
        :meth:`rollq_apply_staged` then swaps it in (the only step inside the pause)."""
        from ..errors import CorruptWeights
        from .checksum import state_checksum
        from .memmap import MemmapStore

        dev = self._rollq_device()
        t0 = time.perf_counter()
        try:
            items = MemmapStore(root).read(slot, version=version, checksum=checksum, verify=dev.type != "cuda")
            if dev.type == "cuda":
                stream = torch.cuda.Stream(dev)  # off the engine's stream
                with torch.cuda.stream(stream):
                    items = [(n, t.to(dev, non_blocking=True)) for n, t in items]
                    if state_checksum(items) != checksum:
                        raise CorruptWeights(f"version {version} in {slot}: checksum mismatch after copying to {dev}")
        except CorruptWeights as e:
            raise RuntimeError(f"{CORRUPT_TAG} {e}") from e
        self._rollq_staged_mm = (version, items)
        return {"stage_s": time.perf_counter() - t0}

    # -- broadcast (NCCL / gloo) -------------------------------------------------------
    def rollq_join_group(self, info: bytes, rank_offset: int) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset + self.rank`` (in a thread)."""
        import threading

        import msgspec

        from .nccl import GroupInfo, WorkerReceiver

        gi = msgspec.msgpack.decode(info, type=GroupInfo)
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._rollq_status = {"state": "joining", "group": gi.id, "joined": False}

        def join() -> None:
            try:
                self._rollq_receiver = WorkerReceiver(gi, rank, self._rollq_device())
                self._rollq_status = {"state": "idle", "group": gi.id, "joined": True, "rank": rank}
            except Exception as e:
                self._rollq_status = {"state": "failed", "group": gi.id, "joined": False, "error": f"{type(e).__name__}: {e}"}

        threading.Thread(target=join, name="rollq-join", daemon=True).start()

    def rollq_receive(self, offer: bytes, replica: str = "", redis_url: str = "") -> None:
        """Start receiving an offered version into the staging buffer (returns at once).

        With ``replica`` and ``redis_url`` the worker acknowledges in the offer's ack hash
        itself (field ``replica/rank-in-replica``) once the version is staged or has failed.
        """
        import msgspec

        from .nccl import Offer

        rcv = getattr(self, "_rollq_receiver", None)
        if rcv is None:
            raise RuntimeError("this worker has not joined a broadcast group")
        ack = (redis_url, f"{replica}/{int(getattr(self, 'rank', 0))}") if replica and redis_url else None
        rcv.start_receive(msgspec.msgpack.decode(offer, type=Offer), ack)

    def rollq_receive_status(self) -> dict[str, Any]:
        rcv = getattr(self, "_rollq_receiver", None)
        base = dict(getattr(self, "_rollq_status", {"state": "idle"}))
        if rcv is not None:
            base.update(rcv.status)
            base["group"] = rcv.info.id
            base["joined"] = True
        return base

    def rollq_apply_staged(self, version: int) -> dict[str, Any]:
        """Swap a staged version in (the only step that runs while generation is paused)."""
        t0 = time.perf_counter()
        mm = getattr(self, "_rollq_staged_mm", None)
        if mm is not None and mm[0] == version:
            items = mm[1]
            self._rollq_staged_mm = None
        else:
            items = self._rollq_receiver.take(version)
        self._rollq_load(items)
        if self._rollq_device().type == "cuda":
            torch.cuda.synchronize(self._rollq_device())
        self._rollq_version = version
        return {"load_s": time.perf_counter() - t0}

    def rollq_version(self) -> int:
        return getattr(self, "_rollq_version", 0)

    def rollq_weight_sample(self, name_contains: str = "embed") -> list[float]:
        """A few values of one parameter (tests use it to see an update land)."""
        for name, p in self.model_runner.model.named_parameters():
            if name_contains in name and p.numel() > 0:
                return p.detach().reshape(-1)[:4].float().cpu().tolist()
        return []
