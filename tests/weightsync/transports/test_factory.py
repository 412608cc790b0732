"""rollq.weightsync.transports: one registry per side, keyed by the record's transport name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollq import Consumer, EchoEngine, WeightSyncSettings
from rollq.weightsync import VersionRecord, WeightFollower, WeightPublisher
from rollq.weightsync.transports import UnknownTransport, replica_transport, trainer_transport
from rollq.weightsync.transports.broadcast import BroadcastReceive, BroadcastSend, MissedBroadcast
from rollq.weightsync.transports.memmap import MemmapReceive, MemmapSend


def test_each_side_has_its_registry():
    assert trainer_transport("memmap") is MemmapSend
    assert {trainer_transport(n) for n in ("nccl", "gloo", "broadcast")} == {BroadcastSend}
    assert replica_transport("memmap") is MemmapReceive
    assert replica_transport("nccl") is replica_transport("gloo") is BroadcastReceive


def test_an_unknown_name_is_a_specific_error_naming_the_known_ones():
    with pytest.raises(UnknownTransport, match=r"'carrier-pigeon' on the replica side \(known: gloo, ipc, memmap, nccl\)"):
        replica_transport("carrier-pigeon")
    with pytest.raises(UnknownTransport, match="on the trainer side"):
        trainer_transport("carrier-pigeon")
    with pytest.raises(UnknownTransport, match="on the replica side"):
        replica_transport("broadcast")  # a trainer-side word; records name the backend


async def test_the_publisher_refuses_an_unknown_transport_before_committing(redis_url, queue, tmp_path):
    pub = WeightPublisher(redis_url, queue, root=str(tmp_path), validate=False)
    try:
        with pytest.raises(UnknownTransport, match="'carrier-pigeon' on the trainer side"):
            await pub.publish_weights({"w": torch.zeros(2)}, transport="carrier-pigeon")
        assert await pub.current_version() == 0
    finally:
        await pub.close()


class FakeReceiver:
    """A broadcast membership whose workers hold version ``held`` (None: they were not sent it)."""

    num_workers = 1

    def __init__(self, held: int | None):
        self.held = held
        self.swapped: list[int] = []

    async def staged_for(self, rec: VersionRecord, acks: list[Any] | None = None) -> int | None:
        return self.held

    async def apply_staged(self, rec: VersionRecord, staged: int, timeout: float) -> dict[str, Any]:
        self.swapped.append(staged)
        return {"swap": "broadcast"}


def follower_with(receiver: FakeReceiver, root: str) -> WeightFollower:
    f = WeightFollower(Consumer(EchoEngine(), "redis://127.0.0.1:1/0", "q"), WeightSyncSettings(root=root))
    f.receiver = receiver  # type: ignore[assignment]
    return f


def record(transport: str, slot: str | None) -> VersionRecord:
    return VersionRecord(version=3, transport=transport, checksum="", num_tensors=1, nbytes=8, memmap_slot=slot, group="g1")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
async def test_a_broadcast_record_is_taken_from_the_receiver_whatever_its_backend(tmp_path, backend):
    """A Gloo broadcast's record names gloo; the follower swaps in what its workers received
    (not the memmap copy the record also offers)."""
    receiver = FakeReceiver(held=3)
    f = follower_with(receiver, str(tmp_path))
    rec = record(backend, slot="slot-1")
    staged = await f._staged(rec, None)
    assert staged is not None and isinstance(staged.transport, BroadcastReceive) and staged.version == 3
    assert await f._load_now(rec, staged) == {"swap": "broadcast"} and receiver.swapped == [3]


async def test_a_broadcast_this_replica_missed_falls_back_to_memmap_or_waits(tmp_path):
    f = follower_with(FakeReceiver(held=None), str(tmp_path))
    with pytest.raises(MissedBroadcast):  # no memmap copy: the next version comes to it
        await f._staged(record("gloo", slot=None), None)
    seen: list[str] = []

    async def stage(rec: VersionRecord, acks: Any = None) -> None:
        seen.append(rec.transport)

    f.memmap.stage = stage  # type: ignore[method-assign]
    assert await f._staged(record("gloo", slot="slot-1"), None) is None
    assert seen == ["gloo"]  # the record's memmap copy was asked for


async def test_an_unknown_record_transport_is_refused_by_the_follower(tmp_path):
    f = follower_with(FakeReceiver(held=3), str(tmp_path))
    with pytest.raises(UnknownTransport):
        await f._staged(record("carrier-pigeon", slot="slot-1"), None)
