"""The IPC transport's wire struct, the trainer's exposure and its registration (no engine)."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import msgspec
import pytest
import redis.asyncio
import torch

from rollq.weightsync.trainer.ipc_export import Exposure
from rollq.weightsync.ipc_wire import (
    IPC_SCHEMA, IpcHandles, IpcStorage, IpcTensor, IpcUnavailable, MalformedIpcHandles, StorageKind, decode_handles,
    encode_handles,
)
from rollq.weightsync.transports import replica_transport, trainer_transport
from rollq.weightsync.transports.ipc import IpcReceive, IpcSend
from rollq.weightsync.transports.ipc_lease import SHARES
from rollq.weightsync.worker._ipc import _open_cpu, _token_alive


def good() -> dict[str, Any]:
    h = IpcHandles(
        version=3, host="h", pid=42, checksum="c",
        token=IpcStorage(kind=StorageKind.CPU, nbytes=8, fd=5, inode=77),
        storages=[IpcStorage(kind=StorageKind.CPU, nbytes=64, fd=6, inode=78)],
        tensors=[IpcTensor("a", "float32", [2, 2], 0, 0), IpcTensor("b", "bfloat16", [3], 0, 16)],
    )
    out: dict[str, Any] = msgspec.to_builtins(h)
    return out


def test_valid_handles_round_trip():
    h = decode_handles(msgspec.msgpack.encode(good()))
    assert [t.nbytes for t in h.tensors] == [16, 6] and h.nbytes == 22
    assert decode_handles(encode_handles(h)) == h


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(v=IPC_SCHEMA + 1), f"schema {IPC_SCHEMA + 1} is not supported"),
    (lambda d: d.update(v=1), "schema 1 is not supported"),
    (lambda d: d.update(pid=0), "pid 0 must be positive"),
    (lambda d: d["tensors"][0].__setitem__(1, "float128"), "unknown dtype 'float128'"),
    (lambda d: d["tensors"][0].__setitem__(2, [2, -2]), "negative dimension"),
    (lambda d: d["tensors"][1].__setitem__(3, 1), "names storage 1 of 1"),
    (lambda d: d["tensors"][1].__setitem__(4, 60), r"runs past the end of storage 0 \(64 bytes\)"),
    (lambda d: d["tensors"][0].__setitem__(4, 2), "not a multiple of its item size"),
    (lambda d: d["storages"][0].pop("fd"), "a CPU storage needs its descriptor and inode"),
    (lambda d: d["storages"][0].update(kind="cuda"), "a CUDA storage needs its IPC handle"),
    (lambda d: d["token"].update(kind="cuda", handle=b"x", device_uuid="GPU-0"), "the liveness token must be a CPU storage"),
    (lambda d: d["storages"][0].update(kind="tpu"), "Invalid enum value 'tpu'"),
    (lambda d: d.pop("token"), "missing required field `token`"),
    (lambda d: d.update(checksum=""), "tensors the trainer may still change need their checksum"),
])
def test_malformed_handles_are_refused_saying_why(change, why):
    d = good()
    change(d)
    with pytest.raises(MalformedIpcHandles, match=why):
        decode_handles(msgspec.msgpack.encode(d))


def test_an_owned_snapshot_needs_no_checksum():
    d = good()
    d.update(checksum="", owned=True)
    assert decode_handles(msgspec.msgpack.encode(d)).owned


def test_bytes_that_are_not_handles_are_refused():
    with pytest.raises(MalformedIpcHandles, match="malformed IPC handles"):
        decode_handles(b"\xc1not msgpack")
    with pytest.raises(MalformedIpcHandles, match="Expected `object`, got `array`"):
        decode_handles(msgspec.msgpack.encode([1, 2, 3]))


def test_the_ipc_transport_is_registered_on_both_sides():
    assert trainer_transport("ipc") is IpcSend
    assert replica_transport("ipc") is IpcReceive


def test_shared_tensors_are_exposed_zero_copy_and_others_copied_once():
    shared = torch.arange(12, dtype=torch.float32).share_memory_()
    views = [("lo", shared[:6]), ("hi", shared[6:])]  # one storage, two tensors
    x = Exposure(1, [*views, ("own", torch.ones(4, dtype=torch.bfloat16))])
    try:
        assert x.copied_bytes == 8  # only the bfloat16 tensor that was not shared
        h = x.handles
        assert len(h.storages) == 2 and [t.storage for t in h.tensors] == [0, 0, 1]
        assert [t.offset for t in h.tensors] == [0, 24, 0]
        assert _token_alive(h)
        # What another process opens (here: this one, through /proc/<pid>/fd) is the same memory.
        s = _open_cpu(h.pid, h.storages[0], "storage 0")
        assert torch.equal(torch.empty(0).set_(s, 6, (6,)), shared[6:])
    finally:
        x.release()
    assert not _token_alive(h)  # released: a worker refuses it


def test_a_snapshot_of_another_layout_is_copied_into_new_storages():
    first = Exposure(1, [("w", torch.ones(4)), ("b", torch.ones(2))], snapshot=True)
    first.release()
    for other in ([("w", torch.ones(5)), ("b", torch.ones(2))], [("w", torch.ones(4, dtype=torch.float64)), ("b", torch.ones(2))],
                  [("b", torch.ones(2)), ("w", torch.ones(4))]):
        x = Exposure(2, other, snapshot=True, into=first.snapshot)
        try:
            assert not x.reused and x.handles.owned
            assert {t.data_ptr() for _, t in x.snapshot}.isdisjoint(t.data_ptr() for _, t in first.snapshot)
            assert [torch.equal(a, b) for (_, a), (_, b) in zip(x.snapshot, other)] == [True, True]
        finally:
            x.release()


def test_the_callers_storages_are_shared_once_and_the_exposures_own_copies_never_kept():
    """The next exposure of the same storages reuses their messages (the shared-memory file and
    its inode, a CUDA handle and counter on a GPU); a storage the caller replaced is shared
    afresh and the one it replaced leaves the table; a copy the exposure made (a tensor not in
    shared memory) is shared each time and never held past its exposure's release."""
    a, b = torch.zeros(4).share_memory_(), torch.zeros(3).share_memory_()
    own = torch.ones(2)  # not in shared memory: copied each time
    x = Exposure(1, [("a", a), ("b", b), ("own", own)], lease=True)
    x.release()
    assert (x.shares_reused, len(x.shares)) == (0, 2)
    y = Exposure(2, [("a", a), ("b", b), ("own", own)], lease=True, shares=x.shares)
    y.release()
    assert y.shares_reused == 2 and y.handles.storages[:2] == x.handles.storages[:2]
    assert y.handles.storages[2] != x.handles.storages[2] and len(y.shares) == 2
    b2 = torch.zeros(3).share_memory_()  # the caller replaced b
    z = Exposure(3, [("a", a), ("b", b2)], lease=True, shares=y.shares)
    z.release()
    assert z.shares_reused == 1 and z.handles.storages[0] == x.handles.storages[0]
    assert z.handles.storages[1].inode != x.handles.storages[1].inode and len(z.shares) == 2
    assert Exposure(4, [("a", a)], lease=True, shares=None).shares_reused == 0  # no table: shared again


