"""Direct swaps of leased IPC versions (``WeightSyncSettings(ipc_direct=True)``): the swap copies
the trainer's own tensors straight into the live weights under the replica's claim, which the
publisher's ``release_weights`` waits for (fake workers over CPU shared memory; no engine)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import msgspec
import pytest
import torch

from tests.weightsync.transports.test_ipc import loadable_model
from tests.weightsync.transports.test_ipc_lease import serving, shared


def _live(engine: Any) -> list[torch.Tensor]:
    """Every worker's live parameters."""
    return [p for w in engine.workers for p in w.model_runner.model.parameters()]


def _step(st: dict[str, torch.Tensor], fill: float) -> None:
    """The trainer's optimizer step, in place."""
    with torch.no_grad():
        for v in st.values():
            v.fill_(fill)


def _direct_replica(redis_url: str, queue: str, workers: int = 1, root: str | None = None, model: Any = loadable_model,
                    **settings: Any) -> tuple[Any, Any, Any, Any]:
    """A direct replica ``r0`` (``workers`` fake workers over ``model``; its follower's
    ``WeightSyncSettings`` with ``ipc_direct`` and ``settings``) and a leasing publisher, both
    keeping memmap copies under ``root`` (None: none): the engine, the consumer, the follower
    and the publisher."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.weightsync import WeightFollower, WeightPublisher

    engine = FakeWorkerEngine(model, num_workers=workers)
    consumer = Consumer(engine, redis_url, queue, consumer_id="r0")
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.1, ipc_direct=True, **settings))
    return engine, consumer, follower, WeightPublisher(redis_url, queue, ipc_lease=True, root=root)


async def _to_plan(pub: Any, consumer: Any, st: dict[str, torch.Tensor]) -> None:
    """Two leased versions through the replica: the first traces the load plan (load_weights,
    waited for), the second goes by it."""
    from tests.helpers import until

    for fill in (1.0, 2.0):
        _step(st, fill)
        rec = await pub.publish_weights(st, transport="ipc")
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")


def _hold_direct_swaps(monkeypatch: Any) -> tuple[threading.Event, threading.Event]:
    """Hold every direct swap in the worker before its copy until the returned gate is set;
    the second event says a swap got there."""
    from rollq.weightsync.worker._ipc import IpcStaging

    gate, reached = threading.Event(), threading.Event()
    real = IpcStaging.swap_direct

    def held(self: Any, version: int) -> bool:
        if self.leased is not None and self.state.worker.rank == 0:
            reached.set()
            gate.wait(10)
        return real(self, version)

    monkeypatch.setattr(IpcStaging, "swap_direct", held)
    return gate, reached


@pytest.mark.parametrize("prestage,workers", [(False, 1), (True, 2)], ids=["follower opens", "2 workers' watchers open"])
@pytest.mark.parametrize("shadow", [False, True], ids=["plan traced on live", "plan traced in the shadow"])
async def test_a_direct_swap_copies_the_leased_tensors_into_the_live_weights_and_the_release_waits_for_it(
        redis_url, queue, monkeypatch, shadow, prestage, workers):
    """Each leased version is only opened while the engine serves (no copy, no checksum); the
    swap copies the trainer's tensors into the live weights by a load plan. Without shadow
    weights (a direct replica builds none) the first version loads through load_weights at
    its swap, which traces the plan on the live weights; with them (forced) it loads into
    the shadow, which traces it. The release returns only once that swap is done: held
    mid-swap, the trainer's release waits, and its next step never reaches the replica's
    weights."""
    from rollq.weightsync.worker._ipc import IpcStaging
    from tests.helpers import until

    if shadow:
        monkeypatch.setenv("ROLLQ_SHADOW_WEIGHTS", "1")  # "auto" uses them on GPUs only
    copies: list[int] = []
    real_copy = IpcStaging._copy

    def counted(self: Any, h: Any, srcs: Any, t0: float) -> Any:
        out = real_copy(self, h, srcs, t0)
        if not out.direct:
            copies.append(h.version)
        return out

    monkeypatch.setattr(IpcStaging, "_copy", counted)
    plans: list[int] = []
    real_plan = IpcStaging._plan_copy

    def planned(items: Any, views: Any) -> Any:
        if views is not None:  # a plan to copy by (None: there is none yet)
            plans.append(len(items))
        return real_plan(items, views)

    monkeypatch.setattr(IpcStaging, "_plan_copy", staticmethod(planned))
    engine, consumer, follower, pub = _direct_replica(redis_url, queue, workers, ipc_prestage=prestage)
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        for fill in (1.0, 2.0, 3.0):
            _step(st, fill)
            rec = await pub.publish_weights(st, transport="ipc")
            got = await pub.release_weights(timeout=10)
            assert got["r0"] >= rec.version, got
            _step(st, 100.0)  # the next step, right after the release
            await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
            assert all(bool((p == fill).all()) for p in _live(engine)), (fill, _live(engine))
            load = follower.history[-1].load
            first_with_shadow = shadow and fill == 1.0
            assert load["swap"] == ("shadow" if first_with_shadow else "direct"), load
            assert load.get("direct", False) is not first_with_shadow, load
            if not first_with_shadow:
                assert load["copied_by"] == ("load_weights" if fill == 1.0 else "plan"), load
        assert copies == ([1] * workers if shadow else []), copies  # only the version that traced the plan
        # the copies by the plan are built once per worker (version 2) and reused over the kept mappings
        assert plans == [2] * workers, plans
        assert all((w.rollq_state.shadow is not None) == shadow for w in engine.workers)
        assert all((w.rollq_state.live_plan is not None) != shadow for w in engine.workers)

        gate, reached = _hold_direct_swaps(monkeypatch)
        _step(st, 4.0)
        rec = await pub.publish_weights(st, transport="ipc")
        releasing = asyncio.create_task(pub.release_weights(timeout=0.2))
        assert await asyncio.to_thread(reached.wait, 10), "the direct swap did not start"
        await asyncio.sleep(0.5)  # well past the release's timeout for copies
        assert not releasing.done(), "the release did not wait for the claimed swap"
        claims = await pub._client.hgetall(consumer.keys.weights_ipc_claims)
        assert b"c:r0" in claims and int(claims[b"c:r0"].split()[0]) == rec.version, claims
        gate.set()
        await asyncio.wait_for(releasing, 10)
        _step(st, 100.0)
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        assert all(bool((p == 4.0).all()) for p in _live(engine))
        assert b"c:r0" not in await pub._client.hgetall(consumer.keys.weights_ipc_claims)
    await pub.close()


async def test_a_version_whose_release_began_before_the_claim_is_refused_and_the_next_goes_through(
        redis_url, queue, monkeypatch):
    """The workers opened a leased version (watchers), but the follower reaches its claim only
    after the trainer's release began (its copies timeout ran out): the claim is refused, the
    version is not applied, the load failure is recorded, the old weights serve on, and the next
    version is swapped in directly."""
    from rollq.weightsync import read_load_errors
    from tests.helpers import until

    engine, consumer, follower, pub = _direct_replica(redis_url, queue, ipc_prestage=True, load_retries=0)
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        first = await pub.publish_weights(st, transport="ipc")
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == first.version, 10, "version 1")
        async with follower._lock:  # the follower cannot reach the claim
            _step(st, 2.0)
            second = await pub.publish_weights(st, transport="ipc")
            ipc = engine.workers[0].rollq_state.ipc
            await until(lambda: ipc.leased is not None and ipc.leased.version == second.version, 10, "opened")
            t0 = time.monotonic()
            await pub.release_weights(timeout=0.2)  # the watchers' opening is no copy: it waits, then releases
            assert time.monotonic() - t0 >= 0.2
            _step(st, 9.0)
        errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
        assert (errors["r0"].version, errors["r0"].error) == (second.version, "IpcUnavailable"), errors
        assert "began releasing" in errors["r0"].message, errors
        assert consumer.version == first.version and all(bool((p == 1.0).all()) for p in _live(engine))
        _step(st, 3.0)
        third = await pub.publish_weights(st, transport="ipc")
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == third.version, 10, "the next version")
        assert follower.history[-1].load["swap"] == "direct"
        assert all(bool((p == 3.0).all()) for p in _live(engine))
    await pub.close()


async def test_the_release_waits_for_live_unexpired_claims_only_and_refuses_later_ones(redis_url, queue):
    """A claim of the version (or an older one) by a live replica holds the release until it is
    removed or the replica dies; claims past their deadline, of dead replicas, or of a newer
    version do not; once the release began, claiming that version is refused."""
    from tests.helpers import register_replica
    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.transports.ipc import IPC_CLAIM
    from rollq.weightsync.transports.ipc_lease import _end_claims

    pub = WeightPublisher(redis_url, queue)
    client, keys = await pub.redis(), pub.keys
    key = keys.weights_ipc_claims

    try:
        now_ms = int(time.time() * 1000)
        for rid, alive in (("holder", True), ("dies", True), ("expired", True), ("dead", False), ("newer", True)):
            await register_replica(client, keys, rid, alive=alive)
        assert await IPC_CLAIM(client, [key], ["holder", 5, now_ms + 60_000]) == 1
        assert await IPC_CLAIM(client, [key], ["dies", 5, now_ms + 60_000]) == 1
        assert await IPC_CLAIM(client, [key], ["expired", 4, now_ms - 1]) == 1
        assert await IPC_CLAIM(client, [key], ["dead", 5, now_ms + 60_000]) == 1
        assert await IPC_CLAIM(client, [key], ["newer", 6, now_ms + 60_000]) == 1
        await client.hset(key, "c:garbage", "not a claim")
        waiting = asyncio.create_task(_end_claims(client, keys, 5))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert await IPC_CLAIM(client, [key], ["late", 5, now_ms + 60_000]) == 0  # the release began
        assert await IPC_CLAIM(client, [key], ["late", 4, now_ms + 60_000]) == 0
        await client.hdel(key, "c:holder")  # the holder's swap ended
        await asyncio.sleep(0.3)
        assert not waiting.done()  # "dies" still swaps
        await client.delete(keys.heartbeat("dies"))  # and dies holding its claim
        await asyncio.wait_for(waiting, 5)
        assert await IPC_CLAIM(client, [key], ["next", 6, now_ms + 60_000]) == 1  # the next version is claimable
    finally:
        await pub.close()


def test_leased_handles_are_owned():
    from rollq.weightsync.ipc_wire import IpcHandles, IpcStorage, StorageKind

    token = IpcStorage(kind=StorageKind.CPU, nbytes=8, fd=5, inode=77)
    with pytest.raises(ValueError, match="leased handles are owned"):
        IpcHandles(version=1, host="h", pid=2, checksum="c", token=token, storages=[], tensors=[], lease=True)
    assert IpcHandles(version=1, host="h", pid=2, checksum="", token=token, storages=[], tensors=[], owned=True,
                      lease=True).lease



@pytest.mark.parametrize("memmap", [False, True], ids=["no memmap copy", "memmap copy"])
@pytest.mark.parametrize("transform", [False, True], ids=["by the plan", "load_weights"])
async def test_a_direct_swap_whose_version_is_released_while_it_copies_is_torn(redis_url, queue, monkeypatch, tmp_path,
                                                                               memmap, transform):
    """The trainer's release reaches the worker in the middle of its copy (the replica's claim
    was lost, e.g. with a Redis that restarted empty): the trainer may have changed the tensors
    the swap read, so the swap is torn (``TornDirectSwap``), not taken as the version: with
    the memmap copy the publisher kept, the replica loads that instead and serves the version
    whole; without one the failure is recorded. Whether the copy goes by the load plan or
    through load_weights (a loader that transforms what it reads gives no plan)."""
    from rollq.weightsync import read_load_errors
    from rollq.weightsync.transports.ipc_lease import release
    from rollq.weightsync.worker._state import WorkerState
    from tests.helpers import until

    engine, consumer, follower, pub = _direct_replica(redis_url, queue, root=str(tmp_path) if memmap else None,
                                                      model=lambda: loadable_model(transform), load_retries=0)
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        first = await pub.publish_weights(st, transport="ipc")
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == first.version, 10, "version 1")
        assert follower.history[-1].load["copied_by"] == "load_weights"
        real_load, real_wrote = WorkerState.load_live, WorkerState.wrote_live
        how: list[str] = []

        def released_meanwhile(self: Any, items: Any, **kw: Any) -> None:
            release(pub)  # the trainer's release, past the claim it never saw
            how.append("load_weights")
            real_load(self, items, **kw)

        def released_after_the_copy(self: Any, manifest: Any) -> None:
            release(pub)  # by the plan: the copy is made, the check after it runs next
            how.append("plan")
            real_wrote(self, manifest)

        monkeypatch.setattr(WorkerState, "load_live", released_meanwhile)
        monkeypatch.setattr(WorkerState, "wrote_live", released_after_the_copy)
        _step(st, 2.0)
        second = await pub.publish_weights(st, transport="ipc")
        _step(st, 9.0)  # the trainer's step after its (early) release
        if memmap:
            await until(lambda: consumer.version == second.version, 10, "the version, from its memmap copy")
            assert follower.history[-1].load.get("swap") != "direct", follower.history[-1].load
            assert all(bool((p == 2.0).all()) for p in _live(engine)), _live(engine)
        else:
            errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
            assert (errors["r0"].version, errors["r0"].error) == (second.version, "TornDirectSwap"), errors
            assert consumer.version == first.version
        assert how[0] == ("load_weights" if transform else "plan"), how
    await pub.close()


async def test_an_update_that_fails_before_its_direct_swap_ends_its_claim(redis_url, queue, monkeypatch):
    """The update fails after the claim and before the swap (here ending the running requests
    under the ``abort`` policy): the claim goes at once, so the trainer's release does not wait
    for its deadline."""
    import rollq.weightsync.replica.follower as follower_module
    from rollq.weightsync import read_load_errors
    from tests.helpers import until

    engine, consumer, follower, pub = _direct_replica(redis_url, queue, load_retry_delay=60.0)
    client = await pub.redis()
    await client.hset(consumer.keys.config, "update_policy", "abort")
    real, calls = follower_module.end_running, []

    async def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the engine would not pause")
        return await real(*args, **kwargs)

    monkeypatch.setattr(follower_module, "end_running", fails_once)
    async with serving(consumer, follower, client):
        st = shared(1.0)
        rec = await pub.publish_weights(st, transport="ipc")
        errors = await until(lambda: read_load_errors(client, consumer.keys), 10, "a load error")
        assert errors["r0"].version == rec.version and "would not pause" in errors["r0"].message, errors
        await until(lambda: _no_claim(client, consumer.keys), 5, "the claim to go")
        t0 = time.monotonic()
        await pub.release_weights(timeout=0.2)
        assert time.monotonic() - t0 < 5  # not the claim's deadline (load_timeout)
    await pub.close()


async def _no_claim(client: Any, keys: Any) -> bool:
    return b"c:r0" not in await client.hgetall(keys.weights_ipc_claims)


def _hold_pending_copies(monkeypatch: Any, before: Any = None) -> tuple[threading.Event, threading.Event]:
    """Hold every direct swap's copies by the plan "on the device" (their end, which the swap
    call no longer waits for) until the returned gate is set; ``before`` runs first (in the
    worker's watch thread); the second event says the copies were enqueued."""
    from rollq.weightsync.worker._direct_copy import PendingCopy

    gate, reached = threading.Event(), threading.Event()
    real = PendingCopy.finish

    def held(self: Any) -> Any:
        reached.set()
        gate.wait(10)
        if before is not None:
            before()
        return real(self)

    monkeypatch.setattr(PendingCopy, "finish", held)
    return gate, reached


async def test_a_direct_swap_call_returns_before_its_copies_end_and_the_claim_lasts_until_they_did(
        redis_url, queue, monkeypatch):
    """A direct swap by the load plan enqueues its copies and returns (the engine steps on,
    after them on the device); the replica keeps its claim, and holds the version back from
    its results, until every worker says the copies ended (``rollq_swap_done``): the trainer's
    release waits that long, and the update reports the wait."""
    from tests.helpers import until

    engine, consumer, follower, pub = _direct_replica(redis_url, queue, 2)
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        await _to_plan(pub, consumer, st)
        assert follower.history[-1].load["copied_by"] == "plan" and follower.history[-1].load["pending"] is True
        gate, reached = _hold_pending_copies(monkeypatch)
        _step(st, 3.0)
        rec = await pub.publish_weights(st, transport="ipc")
        releasing = asyncio.create_task(pub.release_weights(timeout=0.2))
        assert await asyncio.to_thread(reached.wait, 10), "the direct swap's copies were not enqueued"
        # every worker's call returned, its copies still "running"
        await until(lambda: all(w.rollq_state.last_swap.version == rec.version for w in engine.workers), 10, "the calls")
        assert all(w.rollq_state.last_swap.done_at is None for w in engine.workers)
        await asyncio.sleep(0.5)
        assert not releasing.done(), "the release did not wait for the copies"
        assert consumer.version == 2, "the version was taken before its copies ended"
        claims = await pub._client.hgetall(consumer.keys.weights_ipc_claims)
        assert int(claims[b"c:r0"].split()[0]) == rec.version, claims
        gate.set()
        await asyncio.wait_for(releasing, 10)
        await until(lambda: consumer.version == rec.version, 10, f"version {rec.version}")
        load = follower.history[-1].load
        assert (load["swap"], load["copied_by"], load["pending"]) == ("direct", "plan", True), load
        assert load["wait_copy_s"] >= 0.4, load
        assert all(bool((p == 3.0).all()) for p in _live(engine))
        assert b"c:r0" not in await pub._client.hgetall(consumer.keys.weights_ipc_claims)
    await pub.close()


@pytest.mark.parametrize("memmap", [False, True], ids=["no memmap copy", "memmap copy"])
async def test_a_version_released_while_its_direct_copies_still_run_is_torn(redis_url, queue, monkeypatch, tmp_path,
                                                                           memmap):
    """The swap call returned, its copies still run, and the trainer releases the version (the
    claim was lost): the copies may have read changed tensors, which the worker finds once they
    ended (``SwapTimes.torn``). The version is not taken from them: with the publisher's memmap
    copy the replica loads that (the version, whole); without one the failure is recorded and
    the next version goes through."""
    from rollq.weightsync import read_load_errors
    from rollq.weightsync.transports.ipc_lease import release
    from tests.helpers import until

    engine, consumer, follower, pub = _direct_replica(redis_url, queue, root=str(tmp_path) if memmap else None, load_retries=0)
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        await _to_plan(pub, consumer, st)
        gate, reached = _hold_pending_copies(monkeypatch, before=lambda: release(pub))
        gate.set()  # held only for the release to land between the call and the copies' end
        _step(st, 3.0)
        third = await pub.publish_weights(st, transport="ipc")
        if memmap:
            await until(lambda: consumer.version == third.version, 10, "the version, from its memmap copy")
            assert follower.history[-1].load.get("swap") != "direct", follower.history[-1].load
        else:
            errors = await until(lambda: read_load_errors(pub._client, consumer.keys), 10, "a load error")
            assert (errors["r0"].version, errors["r0"].error) == (third.version, "TornDirectSwap"), errors
            assert "during its direct swap" in errors["r0"].message, errors
            assert consumer.version == 2
        assert reached.is_set()
        monkeypatch.undo()
        _step(st, 4.0)
        fourth = await pub.publish_weights(st, transport="ipc")
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == fourth.version, 10, "the next version")
        assert all(bool((p == 4.0).all()) for p in _live(engine))
    await pub.close()


