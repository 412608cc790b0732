"""A leased IPC version (``WeightPublisher(ipc_lease=True)``): the trainer's own tensors, exposed
zero-copy and without checksums until ``release_weights``, which waits for the replicas on its
host to have copied them (fake workers over CPU shared memory; no engine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

import msgspec
import pytest
import torch

from rollq.weightsync.ipc_wire import decode_handles
from tests.helpers import register_replica
from tests.weightsync.transports.test_ipc import hold_copy, small_model, state, weight0


def shared(fill: float) -> dict[str, torch.Tensor]:
    return {k: v.share_memory_() for k, v in state(fill).items()}


@contextlib.asynccontextmanager
async def serving(consumer: Any, follower: Any, client: Any) -> AsyncIterator[None]:
    """``consumer`` running with ``follower``, in the registry (so a release waits for it)."""
    from rollq.replicas import live_replicas
    from tests.helpers import until

    await follower.start()
    task = asyncio.create_task(consumer.run())
    try:
        await until(lambda: live_replicas(client, consumer.keys), 10, "the replica in the registry")
        yield
    finally:
        consumer.stop()
        await task
        await follower.stop()


def test_a_publisher_exposes_a_version_one_way():
    from rollq.weightsync import WeightPublisher

    with pytest.raises(ValueError, match="choose one"):
        WeightPublisher("redis://127.0.0.1:1", "q", ipc_snapshot=True, ipc_lease=True)


@pytest.mark.parametrize("prestage", [False, True], ids=["follower copies", "watchers copy"])
async def test_a_leased_version_is_released_once_the_replica_copied_it_and_costs_no_copy_or_checksum(
        redis_url, queue, tmp_path, prestage):
    """The trainer's tensors are exposed as they are (no bytes copied, no checksum taken or
    verified); ``release_weights`` returns only once the replica has copied the version (it
    waits while the replica cannot start), after which the trainer steps in place and the
    replica serves exactly the published values, version after version."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1, ipc_prestage=prestage,
                                                           ipc_high_priority=prestage))
    pub = WeightPublisher(redis_url, queue, ipc_lease=True)
    assert await pub.release_weights() == {}  # nothing exposed yet
    async with serving(consumer, follower, await pub.redis()):  # nothing exposed yet
        st = shared(1.0)
        for fill in (1.0, 2.0, 3.0):
            rec = await pub.publish_weights(st, transport="ipc")
            h = decode_handles(await pub._client.get(consumer.keys.weights_ipc))
            assert h.owned and h.checksum == rec.checksum == "" and rec.timings["checksum_s"] == 0.0
            assert rec.timings["ipc_copied_bytes"] == 0.0
            got = await pub.release_weights(timeout=10)
            assert got == {"r0": got["r0"]} and got["r0"] >= rec.version, got
            with torch.no_grad():  # the trainer's next step, in place
                for v in st.values():
                    v.add_(1.0)
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            load = follower.history[-1].load
            assert load["ipc"] is True and load["verify_s"] < 0.05, load
            assert all(w.rollq_state.ipc.high_priority is prestage for w in engine.workers)  # through the watchers too
            assert all(weight0(w) == fill for w in engine.workers), (fill, [weight0(w) for w in engine.workers])
            assert all(bool((p == fill).all()) for w in engine.workers for p in w.model_runner.model.module.parameters())
        async with follower._lock:  # the replica cannot copy: the release waits
            rec = await pub.publish_weights(st, transport="ipc")
            if prestage:  # the watchers copy anyway: the release need not wait for the follower
                got = await pub.release_weights(timeout=10)
                assert got["r0"] >= rec.version and consumer.version == rec.version - 1
            else:
                waiting = asyncio.create_task(pub.release_weights(timeout=10))
                await asyncio.sleep(0.5)
                assert not waiting.done()
        if not prestage:
            got = await asyncio.wait_for(waiting, 10)
            assert got["r0"] >= rec.version
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert all(weight0(w) == 4.0 for w in engine.workers)
    await pub.close()