def hold_copy(staging: Any, at: int = 0) -> tuple[threading.Event, threading.Event]:
    """Hold ``staging``'s copy before its tensor ``at`` until the returned gate is set; the
    second event says the copy got there."""
    gate, at_copy = threading.Event(), threading.Event()

    def hold(i: int) -> None:
        if i == at:
            at_copy.set()
            gate.wait(10)

    staging.before_copy = hold
    return gate, at_copy


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4))


def state(fill: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, fill) for k, v in small_model().state_dict().items()}


def weight0(worker: Any) -> float:
    return float(worker.model_runner.model.module[0].weight[0, 0].detach())


async def test_fake_workers_copy_each_version_and_refuse_a_released_one(redis_url, queue, tmp_path):
    """The whole protocol in one process (a worker opens its own process's shared memory
    through /proc/<pid>/fd just as another process's): two workers copy and swap each version;
    a version released before they copy it is refused and recorded; an echo engine applies it."""
    from rollq import Consumer, EchoEngine, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from rollq.weightsync.transports.ipc_lease import release
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1, ipc_chunk_bytes=4096,
                                                           ipc_high_priority=True))
    echo = Consumer(EchoEngine(), redis_url, queue, consumer_id="echo")
    echo_follower = WeightFollower(echo, WeightSyncSettings(reconcile_interval=0.1))
    pub = WeightPublisher(redis_url, queue)
    await follower.start()
    await echo_follower.start()
    try:
        for fill in (1.0, 2.0):
            rec = await pub.publish_weights(state(fill), transport="ipc")
            assert rec.transport == "ipc" and rec.memmap_slot is None and rec.timings["ipc_copied_bytes"] == 4 * (32 + 4)
            await until(lambda: consumer.version == echo.version == rec.version, 10, f"version {rec.version}")
            load = follower.history[-1].load
            assert load["ipc"] is True and load["swap"] == "load" and load["open_s"] >= 0 and load["verify_s"] >= 0, load
            assert all(w.rollq_state.ipc.chunk_bytes == 4096 and w.rollq_state.ipc.high_priority
                       for w in engine.workers)  # the settings reached the workers
            assert all(float(w.model_runner.model.module[0].weight[0, 0].detach()) == fill for w in engine.workers)
        async with follower._lock, echo_follower._lock:  # neither starts the update before the release
            rec = await pub.publish_weights(state(3.0), transport="ipc")
            assert release(pub)
        errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
        assert (errors["r0"].version, errors["r0"].error) == (rec.version, "IpcUnavailable"), errors
        assert "before this worker opened it" in errors["r0"].message
        assert consumer.version == rec.version - 1
        assert all(float(w.model_runner.model.module[0].weight[0, 0].detach()) == 2.0 for w in engine.workers)
        await until(lambda: echo.version == rec.version, 10, "the echo replica, which copies nothing")
        rec = await pub.publish_weights(state(4.0), transport="ipc")
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert all(float(w.model_runner.model.module[0].weight[0, 0].detach()) == 4.0 for w in engine.workers)
    finally:
        await follower.stop()
        await echo_follower.stop()
        await pub.close()