async def test_waiting_for_direct_copies_reads_every_pending_worker_and_is_bounded():
    """The follower's wait for a direct swap's copies: done once every worker whose call said
    ``pending`` reports them ended for this version (others are not waited for); a torn
    worker raises TornDirectSwap; copies that never end raise WeightSyncTimeout at
    ``load_timeout``."""
    from rollq import WeightSyncSettings
    from rollq.errors import WeightSyncTimeout
    from rollq.weightsync.ipc_wire import TornDirectSwap
    from rollq.weightsync.transports.ipc import IpcReceive
    from rollq.weightsync.wire import SwapTimes

    class Calls:
        def __init__(self, answers: list[list[SwapTimes]]):
            self.answers, self.asked = answers, 0

        async def swap_done(self) -> list[SwapTimes]:
            self.asked += 1
            return self.answers[min(self.asked, len(self.answers)) - 1]

    t = IpcReceive(None, WeightSyncSettings(load_timeout=0.3), None)
    old, running, ended = SwapTimes(version=4, done_at=1.0), SwapTimes(version=5), SwapTimes(version=5, done_at=2.0)
    t.workers = Calls([[running, old], [ended, old]])  # type: ignore[assignment]
    await t._copies_ended(5, [True, False])  # worker 1 went by load_weights: not pending
    assert t.workers.asked == 2
    t.workers = Calls([[ended, running], [ended, SwapTimes(version=5, done_at=2.0, torn="trainer process 7 exited")]])  # type: ignore[assignment]
    with pytest.raises(TornDirectSwap, match="process 7 exited"):
        await t._copies_ended(5, [True, True])
    t.workers = Calls([[running]])  # type: ignore[assignment]
    t0 = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="did not end within"):
        await t._copies_ended(5, [True])
    assert 0.3 <= time.monotonic() - t0 < 5