async def test_a_lease_released_at_its_timeout_is_refused_by_the_replica_still_copying_and_the_next_version_served(
        redis_url, queue, tmp_path, caplog):
    """A replica's copy outlasts the release's timeout: the release names it and returns, the
    trainer steps in place while the copy goes on, and the replica refuses the version (its copy
    ended after the release) and records why; the old weights serve, never a mix, and the
    next version goes through."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1, load_retries=0))
    pub = WeightPublisher(redis_url, queue, ipc_lease=True)
    ipc = engine.workers[0].rollq_state.ipc
    live = engine.workers[0].model_runner.model
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        first = await pub.publish_weights(st, transport="ipc")
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == first.version, 10, "version 1")
        gate, at_copy = hold_copy(ipc, at=1)  # the first tensor is copied: the rest waits
        with torch.no_grad():
            for v in st.values():
                v.fill_(2.0)
        second = await pub.publish_weights(st, transport="ipc")
        assert await asyncio.to_thread(at_copy.wait, 10), "the worker did not start copying"
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rollq.weightsync.transports.ipc_lease"):
            got = await pub.release_weights(timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 5 and got == {"r0": first.version}, got
        assert "still copying it: r0" in caplog.text
        with torch.no_grad():  # the trainer steps while the worker copies
            for v in st.values():
                v.fill_(9.0)
        gate.set()
        ipc.before_copy = None
        errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
        assert (errors["r0"].version, errors["r0"].error) == (second.version, "IpcUnavailable"), errors
        assert consumer.version == first.version
        assert all(bool((p == 1.0).all()) for p in live.module.parameters())
        with torch.no_grad():
            for v in st.values():
                v.fill_(3.0)
        third = await pub.publish_weights(st, transport="ipc")
        assert (await pub.release_weights(timeout=10))["r0"] >= third.version
        await until(lambda: consumer.version == third.version, 10, "the next version")
        assert all(bool((p == 3.0).all()) for p in live.module.parameters())
    await pub.close()


async def test_the_release_waits_only_for_live_replicas_on_the_trainers_host(redis_url, queue):
    """Replicas elsewhere take the version another way, dead ones and those without a follower
    never copy: none of them holds the release back; one on this host that has copied, or
    serves the version, counts as done."""
    import socket

    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.transports.ipc_lease import _copies

    pub = WeightPublisher(redis_url, queue, ipc_lease=True)
    client, keys = await pub.redis(), pub.keys
    here = socket.gethostname()
    try:
        await register_replica(client, keys, "elsewhere", "another-host", 0, follows=True)
        await register_replica(client, keys, "dead", here, 0, alive=False, follows=True)
        await register_replica(client, keys, "no follower", here, 0, follows=False)
        await register_replica(client, keys, "copied", here, 1, follows=True)
        await register_replica(client, keys, "serving", here, 3, follows=True)
        await client.hset(keys.weights_ipc_copied, "copied", 3)
        assert await _copies(client, keys, here) == {"copied": 3, "serving": 3}
        x = await pub.publish_weights(shared(1.0), version=3, transport="ipc")
        assert x.version == 3
        t0 = time.monotonic()
        assert await pub.release_weights(timeout=10) == {"copied": 3, "serving": 3}
        assert time.monotonic() - t0 < 5
    finally:
        await pub.close()


@pytest.mark.parametrize("state, counts", [("staged", 4), ("failed", 4), ("staging", 3), ("busy", 3), ("direct", 3)])
async def test_a_watchers_status_counts_as_copied_only_once_its_copy_ended(redis_url, queue, state, counts):
    """A replica's watching workers' statuses count toward the release as the version copied
    only once their copy ended (staged, or failed: it reads no more); one under way, one left
    to a direct swap, or one a watcher left to the follower (busy) counts as the version
    before it, whatever the follower recorded."""
    import socket

    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.transports.ipc_lease import _copies
    from rollq.weightsync.wire import StageStatus, State

    pub = WeightPublisher(redis_url, queue, ipc_lease=True)
    client, keys = await pub.redis(), pub.keys
    here = socket.gethostname()
    try:
        await register_replica(client, keys, "r0", here, 2, follows=True)
        st = StageStatus(state=State.STAGED, version=4, direct=True) if state == "direct" else StageStatus(state=State(state), version=4)
        await client.hset(keys.weights_ipc_staged, mapping={"r0/0": msgspec.msgpack.encode(StageStatus(state=State.STAGED, version=4)),
                                                            "r0/1": msgspec.msgpack.encode(st)})
        assert await _copies(client, keys, here) == {"r0": counts}
    finally:
        await pub.close()


async def test_a_producer_leases_and_releases_through_its_publisher(redis_url, queue, tmp_path):
    """``Producer.publish_weights(..., ipc_lease=True)`` then ``Producer.release_weights()``:
    the release returns once the replica copied the version; a producer that published nothing
    has nothing to release."""
    from rollq import Consumer, Producer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1))
    async with Producer(redis_url, queue) as p:
        assert await p.release_weights() == {}
        async with serving(consumer, follower, p._client):
            st = shared(5.0)
            rec = await p.publish_weights(st, transport="ipc", ipc_lease=True)
            assert (await p.release_weights(timeout=10))["r0"] >= rec.version
            with torch.no_grad():
                for v in st.values():
                    v.fill_(6.0)
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            assert weight0(engine.workers[0]) == 5.0