async def test_workers_never_capture_a_checksum_graph_beside_the_serving_engine(redis_url, queue, tmp_path, monkeypatch):
    """A worker's copy thread runs while the engine steps: capturing a CUDA graph there killed
    vLLM's engine on an H100 (``cudaErrorCapturedEvent`` in its next input copy). The worker
    verifies the trainer's checksum eagerly, for a first version and for later ones."""
    import rollq.weightsync.worker._ipc as worker_ipc
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from tests.helpers import until

    calls: list[dict[str, Any]] = []
    real = worker_ipc.state_checksum

    def spy(*a: Any, **kw: Any) -> str:
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(worker_ipc, "state_checksum", spy)
    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1))
    pub = WeightPublisher(redis_url, queue)
    await follower.start()
    try:
        st = {k: v.share_memory_() for k, v in state(1.0).items()}
        for fill in (1.0, 2.0):
            with torch.no_grad():
                for v in st.values():
                    v.fill_(fill)
            rec = await pub.publish_weights(st, transport="ipc")
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert len(calls) == 2 and not any(kw.get("graph") for kw in calls), calls
    finally:
        await follower.stop()
        await pub.close()


async def test_a_sharded_trainer_is_told_ipc_is_not_for_it(redis_url, queue):
    """Each rank of a sharded trainer holds parts of tensors; the IPC transport exposes whole
    ones. Refused before anything is written (not silently published through memmap)."""
    from rollq.errors import WeightSyncError
    from rollq.weightsync import WeightPublisher

    pub = WeightPublisher(redis_url, queue, validate=False)
    try:
        with pytest.raises(WeightSyncError, match="a sharded trainer publishes over memmap or a broadcast, not 'ipc'"):
            await pub._sharded_plan([("w", torch.zeros(2))], None, "ipc")
        assert await pub.current_version() == 0
    finally:
        await pub.close()


