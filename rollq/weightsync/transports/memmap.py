"""Memmap transport: the trainer writes a version into a slot of shared storage
(:class:`~rollq.weightsync.memmap.MemmapStore`); each replica's workers read it from there.

Trainer side :class:`MemmapSend`; replica side :class:`MemmapReceive`, which stages a version
(read, copied to the device and verified in a worker thread) while the engine serves, so the
swap only exchanges it. It is also every other transport's fallback: a record that offers a
memmap copy (``memmap_slot``) is loaded from it when the replica did not receive the version.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ...errors import CorruptWeights, WeightSyncError, WeightSyncTimeout
from ..wire import State, SwapReport
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
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            states = await self.workers.staged_status()
            if all(s.state is State.STAGED and s.version == rec.version for s in states):
                return Staged(rec.version, self, report=states[0].report())
            bad = [s for s in states if s.state is State.FAILED or s.version not in (0, rec.version)]
            if bad:
                msg = "; ".join(str(s.error or s) for s in bad)
                if any(s.error is not None and s.error.corrupt for s in bad):
                    raise CorruptWeights(f"version {rec.version} refused: {msg}")
                raise WeightSyncError(f"staging version {rec.version} failed: {msg}")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"staging version {rec.version} took longer than {timeout}s (load_timeout)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    async def swap(self, rec: VersionRecord, staged: Staged) -> SwapReport:
        timeout = self.settings.load_timeout
        try:
            res = await asyncio.wait_for(self.workers.apply_staged(version=staged.version), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(f"swapping in version {rec.version} took longer than {timeout}s") from e
        return res[0] if res else SwapReport()

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
