"""Broadcast transport: the trainer sends a version to every replica's workers at once over
its broadcast group (:class:`~rollq.weightsync.trainer.sender.BroadcastSender`, NCCL or Gloo); the
record names the group's backend (``nccl`` or ``gloo``).

Trainer side :class:`BroadcastSend`; replica side :class:`BroadcastReceive`, whose workers
received the version while the engine served (:class:`~rollq.weightsync.replica._receiver.ReplicaReceiver`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ...errors import WeightSyncError
from ..wire import SwapReport
from .base import ReplicaTransport, Staged, TrainerTransport
from .memmap import MemmapSend

if TYPE_CHECKING:
    import torch

    from ..versions import VersionRecord

log = logging.getLogger(__name__)


class MissedBroadcast(WeightSyncError):
    """The committed version was broadcast before this replica was in the group, and has no
    memmap copy: the replica takes the next version instead (it is in the next group)."""

    def __init__(self, version: int, group: str | None):
        super().__init__(f"version {version} was broadcast over group {group} without this replica and has no memmap copy it can read")
        self.version = version


class BroadcastSend(TrainerTransport):
    """Broadcast ``version``; a broken group is formed anew (without who broke it) and the
    version offered once more; then, failing that, memmap for everyone. Workers that did not
    ack a committed broadcast get a memmap copy in the same record (with a store)."""

    async def send(self, version: int, items: list[tuple[str, torch.Tensor]]) -> VersionRecord:
        from ..trainer.sender import GroupBroken

        pub = self.publisher
        if pub.sender is None:
            raise WeightSyncError("the broadcast needs a sender (WeightPublisher(sender=BroadcastSender(...)))")
        rec: VersionRecord | None = None
        for attempt in (1, 2):
            try:
                rec = await pub.sender.send(version, items, await pub.redis(), pub.keys)
                break
            except GroupBroken as e:
                err: Exception = e
                if attempt == 1:
                    log.warning("%s; offering version %d again over a new group", e, version)
            except Exception as e:
                err = e
                break
        if rec is None:
            log.warning("broadcast of version %d failed (%s: %s); falling back to memmap", version, type(err).__name__, err)
            await pub.sender.reset()
            if pub.store is None:
                raise err
            rec = await MemmapSend(pub).send(version, items)
            rec.timings["nccl_failed"] = 1.0
            return rec
        rec.trainer = pub.trainer_id
        if rec.timings.get("missing") and pub.store is not None:
            info = await asyncio.to_thread(pub.store.write, version, items)
            rec.memmap_slot, rec.checksum = info.slot, info.checksum
        return rec


class BroadcastReceive(ReplicaTransport):
    """The version this replica's workers received over the group; None when the replica is
    in no group, or was not sent it and the record offers a memmap copy instead."""

    async def stage(self, rec: VersionRecord, acks: list[Any] | None) -> Staged | None:
        if self.receiver is None:
            return None
        version = await self.receiver.staged_for(rec, acks=acks)
        if version is not None:
            return Staged(version, self)
        if rec.memmap_slot is None:
            # committed without this replica's workers (it joined late, or was left out)
            raise MissedBroadcast(rec.version, rec.group)
        return None

    async def swap(self, rec: VersionRecord, staged: Staged) -> SwapReport:
        assert self.receiver is not None
        return await self.receiver.apply_staged(rec, staged.version, timeout=self.settings.load_timeout)