async def test_tensors_changed_before_the_copy_are_refused_or_taken_from_the_memmap_copy(redis_url, queue, tmp_path):
    """Zero-copy tensors the trainer changes in place before the replica copied them fail the
    trainer's checksum: refused for good without a memmap copy; with one (written at publish),
    loaded from it."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1))
    await follower.start()
    try:
        for root, fill in ((None, 1.0), (str(tmp_path), 2.0)):
            pub = WeightPublisher(redis_url, queue, root=root)
            st = {k: v.share_memory_() for k, v in state(fill).items()}
            async with follower._lock:  # the replica copies only after the change
                rec = await pub.publish_weights(st, transport="ipc")
                assert rec.timings["ipc_copied_bytes"] == 0
                for v in st.values():
                    v.add_(100.0)  # the trainer's next step, in place, too early
            if root is None:
                errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
                assert (errors["r0"].error, errors["r0"].final) == ("CorruptWeights", True), errors
                assert consumer.version == 0
            else:
                await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
                assert "ipc" not in follower.history[-1].load  # from the memmap copy, as published
                assert float(engine.workers[0].model_runner.model.module[0].weight[0, 0].detach()) == fill
            await pub.close()
    finally:
        await follower.stop()


async def test_a_snapshot_lets_the_trainer_change_its_weights_right_after_publishing(redis_url, queue, tmp_path):
    """``WeightPublisher(ipc_snapshot=True)`` exposes copies taken at publish: the trainer's
    next step, in place before the replica copied anything, does not reach the replica, which
    serves the published values (without it this version is refused, the test above)."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1))
    pub = WeightPublisher(redis_url, queue, ipc_snapshot=True)
    await follower.start()
    try:
        st = {k: v.share_memory_() for k, v in state(3.0).items()}
        async with follower._lock:  # the replica copies only after the change
            rec = await pub.publish_weights(st, transport="ipc")
            assert rec.timings["ipc_copied_bytes"] == sum(v.numel() * v.element_size() for v in st.values())
            for v in st.values():
                v.add_(100.0)
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert follower.history[-1].load["ipc"] is True
        assert float(engine.workers[0].model_runner.model.module[0].weight[0, 0].detach()) == 3.0
    finally:
        await follower.stop()
        await pub.close()


async def test_a_snapshot_is_the_publishers_own_taken_without_a_checksum_and_rewritten_each_version(redis_url, queue, tmp_path):
    """A snapshot is exposed as the publisher's own (``IpcHandles.owned``): no checksum is taken
    at publish or verified by the workers. Each later version of the same layout is copied into
    the same snapshot, so its storages stay mapped in the workers and the extra memory stays
    one copy. With a memmap store the record carries the memmap copy's checksum."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1))
    pub = WeightPublisher(redis_url, queue, ipc_snapshot=True)
    await follower.start()
    try:
        st = state(0.0)
        n, nbytes = len(st), sum(v.numel() * v.element_size() for v in st.values())
        for fill in (1.0, 2.0, 3.0):
            with torch.no_grad():
                for v in st.values():
                    v.fill_(fill)
            rec = await pub.publish_weights(st, transport="ipc")
            h = decode_handles(await pub._client.get(consumer.keys.weights_ipc))
            assert h.owned and h.checksum == rec.checksum == "" and rec.timings["checksum_s"] == 0.0, rec
            assert rec.timings["ipc_copied_bytes"] == nbytes and rec.timings["ipc_snapshot_reused"] == float(fill > 1)
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            load = follower.history[-1].load
            assert (load["opened"], load["reused"]) == ((n, 0) if fill == 1.0 else (0, n)), (fill, load)
            assert all(weight0(w) == fill for w in engine.workers)
        stored = WeightPublisher(redis_url, queue, root=str(tmp_path / "store"), ipc_snapshot=True)
        rec = await stored.publish_weights(state(5.0), transport="ipc")
        assert rec.memmap_slot is not None and rec.checksum and rec.timings["ipc_snapshot_reused"] == 0.0
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert follower.history[-1].load["ipc"] is True and all(weight0(w) == 5.0 for w in engine.workers)
        await stored.close()
    finally:
        await follower.stop()
        await pub.close()


async def test_a_snapshot_rewritten_while_a_worker_copies_it_is_refused_and_the_next_version_served(redis_url, queue, tmp_path):
    """The publisher rewrites its snapshot with the next version while a worker is half way
    through copying the last one: the worker's copy holds bytes of both, and is refused
    (the version was released before its snapshot was rewritten, which the worker sees after
    its copy). The old weights serve on, never a mix, and the next version goes through."""

    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1, load_retries=0))
    pub = WeightPublisher(redis_url, queue, ipc_snapshot=True)
    ipc = engine.workers[0].rollq_state.ipc
    live = engine.workers[0].model_runner.model
    await follower.start()
    try:
        rec = await pub.publish_weights(state(1.0), transport="ipc")
        await until(lambda: consumer.version == rec.version, 10, "version 1")
        gate, at_copy = hold_copy(ipc, at=1)  # the first tensor is copied: the rest waits
        second = await pub.publish_weights(state(2.0), transport="ipc")
        assert await asyncio.to_thread(at_copy.wait, 10), "the worker did not start copying"
        third = await pub.publish_weights(state(3.0), transport="ipc")  # rewrites the snapshot
        assert third.timings["ipc_snapshot_reused"] == 1.0
        gate.set()
        ipc.before_copy = None
        errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
        assert (errors["r0"].version, errors["r0"].error) == (second.version, "IpcUnavailable"), errors
        assert "during the copy" in errors["r0"].message
        await until(lambda: consumer.version == third.version, 10, "the next version")
        assert [h.version for h in follower.history if h.version == second.version] == []
        assert all(bool((p == 3.0).all()) for p in live.module.parameters())
    finally:
        await follower.stop()
        await pub.close()


@pytest.mark.parametrize("keep", [True, False])
async def test_storages_updated_in_place_are_opened_once_and_stay_mapped(redis_url, queue, tmp_path, keep):
    """A trainer that steps in place exposes the same storages every version: each worker
    opens them for the first version and copies later ones through the mappings it kept
    (``ipc_keep_mappings``); a version of other tensors opens those and unmaps the old ones.
    With the setting off, every version opens every storage and unmaps it after the copy."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.1, ipc_keep_mappings=keep))
    pub = WeightPublisher(redis_url, queue)
    await follower.start()
    try:
        st = {k: v.share_memory_() for k, v in state(0.0).items()}
        n = len(st)
        for fill in (1.0, 2.0, 3.0, 4.0):
            if fill == 4.0:  # other tensors: new storages
                st = {k: v.share_memory_() for k, v in state(0.0).items()}
            with torch.no_grad():
                for v in st.values():
                    v.fill_(fill)
            rec = await pub.publish_weights(st, transport="ipc")
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            load = follower.history[-1].load
            kept = keep and fill in (2.0, 3.0)
            # The trainer shared each storage once: later versions reuse its messages.
            assert rec.timings["ipc_shares_reused"] == (n if fill in (2.0, 3.0) else 0), rec.timings
            assert len(SHARES[pub]) == n  # the new storages only, once other tensors came
            assert (load["opened"], load["reused"]) == ((0, n) if kept else (n, 0)), (fill, load)
            assert all(len(w.rollq_state.ipc.maps) == (n if keep else 0) for w in engine.workers)
            assert all(float(w.model_runner.model.module[0].weight[0, 0].detach()) == fill for w in engine.workers)
        await pub.close()
        assert pub not in SHARES  # closed: the trainer's storages are no longer held for a next version
    finally:
        await follower.stop()
        await pub.close()


