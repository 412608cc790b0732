"""Trainer side of weight sync: publish a new policy version.

>>> pub = WeightPublisher(url, queue="grpo", root="/dev/shm/rollq-weights")   # doctest: +SKIP
>>> rec = await pub.publish_weights(model.state_dict())                      # doctest: +SKIP
>>> rec.version                                                              # doctest: +SKIP
1

Order of operations (a version is visible only once complete): write the data into the
next memmap slot, write its commit marker with the checksum, then record the version in
Redis (durable), then announce it on pub/sub, then append it to the version log (the last
three in one Lua script, refused unless the version is newer than the recorded one).

With ``transport="nccl"`` the tensors are broadcast from this process (rank 0) to every
replica worker that joined the group (:class:`~rollq.weightsync.nccl.BroadcastSender`); on
any failure or timeout the group is dropped (rebuilt next time) and the same version is
published through memmap instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable, Mapping

import torch

from ..connection import connect
from ..errors import StaleVersion, WeightSyncError
from ..keys import QueueKeys
from ..settings import DEFAULT_QUEUE, RedisSettings
from .memmap import MemmapStore, named_tensors
from .versions import VersionRecord, commit_version, read_version

log = logging.getLogger(__name__)


class WeightPublisher:
    """Publishes policy versions of one queue."""

    def __init__(
        self,
        url: str | RedisSettings | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        root: str | None = None,
        keep: int = 2,
        sender: Any = None,
        trainer_id: str = "",
    ):
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.keys = QueueKeys(queue)
        self.store = MemmapStore(root, keep=keep) if root else None
        #: Optional rollq.weightsync.nccl.BroadcastSender for transport="nccl".
        self.sender = sender
        self.trainer_id = trainer_id
        self._client: Any = None
        self._last = 0

    async def _c(self) -> Any:
        if self._client is None:
            self._client = connect(self.redis_settings)
        return self._client

    async def current_version(self) -> int:
        rec = await read_version(await self._c(), self.keys)
        return rec.version if rec else 0

    async def publish_weights(
        self,
        state: Mapping[str, torch.Tensor] | torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        transport: str = "memmap",
    ) -> VersionRecord:
        """Publish ``state`` as ``version`` (default: the recorded version + 1)."""
        client = await self._c()
        current = await self.current_version()
        if version is None:
            version = max(current, self._last) + 1
        elif version <= current:
            raise StaleVersion(f"version {version} is not newer than the recorded version {current}")
        items = named_tensors(state)
        t0 = time.perf_counter()
        if transport == "nccl":
            rec = await self._publish_nccl(version, items)
        elif transport == "memmap":
            rec = await self._publish_memmap(version, items)
        else:
            raise ValueError(f"unknown transport {transport!r} (memmap, nccl)")
        rec.timings["total_s"] = time.perf_counter() - t0
        if not await commit_version(client, self.keys, rec):
            raise StaleVersion(f"version {version} lost a race: a newer version was recorded meanwhile")
        self._last = version
        log.info("published policy version %d via %s (%.1f MB, %.3fs)", version, rec.transport, rec.nbytes / 1e6, rec.timings["total_s"])
        return rec

    async def _publish_memmap(self, version: int, items: list[tuple[str, torch.Tensor]], **extra: Any) -> VersionRecord:
        if self.store is None:
            raise WeightSyncError("memmap transport needs a root directory (WeightPublisher(root=...))")
        info = await asyncio.to_thread(self.store.write, version, items)
        return VersionRecord(
            version=version, transport="memmap", checksum=info.checksum, num_tensors=len(items),
            nbytes=info.nbytes, memmap_slot=info.slot, trainer=self.trainer_id,
            timings={"write_s": info.write_s, "checksum_s": info.checksum_s, "pinned": float(info.pinned)}, **extra,
        )

    async def _publish_nccl(self, version: int, items: list[tuple[str, torch.Tensor]]) -> VersionRecord:
        if self.sender is None:
            raise WeightSyncError("nccl transport needs a sender (WeightPublisher(sender=BroadcastSender(...)))")
        try:
            rec = await self.sender.send(version, items, await self._c(), self.keys)
            rec.trainer = self.trainer_id
            return rec
        except Exception as e:
            log.warning("broadcast of version %d failed (%s: %s); falling back to memmap", version, type(e).__name__, e)
            await self.sender.reset()
            if self.store is None:
                raise
            rec = await self._publish_memmap(version, items)
            rec.timings["nccl_failed"] = 1.0
            return rec

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
