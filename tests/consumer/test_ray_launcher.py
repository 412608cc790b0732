"""Replicas as Ray actors on a local Ray cluster (real Ray, real redis-server)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollq.consumer.ray_launcher import EngineSpec, RayLauncher
from rollq.producer.client import Producer
from rollq.settings import ConsumerSettings

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


async def _run_jobs(url, queue, n, replicas=None):
    async with Producer(url, queue) as p:
        hs = await p.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 4}} for i in range(n)])
        return await p.gather(hs, timeout=60)


def test_two_replicas_share_a_queue_and_dead_actor_is_restarted(ray_cluster, redis_url, queue):
    ray = ray_cluster
    settings = ConsumerSettings(lease_ttl=2.0, heartbeat_interval=0.5, reclaim_interval=0.5, max_inflight=8)
    launcher = RayLauncher(
        redis_url, queue, EngineSpec(kind="echo", options={"delay_per_token": 0.01}), num_replicas=2,
        settings=settings, cpus_per_bundle=0.5,
    ).start()
    try:
        results = asyncio.run(_run_jobs(redis_url, queue, 40))
        assert all(r.ok for r in results)
        share = {r.replica for r in results}
        assert share == {"replica-0", "replica-1"}, share  # both pulled work; no router involved

        # Kill one replica's actor: the launcher restarts it under the same id.
        victim = launcher.replicas["replica-0"]
        ray.kill(victim.actor, no_restart=True)
        deadline = time.time() + 60
        restarted = []
        while time.time() < deadline and not restarted:
            restarted = launcher.check()
            time.sleep(0.2)
        assert restarted == ["replica-0"]
        ray.get(launcher.replicas["replica-0"].actor.ready.remote(), timeout=60)
        assert launcher.replicas["replica-0"].restarts == 1
        results = asyncio.run(_run_jobs(redis_url, queue, 20))
        assert all(r.ok for r in results) and len(results) == 20
        infos = launcher.info()
        assert sorted(i["id"] for i in infos) == ["replica-0", "replica-1"]
    finally:
        launcher.stop(timeout=20)
    assert launcher.replicas == {}


def test_replica_that_no_node_can_place_times_out(ray_cluster, redis_url, queue):
    # replica_resources pins replicas to nodes offering a custom resource; none offers this one
    launcher = RayLauncher(
        redis_url, queue, EngineSpec(kind="echo"), num_replicas=1, cpus_per_bundle=0.5,
        replica_resources=[{"node_nowhere": 0.01}], placement_timeout=2,
    )
    with pytest.raises(TimeoutError, match="placement_timeout"):
        launcher.start()
    assert launcher.replicas == {}
    assert not [pg for pg in ray_cluster.util.placement_group_table().values() if pg["state"] != "REMOVED"]