EXPOSER = """
import sys, time, msgspec, torch
from rollq.weightsync.trainer.ipc_export import Exposure
x = Exposure(1, [("w", torch.ones(1024).share_memory_())])
sys.stdout.buffer.write(msgspec.msgpack.encode(x.handles).hex().encode() + b"\\n")
sys.stdout.flush()
time.sleep(120)
"""


def test_mappings_of_a_trainer_process_that_exited_are_dropped():
    """A worker keeps no memory of a trainer that is gone: the mappings kept from its last
    version are dropped within the watch interval of its exit, and an opening that fails drops
    every mapping."""
    import subprocess
    import sys
    import time

    from rollq.weightsync.worker._ipc_maps import MappedStorages, process_start

    proc = subprocess.Popen([sys.executable, "-c", EXPOSER], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        h = decode_handles(bytes.fromhex(proc.stdout.readline().decode()))
        maps = MappedStorages(watch_interval=0.05)
        views = maps.tensors(h, lambda i, s: _open_cpu(h.pid, s, "w"), lambda st: [torch.empty(0).set_(st[0], 0, (1024,))])
        assert torch.equal(views[0], torch.ones(1024))
        # the same storages laid out the same way: the same views, nothing opened
        assert maps.tensors(h, lambda i, s: pytest.fail("opened again"), lambda st: pytest.fail("built again")) is views
        assert (maps.opened, maps.reused) == (0, 1)
        # what a worker builds from kept views (their manifest, a direct swap's copies): once
        built = maps.derived(views, "plan", 1, lambda: ["copies"])
        assert maps.derived(views, "plan", 1, lambda: pytest.fail("built again")) is built
        assert maps.derived(views, "plan", 2, lambda: ["other"]) == ["other"]  # another plan: built anew
        assert maps.derived(list(views), "plan", 2, lambda: ["not kept"]) == ["not kept"]  # views not the kept ones
        del views, built
        assert len(maps) == 1 and process_start(h.pid) is not None
        time.sleep(0.3)
        assert len(maps) == 1  # the trainer lives: kept
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while len(maps) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(maps) == 0 and maps._views is None and not maps._derived  # they held the storages too
        with pytest.raises(IpcUnavailable, match="the trainer exited"):
            maps.open(h, lambda i, s: _open_cpu(h.pid, s, "w"))
        assert len(maps) == 0
    finally:
        proc.kill()
        proc.wait(10)


async def test_workers_watching_for_versions_copy_them_before_the_follower_reads_the_record(redis_url, queue, tmp_path):
    """With ``ipc_prestage`` each worker's watcher starts the copy when the version is
    announced: it is staged while the follower cannot even start its update (its lock held),
    and the follower then only swaps it in. A staged version waiting for its swap is not
    replaced by a newer one (the follower stages that one itself, after the swap)."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from rollq.weightsync.wire import StageStatus, State
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.2, ipc_prestage=True))
    pub = WeightPublisher(redis_url, queue)
    staging = [w.rollq_state.ipc for w in engine.workers]

    async def reported(v: int) -> bool:  # as the follower reads it: each watcher's status in Redis
        got = await pub._client.hmget(consumer.keys.weights_ipc_staged, ["r0/0", "r0/1"])
        return all(raw and msgspec.msgpack.decode(raw, type=StageStatus) == s.status and s.status.version == v
                   and s.status.state is State.STAGED for raw, s in zip(got, staging))

    await follower.start()
    try:
        for fill in (1.0, 2.0):
            async with follower._lock:  # the follower cannot start this update
                rec = await pub.publish_weights(state(fill), transport="ipc")
                await until(lambda: reported(rec.version), 10, f"the workers' own copy of version {rec.version}")
                assert consumer.version == rec.version - 1
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            assert follower.history[-1].load.get("prestaged") is True, follower.history[-1].load
            assert all(weight0(w) == fill for w in engine.workers)
        assert [s.prestaged for s in staging] == [2, 2]
        async with follower._lock:
            first = await pub.publish_weights(state(3.0), transport="ipc")
            await until(lambda: all(s.status.state is State.STAGED and s.status.version == first.version for s in staging),
                        10, "the workers' copy of the first of two versions")
            second = await pub.publish_weights(state(4.0), transport="ipc")
            await asyncio.sleep(0.5)  # the watchers saw the second one
            assert all(s.status.version == first.version for s in staging) and [s.prestaged for s in staging] == [3, 3]
        await until(lambda: consumer.version == second.version, 10, "the newer version, staged by the follower")
        assert follower.history[-1].load.get("prestaged") is None
        assert all(weight0(w) == 4.0 for w in engine.workers)
        await follower.stop()
        assert all(w.rollq_state.ipc_watcher is None for w in engine.workers)
        assert await pub._client.hlen(consumer.keys.weights_ipc_staged) == 0  # a stopped replica's statuses go with it
    finally:
        await follower.stop()
        await pub.close()


async def test_a_version_released_while_a_watcher_copies_it_is_recorded_and_the_next_one_goes_through(redis_url, queue, tmp_path):
    """The trainer releases a version while the workers' watchers copy it: their copies fail,
    the follower tries it itself, records the failure, the old weights serve on, and the next
    version is copied by the watchers again."""

    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from rollq.weightsync.transports.ipc_lease import release
    from rollq.weightsync.wire import State
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.2, ipc_prestage=True))
    pub = WeightPublisher(redis_url, queue)
    ipc = engine.workers[0].rollq_state.ipc
    await follower.start()
    try:
        rec = await pub.publish_weights(state(1.0), transport="ipc")
        await until(lambda: consumer.version == rec.version, 10, "version 1")
        gate, at_copy = hold_copy(ipc)
        async with follower._lock:
            rec = await pub.publish_weights(state(2.0), transport="ipc")
            assert await asyncio.to_thread(at_copy.wait, 10), "the watcher did not start copying"
            assert release(pub)
            gate.set()
            await until(lambda: ipc.status.state is State.FAILED, 10, "the watcher's copy to fail")
        ipc.before_copy = None
        errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
        assert (errors["r0"].version, errors["r0"].error) == (rec.version, "IpcUnavailable"), errors
        assert consumer.version == rec.version - 1 and weight0(engine.workers[0]) == 1.0
        started = ipc.prestaged
        async with follower._lock:  # the watcher copies it, however slowly the follower would wake
            rec = await pub.publish_weights(state(3.0), transport="ipc")
            await until(lambda: ipc.status.state is State.STAGED and ipc.status.version == rec.version, 10,
                        "the watcher's copy of the next version")
        await until(lambda: consumer.version == rec.version, 10, "the next version")
        assert ipc.prestaged == started + 1 and weight0(engine.workers[0]) == 3.0  # the watcher copied it
    finally:
        await follower.stop()
        await pub.close()


async def test_a_follower_that_skips_the_version_a_watcher_still_copies_waits_for_that_copy_to_end(redis_url, queue, tmp_path):
    """Two versions published before the follower woke: the watcher copies the first when the
    second is read. The follower's own copy of the second waits for that copy to end (the
    worker answered busy) instead of failing, and no load failure is recorded."""

    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from rollq.weightsync.wire import State
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    settings = WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.2, ipc_prestage=True, load_retries=0)
    follower = WeightFollower(consumer, settings)  # no retries: a failure would be final
    pub = WeightPublisher(redis_url, queue)
    ipc = engine.workers[0].rollq_state.ipc
    gate, at_copy = hold_copy(ipc)
    await follower.start()
    try:
        async with follower._lock:
            first = await pub.publish_weights(state(1.0), transport="ipc")
            assert await asyncio.to_thread(at_copy.wait, 10), "the watcher did not start copying"
            second = await pub.publish_weights(state(2.0), transport="ipc")
        await asyncio.sleep(0.3)  # the follower asked for the second and was told the worker is busy
        assert ipc.status.state is State.STAGING and ipc.status.version == first.version and consumer.version == 0
        ipc.before_copy = None
        gate.set()
        await until(lambda: consumer.version == second.version, 10, "the second version")
        assert weight0(engine.workers[0]) == 2.0 and follower.history[-1].load.get("prestaged") is None
        assert await read_load_errors(pub._client, consumer.keys) == {}
    finally:
        gate.set()
        await follower.stop()
        await pub.close()


class Loadable(torch.nn.Sequential):
    """``small_model`` with vLLM's ``load_weights`` entry point, so that a worker shadows it;
    ``transform``: each tensor goes through an intermediate (no load plan, as for a loader
    that converts what it reads)."""

    transform = False

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t.clone() if self.transform else t)
        return set(params)


def loadable_model(transform: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = Loadable(torch.nn.Linear(8, 4))
    m.transform = transform
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.mark.parametrize("plan", [True, False])
async def test_with_shadow_weights_a_version_is_loaded_from_the_trainers_tensors_without_a_copy_beside_it(
        redis_url, queue, monkeypatch, plan):
    """A worker with shadow weights loads each version straight from the trainer's tensors
    (the first traces the load plan): no copy of the version is made beside the shadow, which
    at the first version held the weights twice over. Tensors the trainer changes while that
    load reads them fail the check (on the shadow's bytes by the plan, or without one on the
    trainer's tensors after the load); the old weights serve on and the next version goes in."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher, read_load_errors
    from rollq.weightsync.worker._ipc import IpcStaging
    from tests.helpers import until

    monkeypatch.setenv("ROLLQ_SHADOW_WEIGHTS", "1")  # "auto" uses them on GPUs only

    def no_copy(self: Any, i: int, src: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the version was copied beside the shadow weights")

    monkeypatch.setattr(IpcStaging, "_copy_one", no_copy)
    engine = FakeWorkerEngine(lambda: loadable_model(transform=not plan))
    worker = engine.workers[0]
    live = worker.model_runner.model
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(reconcile_interval=0.1))
    pub = WeightPublisher(redis_url, queue)
    await follower.start()
    try:
        for fill in (1.0, 2.0):
            rec = await pub.publish_weights(state(fill), transport="ipc")
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            assert follower.history[-1].load["swap"] == "shadow", follower.history[-1].load
            assert all(bool((p == fill).all()) for p in live.parameters())
        assert (worker.rollq_state.shadow.plan is not None) == plan, worker.rollq_state.shadow.plan_refused
        st = {k: v.share_memory_() for k, v in state(3.0).items()}  # zero-copy: the trainer's own
        gate, at_copy = hold_copy(worker.rollq_state.ipc, at=1)
        rec = await pub.publish_weights(st, transport="ipc")
        assert await asyncio.to_thread(at_copy.wait, 10)
        for v in st.values():
            v.add_(100.0)  # the trainer's next step, in place, while the worker reads the tensors
        gate.set()
        errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
        assert (errors["r0"].version, errors["r0"].error) == (rec.version, "CorruptWeights"), errors
        assert consumer.version == rec.version - 1 and all(bool((p == 2.0).all()) for p in live.parameters())
        worker.rollq_state.ipc.before_copy = None
        rec = await pub.publish_weights(state(4.0), transport="ipc")
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert follower.history[-1].load["swap"] == "shadow" and all(bool((p == 4.0).all()) for p in live.parameters())
    finally:
        await follower.stop()
        await pub.close()


async def test_watching_starts_only_once_every_watcher_listens(redis_url, queue, tmp_path):
    """The follower's start returns once each worker's watcher has subscribed and written its
    status, so a version published right after it is the watchers' to copy."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from rollq.weightsync.wire import StageStatus, State
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    # A worker whose last staging was of version 1 of another queue (an engine serving on):
    # its watcher does not say so, or the follower and the release would take it for this one.
    engine.workers[1].rollq_state.ipc.status = StageStatus(state=State.STAGED, version=1)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.2, ipc_prestage=True))
    pub = WeightPublisher(redis_url, queue)
    client = redis.asyncio.Redis.from_url(redis_url)
    await follower.start()
    try:
        got = await client.hmget(consumer.keys.weights_ipc_staged, ["r0/0", "r0/1"])
        assert None not in got, got
        assert [msgspec.msgpack.decode(raw, type=StageStatus) for raw in got] == [StageStatus(state=State.IDLE, version=0)] * 2
        rec = await pub.publish_weights(state(1.0), transport="ipc")
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert follower.history[-1].load.get("prestaged") is True, follower.history[-1].load
        assert all(weight0(w) == 1.0 for w in engine.workers)
    finally:
        await follower.stop()
        await pub.close()
        await client.aclose()


async def test_a_watcher_that_will_not_copy_a_version_says_so_and_checks_with_a_short_gil_interval(redis_url, queue, tmp_path):
    """A watcher whose worker still holds a staged version waiting for its swap does not copy
    the next one: it writes BUSY for it, so the follower starts that copy itself at once. The
    watcher starts its copies with the GIL's switch interval shortened (it shares the GIL with
    the engine's busy loop)."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher
    from rollq.weightsync.wire import StageStatus, State
    from tests.helpers import until

    engine = FakeWorkerEngine(small_model, num_workers=2)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.2, ipc_prestage=True))
    pub = WeightPublisher(redis_url, queue)
    intervals: list[float] = []
    for w in engine.workers:
        ipc = w.rollq_state.ipc
        ipc.prestage = (lambda f: lambda *a, **k: intervals.append(sys.getswitchinterval()) or f(*a, **k))(ipc.prestage)

    async def all_say(state: State, version: int) -> bool:  # each watcher's status, as the follower reads it
        got = await pub._client.hmget(consumer.keys.weights_ipc_staged, ["r0/0", "r0/1"])
        return all(raw and (s := msgspec.msgpack.decode(raw, type=StageStatus)).state is state and s.version == version
                   for raw in got)

    await follower.start()
    try:
        async with follower._lock:
            first = await pub.publish_weights(state(1.0), transport="ipc")
            await until(lambda: all_say(State.STAGED, first.version), 10, "the watchers' copy of the first version")
            second = await pub.publish_weights(state(2.0), transport="ipc")
            await until(lambda: all_say(State.BUSY, second.version), 10, "the watchers' word that they will not copy the second")
        await until(lambda: consumer.version == second.version, 10, "the second version, copied by the follower")
        assert follower.history[-1].load.get("prestaged") is None and all(weight0(w) == 2.0 for w in engine.workers)
        assert len(intervals) == 4 and max(intervals) < sys.getswitchinterval(), intervals
    finally:
        await follower.stop()
        await pub.close()