async def test_watching_workers_write_their_direct_copies_end_to_redis_and_the_follower_reads_it_there(
        redis_url, queue, monkeypatch):
    """With the workers watching (``ipc_prestage``), each worker's thread that waits for a
    direct swap's copies writes their end to ``QueueKeys.weights_ipc_swaps`` (its field
    ``replica/rank``), and the follower takes the version from there: here the engine's
    ``rollq_swap_done`` answers nothing newer than before the swap, and the version still goes
    through within its load timeout, its wait for the copies measured."""
    from rollq.weightsync.wire import SwapTimes
    from rollq.weightsync.worker.ext import RollqWorkerExtension
    from tests.helpers import until

    engine, consumer, follower, pub = _direct_replica(redis_url, queue, 2, ipc_prestage=True, load_timeout=5)
    async with serving(consumer, follower, await pub.redis()):
        st = shared(1.0)
        await _to_plan(pub, consumer, st)
        assert follower.history[-1].load["pending"] is True
        asked: list[int] = []

        def stale(self: Any) -> dict[str, Any]:  # the engine's answer never says the copies ended
            asked.append(1)
            return msgspec.to_builtins(SwapTimes(version=2, enqueued_at=1.0, done_at=1.5))

        monkeypatch.setattr(RollqWorkerExtension, "rollq_swap_done", stale)
        gate, reached = _hold_pending_copies(monkeypatch)
        _step(st, 3.0)
        rec = await pub.publish_weights(st, transport="ipc")
        assert await asyncio.to_thread(reached.wait, 10), "the direct swap's copies were not enqueued"
        await asyncio.sleep(0.3)
        assert consumer.version == 2, "the version was taken before its copies ended"
        gate.set()
        await pub.release_weights(timeout=10)
        await until(lambda: consumer.version == rec.version, 4, f"version {rec.version}, its copies' end read from Redis")
        load = follower.history[-1].load
        assert (load["swap"], load["pending"]) == ("direct", True) and load["wait_copy_s"] >= 0.2, load
        assert all(bool((p == 3.0).all()) for p in _live(engine))
        raw = await pub._client.hmget(consumer.keys.weights_ipc_swaps, ["r0/0", "r0/1"])
        times = [msgspec.msgpack.decode(r, type=SwapTimes) for r in raw]
        assert all(t.version == rec.version and t.done_at is not None and t.torn is None for t in times), times
    assert await pub._client.hlen(consumer.keys.weights_ipc_swaps) == 0  # a stopped replica's go with it
    await pub.close()


