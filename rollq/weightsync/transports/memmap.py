"""Memmap transport: the trainer writes a version into a slot of shared storage
(:class:`~rollq.weightsync.memmap.MemmapStore`); each replica's workers read it from there.

Trainer side :class:`MemmapSend`; replica side :class:`MemmapReceive`, which stages a version
(read, copied to the device and verified in a worker thread) while the engine serves, so the
swap only exchanges it. It is also every other transport's fallback: a record that offers a
memmap copy (``memmap_slot``) is loaded from it when the replica did not receive the version.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ...errors import WeightSyncError, WeightSyncTimeout
from ..wire import SwapReport
from .base import ReplicaTransport, Staged, TrainerTransport

if TYPE_CHECKING:
    import torch

    from ..versions import VersionRecord


class MemmapSend(TrainerTransport):
    """Writes the version into the publisher's store (``WeightPublisher(root=...)``)."""

    async def send(self, version: int, items: list[tuple[str, torch.Tensor]], **extra: Any) -> VersionRecord:
        pub = self.publisher
        if pub.store is None:
            raise WeightSyncError("memmap transport needs a root directory (WeightPublisher(root=...))")
        info = await asyncio.to_thread(pub.store.write, version, items)
        return pub.memmap_record(info, **extra)


class MemmapReceive(ReplicaTransport):
    """Stages a version from the store at ``settings.root`` into every worker, then swaps it in."""

    async def stage(self, rec: VersionRecord, acks: list[Any] | None = None) -> Staged | None:
        """Have every worker stage ``rec`` in a thread of its own, polling until all did;
        None without a memmap copy, a root, or weights (an echo engine)."""
        root, timeout = self.settings.root, self.settings.load_timeout
        if rec.memmap_slot is None or root is None:
            return None
        started = await asyncio.wait_for(
            self.workers.stage_memmap(root=root, slot=rec.memmap_slot, version=rec.version, checksum=rec.checksum,
                                      chunks_in_flight=self.settings.memmap_chunks_in_flight),
            timeout,
        )
        if not started:  # an engine without weights (echo): nothing to stage
            return None
        return await self._until_staged(rec, self.workers.staged_status, delay=0.005,
                                        failed=f"staging version {rec.version} failed",
                                        slow=f"staging version {rec.version}")

    async def swap(self, rec: VersionRecord, staged: Staged) -> SwapReport:
        return await self._swap_in_workers(rec, staged)

    async def load(self, rec: VersionRecord) -> SwapReport:
        """Load ``rec`` from its memmap copy in the swap call itself (nothing was staged)."""
        root, timeout = self.settings.root, self.settings.load_timeout
        if rec.memmap_slot is None:
            raise WeightSyncError(
                f"version {rec.version} was sent over {rec.transport} and this replica did not receive it; "
                "no memmap copy is recorded yet"
            )
        if root is None:
            raise WeightSyncError("version is in memmap storage but this replica has no weights root (--weights-root)")
        try:
            res = await asyncio.wait_for(
                self.workers.load_memmap(root=root, slot=rec.memmap_slot, version=rec.version, checksum=rec.checksum),
                timeout,
            )
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(
                f"loading version {rec.version} from memmap took longer than {timeout}s (load_timeout)"
            ) from e
        for r in res:  # refused data comes back as a value, raised here as its own type
            if r.error is not None:
                raise r.error.exception(f"version {rec.version} refused: ")
        return res[0] if res else SwapReport()
