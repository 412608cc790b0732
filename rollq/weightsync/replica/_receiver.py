"""Replica side of the broadcast: gets this replica's workers into the trainer's group.

Runs in the consumer's process, on its event loop, as :attr:`WeightFollower.receiver
<rollq.weightsync.replica.follower.WeightFollower.receiver>`. It registers the replica as a member
(``QueueKeys.weights_members``, again whenever the trainer left it out), answers each group's
call and joins the groups that list it (``wgroup`` hints, and a check of the group record
every ``poll_interval`` seconds; see :mod:`rollq.weightsync.trainer.group`), tells the follower which
committed versions its workers staged (their acks), and swaps a staged version in.
The offers themselves are followed by the workers (:mod:`rollq.weightsync.worker._listener`), so no
engine RPC sits on the update's path before the swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgspec

from ..._tasks import stop_task
from ...errors import WeightSyncError, WeightSyncTimeout
from ...protocol import Control
from ..base import ReplicaSide
from ..versions import VersionRecord
from ..wire import GroupInfo, Listen, State, SwapReport, decode_ack, member_entry
from .worker_calls import WorkerCalls

log = logging.getLogger(__name__)


class ReplicaReceiver:
    """This replica's workers as ranks of the trainer's broadcast group."""

    def __init__(self, consumer: ReplicaSide, poll_interval: float = 1.0):
        self.consumer = consumer
        self.engine = consumer.engine
        self.workers = WorkerCalls(consumer.engine)
        self.keys = consumer.keys
        self.poll_interval = poll_interval
        #: The group this replica's workers joined.
        self.group: str | None = None
        #: The joined group's backend (``nccl`` or ``gloo``); None before the first join.
        self.backend: str | None = None
        self._entry = ""  # this run's member entry (rollq.weightsync.wire.member_entry)
        self._answered: str | None = None  # the last group call answered
        self._passed: str | None = None  # the last group formed without this replica
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._client: Any = None

    @property
    def num_workers(self) -> int:
        return self.engine.num_workers

    def fields(self) -> list[str]:
        """This replica's workers' fields in an offer's ack hash."""
        return [f"{self.consumer.id}/{i}" for i in range(self.num_workers)]

    async def start(self, client: Any) -> None:
        """Register as a member, then follow the groups in a task."""
        self._client = client
        self._entry = member_entry(self.num_workers, uuid.uuid4().hex[:12])
        await client.hset(self.keys.weights_members, self.consumer.id, self._entry)
        self.consumer.add_control_handler(self._on_control)
        self._task = asyncio.create_task(self._loop(), name="rollq-broadcast-receiver")

    async def stop(self) -> None:
        await stop_task(self._task)
        with contextlib.suppress(Exception):  # the trainer leaves it out of the next group
            await self._client.hdel(self.keys.weights_members, self.consumer.id)
        if self.group is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.workers.leave_group(), 30)

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
        """Answer the trainer's group call and join the group if it lists this replica (one
        round trip when nothing changed); register again if the trainer left us out."""
        keys, me = self.keys, self.consumer.id
        pipe = self._client.pipeline(transaction=False)
        pipe.hmget(keys.weights_group, ["call", "d"])
        pipe.hexists(keys.weights_members, me)
        (call, g), member = await pipe.execute()
        if not member:
            await self._client.hset(keys.weights_members, me, self._entry)
        call = call.decode() if isinstance(call, bytes) else call
        if call and call != self._answered:
            pipe = self._client.pipeline(transaction=False)
            pipe.hset(keys.weights_answers(call), me, self._entry)
            pipe.expire(keys.weights_answers(call), 600)
            await pipe.execute()
            self._answered = call
        if g is None:
            return
        info = msgspec.msgpack.decode(g, type=GroupInfo)
        if info.id == self.group or info.id == self._passed:
            return
        if me not in info.ranks:
            # formed without us (we answered late, or registered after its call): the trainer
            # forms a group with us before its next send; our workers stay in their group until then
            self._passed = info.id
            log.info("broadcast group %s formed without replica %s; it joins the next one", info.id, me[:64])
            return
        try:
            await self._join(info, info.ranks[me])
        except Exception:
            self._passed = info.id  # not again: the trainer forms a new group after the failure
            raise

    async def _join(self, info: GroupInfo, offset: int) -> None:
        n = self.num_workers
        self.group = None
        # full_url: a cluster URL stays one in the workers (url has the cluster flag stripped)
        listen = Listen(url=self.consumer.redis_settings.full_url, channel=self.keys.control,
                        offer_key=self.keys.weights_offer, field=f"{self.consumer.id}/",
                        layouts_key=self.keys.weights_layouts, version_key=self.keys.version,
                        serving=self.consumer.version)
        await self.workers.join_group(info=info, rank_offset=offset, listen=listen)
        await self._wait_joined(info, info.timeout + 5)
        self.group, self.backend = info.id, info.backend
        log.info("replica %s joined broadcast group %s as ranks %d..%d", self.consumer.id, info.id, offset, offset + n - 1)

    async def _wait_joined(self, info: GroupInfo, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = await self.workers.receive_status()
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
        """``rec.version`` if every worker of this replica staged it over ``rec.group`` (their
        acks are ok and name that group); ``acks``: the ack fields of this replica, already read.

        The acks decide, not :attr:`group`: the trainer may broadcast as soon as the workers
        have joined, before :meth:`_join` has seen them join and recorded the group."""
        if rec.group is None:
            return None
        if acks is None:
            acks = await self._client.hmget(self.keys.weights_acks(rec.version), self.fields())
        got = [decode_ack(a) for a in acks]
        if all(a is not None and a.ok and a.group == rec.group for a in got):
            return rec.version
        return None

    async def apply_staged(self, rec: VersionRecord, staged: int, timeout: float) -> SwapReport:
        """Swap the staged version in; the first worker's report."""
        try:
            res = await asyncio.wait_for(self.workers.apply_staged(version=staged), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(f"swapping in staged version {staged} took longer than {timeout}s") from e
        return res[0] if res else SwapReport()