async def test_the_wait_for_direct_copies_reads_the_watchers_writes_of_this_swap_and_falls_back_to_the_engine(
        redis_client, queue):
    """Watching workers' writes (``QueueKeys.weights_ipc_swaps``) end the wait as soon as
    every pending worker's says the copies of this version ended, of a swap enqueued after
    the call began (an older write of the same version does not count); a torn one raises
    TornDirectSwap; without the writes (the Redis read fails) the engine's answers end it."""
    from rollq import WeightSyncSettings
    from rollq.errors import WeightSyncTimeout
    from rollq.keys import QueueKeys
    from rollq.weightsync.ipc_wire import TornDirectSwap
    from rollq.weightsync.transports.ipc import IpcReceive
    from rollq.weightsync.wire import SwapTimes

    class Calls:
        def __init__(self, answer: list[SwapTimes]):
            self.answer, self.asked = answer, 0

        async def swap_done(self) -> list[SwapTimes]:
            self.asked += 1
            await asyncio.sleep(0.01)  # an engine step
            return self.answer

    keys = QueueKeys(queue)
    t = IpcReceive(None, WeightSyncSettings(load_timeout=0.5), None)
    t.client, t.keys, t._fields = redis_client, keys, ("r0/0", "r0/1")
    running = SwapTimes(version=5, enqueued_at=100.0)
    t.workers = Calls([running, running])  # type: ignore[assignment]

    def put(**times: SwapTimes) -> Any:
        return redis_client.hset(keys.weights_ipc_swaps, mapping={f"r0/{k[1:]}": msgspec.msgpack.encode(v)
                                                                for k, v in times.items()})

    await put(w0=SwapTimes(version=5, enqueued_at=50.0, done_at=51.0))  # an older swap of version 5
    with pytest.raises(WeightSyncTimeout):
        await t._copies_ended(5, [True, False], since=99.0)
    await put(w0=SwapTimes(version=5, enqueued_at=100.0, done_at=101.0))
    await t._copies_ended(5, [True, False], since=99.0)  # worker 1 not pending: not read
    with pytest.raises(WeightSyncTimeout):
        await t._copies_ended(5, [True, True], since=99.0)
    await put(w1=SwapTimes(version=5, enqueued_at=100.0, done_at=101.0, torn="trainer process 7 exited"))
    with pytest.raises(TornDirectSwap, match="process 7 exited"):
        await t._copies_ended(5, [True, True], since=99.0)

    class Down:
        async def hmget(self, *a: Any) -> Any:
            raise ConnectionError("Redis is down")

    t.client = Down()  # type: ignore[assignment]
    t.workers = Calls([SwapTimes(version=5, enqueued_at=100.0, done_at=101.0)] * 2)  # type: ignore[assignment]
    await t._copies_ended(5, [True, True], since=99.0)
    assert t.workers.asked >= 1
