"""Replica side of the broadcast: gets this replica's workers into the trainer's group.

Runs in the consumer's process, on its event loop, as :attr:`WeightFollower.receiver
<rollq.weightsync.follower.WeightFollower.receiver>`. It joins each new group (``wgroup``
hints, and a check of the group record every ``poll_interval`` seconds), tells the follower
which committed versions its workers staged (their acks), and swaps a staged version in.
The offers themselves are followed by the workers (:mod:`rollq.weightsync.listener`), so no
engine RPC sits on the update's path before the swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from ..errors import WeightSyncError, WeightSyncTimeout
from ..protocol import Control
from .base import Replica
from .versions import VersionRecord
from .wire import GroupInfo, Listen, State, WorkerStatus, decode_ack, from_wire

log = logging.getLogger(__name__)


class ReplicaReceiver:
    """This replica's workers as ranks of the trainer's broadcast group."""

    def __init__(self, consumer: Replica, poll_interval: float = 1.0):
        self.consumer = consumer
        self.engine = consumer.engine
        self.keys = consumer.keys
        self.poll_interval = poll_interval
        #: The group this replica's workers joined (or gave up on: it was full).
        self.group: str | None = None
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._client: Any = None

    @property
    def num_workers(self) -> int:
        return int(getattr(self.engine, "num_workers", 1))

    def fields(self) -> list[str]:
        """This replica's workers' fields in an offer's ack hash."""
        return [f"{self.consumer.id}/{i}" for i in range(self.num_workers)]

    async def start(self, client: Any) -> None:
        self._client = client
        self.consumer.add_control_handler(self._on_control)
        self._task = asyncio.create_task(self._loop(), name="rollq-broadcast-receiver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.group is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.call_workers("rollq_leave_group"), 30)

    def _on_control(self, verb: Control, arg: str) -> None:
        if verb is Control.WGROUP:
            self._kick.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("broadcast receiver: %s: %s", type(e).__name__, e)
            try:
                await asyncio.wait_for(self._kick.wait(), self.poll_interval)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()

    # -- joining ---------------------------------------------------------------------------
    async def check(self) -> None:
        """Join the trainer's current group unless this replica already did."""
        g = await self._client.hget(self.keys.weights_group, "d")
        if g is None:
            return
        info = msgspec.msgpack.decode(g, type=GroupInfo)
        if info.id != self.group:
            await self._join(info)

    async def _join(self, info: GroupInfo) -> None:
        n = self.num_workers
        end = await self._client.hincrby(self.keys.weights_group, "next_rank", n)
        offset = end - n
        if end > info.world_size:
            log.warning("broadcast group %s is full (world size %d); loading versions from memmap", info.id, info.world_size)
            self.group = info.id  # do not retry this group
            return
        self.group = None
        # full_url: a cluster URL stays one in the workers (url has the cluster flag stripped)
        listen = Listen(url=self.consumer.redis_settings.full_url, channel=self.keys.control,
                        offer_key=self.keys.weights_offer, field=f"{self.consumer.id}/",
                        layouts_key=self.keys.weights_layouts, version_key=self.keys.version)
        await self.engine.call_workers("rollq_join_group", msgspec.msgpack.encode(info), offset, msgspec.msgpack.encode(listen))
        await self._wait_joined(info, info.timeout + 5)
        self.group = info.id
        log.info("replica %s joined broadcast group %s as ranks %d..%d", self.consumer.id, info.id, offset, end - 1)

    async def _wait_joined(self, info: GroupInfo, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            raw = await self.engine.call_workers("rollq_receive_status")
            states = [from_wire(s, WorkerStatus, "rollq_receive_status") for s in raw]
            if states and all(s.group == info.id and s.joined for s in states):
                return
            failed = [s for s in states if s.state is State.FAILED]
            if failed:
                raise WeightSyncError(f"workers failed to join the broadcast group: {[str(s.error) for s in failed]}")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"workers did not finish joining within {timeout:.0f}s: {states}")
            await asyncio.sleep(0.01)

    # -- staged versions -------------------------------------------------------------------
    async def staged_for(self, rec: VersionRecord, acks: list[Any] | None = None) -> int | None:
        """``rec.version`` if every worker of this replica staged it (their acks are ok);
        ``acks``: the ack fields of this replica, already read."""
        if rec.group is None or rec.group != self.group:
            return None
        if acks is None:
            acks = await self._client.hmget(self.keys.weights_acks(rec.version), self.fields())
        got = [decode_ack(a) for a in acks]
        if all(a is not None and a.ok for a in got):
            return rec.version
        return None

    async def apply_staged(self, rec: VersionRecord, staged: int, timeout: float) -> dict[str, Any]:
        """Swap the staged version in; the first worker's report (a
        :class:`~rollq.weightsync.wire.SwapReport` as a map)."""
        try:
            res = await asyncio.wait_for(self.engine.call_workers("rollq_apply_staged", staged), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(f"swapping in staged version {staged} took longer than {timeout}s") from e
        return res[0] if res else {}
