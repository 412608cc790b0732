"""Replicas as Ray actors on a multi-node Ray cluster: a head and two worker "nodes", each a
``ray start --block`` process of its own on this machine (its own raylet, temp dir and ports).

- placement: ``RayLauncher(replica_resources=...)`` pins replica 0 to the node that offers
  ``node_a`` and replica 1 to ``node_b``; each actor reports the node it runs on;
- exactly once: a few hundred jobs, one result each, both nodes serving;
- weights (real vLLM, one replica per node): a memmap version under a directory both nodes
  see, then a gloo broadcast from this process (the trainer) into both replicas; greedy output
  changes with the weights and every result carries the version it ran on;
- node loss: node_a's raylet and the replica's actor process are SIGKILLed mid-run; the replica on node_b takes its jobs back
  (each completes once), and once a new node_a joins the launcher places replica 0 there again.

Ray rewrites a loopback ``--node-ip-address`` to the host's own address
(``ray._private.services.resolve_ip_for_localhost``) and its servers listen on every
interface; the nodes all share that address and differ by ports. Only processes this module
started are stopped, by pid (``ray stop`` would stop every Ray on the machine).

The vLLM test starts two engines: run this module under the shared lock
(``flock /tmp/rollq-vllm.lock ...``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from rollq import Producer
from rollq import WeightSyncSettings
from rollq.consumer.ray_launcher import EngineSpec, RayLauncher
from rollq.keys import QueueKeys
from rollq.protocol import decode_job
from rollq.server import free_port
from rollq.settings import ConsumerSettings
from tests.helpers import collect, pending_of, until

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = str(Path(sys.executable).with_name("ray"))
#: Each replica's placement group asks for a share of its node's resource.
PLACE = [{"node_a": 0.01}, {"node_b": 0.01}]
#: A dead replica's jobs are taken back after about 2 s.
LEASE = dict(lease_ttl=2.0, heartbeat_interval=0.5, reclaim_interval=0.5)
#: The GCS declares a node dead ~1.5 s after its raylet stops answering (defaults: ~30 s).
GCS_CONFIG = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}


#: Where a Ray process finds its token (passed on to the nodes as they are).
_TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _driver_auth_mode() -> str:
    """The token-auth mode this process (the driver) runs in, for the nodes to match.

    Left unset, a head node turns token auth on whenever ``~/.ray/auth_token`` exists (any
    local ``ray.init()`` on the machine writes one) while a connecting driver does not, and the
    driver is refused; so the nodes are told explicitly."""
    try:
        from ray._raylet import AuthenticationMode, get_authentication_mode
    except ImportError:  # a Ray without token auth
        return "disabled"
    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


class LoopbackRayCluster:
    """A Ray head and worker nodes as separate ``ray start --block`` processes on this host.

    Every node gets its own ``--temp-dir`` (so ``ray.init()`` elsewhere on the machine never
    finds this cluster's address file) and its own ports. :meth:`stop` ends only the processes
    started here: SIGTERM to each ``ray start`` (it stops its node's processes), then SIGKILL to
    its process group and to anything left running from this cluster's temp dirs.
    """

    def __init__(self) -> None:
        self._ports: set[int] = set()  # every port handed to this cluster: Ray refuses one used twice
        self.port = self._free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.dirs: dict[str, str] = {}  # node name -> its --temp-dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k in _TOKEN_VARS}
        self.env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # no drain wait on SIGTERM
        self.env["RAY_AUTH_MODE"] = _driver_auth_mode()

    def _free_port(self) -> int:
        """A free loopback port not handed to this cluster before (the kernel may offer the
        same ephemeral port to two consecutive probes)."""
        for _ in range(100):
            port = free_port()
            if port not in self._ports:
                self._ports.add(port)
                return port
        raise AssertionError("no new free port in 100 tries")

    def _start(self, name: str, args: list[str]) -> None:
        tmp = tempfile.mkdtemp(prefix=f"rq-ray-{name}-", dir="/tmp")  # short: socket paths live here
        self.dirs[name] = tmp
        ports = [f"--{opt}={self._free_port()}" for opt in (
            "node-manager-port", "object-manager-port", "metrics-export-port", "runtime-env-agent-port",
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        )]
        cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--temp-dir={tmp}",
               "--object-store-memory=100000000", "--disable-usage-stats", *ports, *args]
        log = open(os.path.join(tmp, "ray-start.log"), "wb")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start_head(self) -> None:
        self._start("head", [
            "--head", f"--port={self.port}", "--num-cpus=0", '--resources={"node_head": 1}',
            "--include-dashboard=false", f"--dashboard-port={self._free_port()}", f"--ray-client-server-port={self._free_port()}",
            f"--system-config={json.dumps(GCS_CONFIG)}",
        ])
        deadline = time.monotonic() + 60
        while True:  # the GCS accepts connections: worker nodes can join
            assert self.procs["head"].poll() is None, f"ray head exited: {self.log_tail('head')}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 1):
                return
            assert time.monotonic() < deadline, "ray head did not open its GCS port within 60s"
            time.sleep(0.2)

    def start_worker(self, name: str, resource: str, num_cpus: int = 1) -> None:
        self._start(name, [f"--address={self.address}", f"--num-cpus={num_cpus}", f'--resources={{"{resource}": 1}}'])

    def log_tail(self, name: str, n: int = 2000) -> str:
        path = os.path.join(self.dirs[name], "ray-start.log")
        with contextlib.suppress(OSError), open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
        return ""

    def raylet(self, name: str) -> psutil.Process:
        """The raylet process of node ``name`` (a child of its ``ray start``)."""
        kids = psutil.Process(self.procs[name].pid).children(recursive=True)
        (raylet,) = [k for k in kids if k.name() == "raylet"]
        return raylet

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: pgid == pid
                p.wait(10)
        for proc in psutil.process_iter(["pid", "cmdline"]):  # workers left from this cluster only
            cmd = " ".join(proc.info["cmdline"] or ())
            if any(d in cmd for d in self.dirs.values()):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def _alive_nodes() -> dict[str, str]:
    """Custom node resource (node_head, node_a, node_b) -> node id, for nodes alive now."""
    out = {}
    for n in ray.nodes():
        if n["Alive"]:
            for r in n["Resources"]:
                if r.startswith("node_"):
                    out[r] = n["NodeID"]
    return out


def _wait_nodes(names: set[str], timeout: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while not names <= set(nodes := _alive_nodes()):
        assert time.monotonic() < deadline, f"Ray nodes {sorted(names - set(nodes))} did not join within {timeout}s"
        time.sleep(0.2)
    return nodes


@pytest.fixture(scope="module")
def cluster():
    """The head (driver's node, no CPUs) and node_a, node_b (1 CPU each); the driver connected."""
    if ray.is_initialized():
        pytest.fail("a Ray driver is already connected in this process")
    c = LoopbackRayCluster()
    try:
        c.start_head()
        c.start_worker("a", "node_a")
        c.start_worker("b", "node_b")
        ray.init(address=c.address, log_to_driver=False)
        _wait_nodes({"node_head", "node_a", "node_b"})
        yield c
    finally:
        ray.shutdown()
        c.stop()


def _placement(launcher: RayLauncher) -> dict[str, dict[str, Any]]:
    """Replica id -> what its actor reports of its node."""
    return {rid: ray.get(rep.actor.node.remote(), timeout=30) for rid, rep in launcher.replicas.items()}


def _assert_across_nodes(launcher: RayLauncher) -> dict[str, dict[str, Any]]:
    where = _placement(launcher)
    nodes = _alive_nodes()
    assert where["replica-0"]["node_id"] == nodes["node_a"], (where, nodes)
    assert where["replica-1"]["node_id"] == nodes["node_b"], (where, nodes)
    return where


def assert_exactly_once(got: dict[str, list], ids: list[str]) -> None:
    dups = {i: len(rs) for i, rs in got.items() if len(rs) > 1}
    assert not dups, f"results delivered more than once: {dups}"
    assert set(got) == set(ids), f"{len(set(ids) - set(got))} jobs never returned a result"
    bad = [rs[0] for rs in got.values() if not rs[0].ok]
    assert not bad, f"{len(bad)} jobs failed, e.g. {bad[0].error}"


def echo_launcher(url: str, queue: str, delay: float, **settings: Any) -> RayLauncher:
    return RayLauncher(
        url, queue, EngineSpec(kind="echo", options={"delay_per_token": delay}), num_replicas=2,
        settings=ConsumerSettings(**settings), cpus_per_bundle=0.5, replica_resources=PLACE, placement_timeout=60,
    )


# ----------------------------------------------------------------------------------------
# placement and exactly-once results
# ----------------------------------------------------------------------------------------
async def test_replicas_on_two_nodes_serve_every_job_once(cluster, redis_url, queue, redis_client):
    launcher = echo_launcher(redis_url, queue, 0.002, max_inflight=8, **LEASE).start(timeout=120)
    try:
        where = _assert_across_nodes(launcher)
        assert where["replica-0"]["node_id"] != where["replica-1"]["node_id"]
        async with Producer(redis_url, queue) as p:
            n = 300
            hs = await p.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 4}} for i in range(n)])
            got = await collect(p, n, timeout=60, settle=0.5)
        assert_exactly_once(got, [h.id for h in hs])
        served = {rid: sum(rs[0].replica == rid for rs in got.values()) for rid in ("replica-0", "replica-1")}
        assert all(served.values()), f"a node served no job: {served}"
        assert sum(served.values()) == n
        assert await redis_client.xlen(QueueKeys(queue).jobs) == 0
    finally:
        launcher.stop(timeout=20)


# ----------------------------------------------------------------------------------------
# weights through memmap on shared storage, then a gloo broadcast, into real vLLM replicas
# ----------------------------------------------------------------------------------------
GREEDY = {"prompt_token_ids": [5, 17, 99, 3, 250, 7, 7, 300], "sampling": {"max_tokens": 12, "temperature": 0.0}}


def _perturbed(state: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) * 0.5 for k, v in state.items()}


async def _greedy(p: Producer, replica: str) -> tuple[list[int], tuple[int, int]]:
    r = await (await p.submit(**GREEDY, replica=replica)).result(timeout=120)
    assert r.ok and r.replica == replica, (r.error, r.replica)
    return r.samples[0].token_ids, r.policy_version


@pytest.mark.vllm
async def test_weights_reach_vllm_replicas_on_both_nodes(cluster, redis_url, queue, tmp_path, tiny_model_path):
    pytest.importorskip("vllm")
    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.trainer.sender import BroadcastSender
    from tests.vllm_fixtures import checkpoint_state

    root = str(tmp_path / "weights")  # the "shared storage": one path every node sees
    spec = EngineSpec(kind="vllm", options={
        "model": str(tiny_model_path), "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20, "seed": 0,
    })
    launcher = RayLauncher(
        redis_url, queue, spec, num_replicas=2, settings=ConsumerSettings(lease_ttl=10), cpus_per_bundle=1,
        replica_resources=PLACE, weights=WeightSyncSettings(root=root, broadcast=True, reconcile_interval=0.5),
        placement_timeout=60,
    )
    await asyncio.to_thread(launcher.start, timeout=600)
    replicas = ("replica-0", "replica-1")
    # The trainer listens on loopback: every "node" is a process group on this machine, and the
    # tests send traffic to loopback only (across hosts it is the trainer's routable address).
    sender = BroadcastSender(num_workers=2, backend="gloo", host="127.0.0.1", timeout=60, bucket_bytes=1 << 20)
    pub = WeightPublisher(redis_url, queue, root=root, sender=sender)
    try:
        where = _assert_across_nodes(launcher)
        base = checkpoint_state(tiny_model_path)
        async with Producer(redis_url, queue) as p:
            before = {rid: await _greedy(p, rid) for rid in replicas}
            assert {v for _, v in before.values()} == {(0, 0)}
            assert before["replica-0"][0] == before["replica-1"][0]  # same checkpoint, greedy

            # memmap: perturbed weights, written once under root, loaded by both nodes
            rec = await pub.publish_weights(_perturbed(base, 1), transport="memmap")
            assert await pub.wait_for_replicas(rec.version, timeout=120) == {rid: rec.version for rid in replicas}
            for rid in replicas:
                toks, v = await _greedy(p, rid)
                assert v == (rec.version, rec.version) and toks != before[rid][0], (rid, v)

            # gloo broadcast of the checkpoint from this process into both nodes' workers
            rec2 = await pub.publish_weights(base, transport="nccl")
            assert rec2.transport == "gloo", rec2.timings  # not the memmap fallback
            assert await pub.wait_for_replicas(rec2.version, timeout=120) == {rid: rec2.version for rid in replicas}
            for rid in replicas:
                toks, v = await _greedy(p, rid)
                assert v == (rec2.version, rec2.version) and toks == before[rid][0], (rid, v)

        updates = {rid: ray.get(launcher.replicas[rid].actor.updates.remote(), timeout=30) for rid in replicas}
        for rid, ups in updates.items():
            assert [(u["version"], u["transport"]) for u in ups] == [(rec.version, "memmap"), (rec2.version, "gloo")], (rid, ups)
        assert where["replica-0"]["pid"] != where["replica-1"]["pid"]
    finally:
        await pub.close()
        await asyncio.to_thread(launcher.stop, 60)


# ----------------------------------------------------------------------------------------
# a node dies mid-run (runs last: it replaces node_a)
# ----------------------------------------------------------------------------------------
@pytest.mark.chaos
async def test_node_loss_mid_run_each_job_completes_once(cluster, redis_url, queue, redis_client):
    k = QueueKeys(queue)
    # A longer lease: what the dead replica held is read after its process exits and before
    # replica-1 may take it back (a later read would miss jobs, and the test would fail).
    lease = dict(LEASE, lease_ttl=4.0)
    launcher = echo_launcher(redis_url, queue, 0.01, max_inflight=10, **lease).start(timeout=120)
    try:
        where = _assert_across_nodes(launcher)
        async with Producer(redis_url, queue) as p:
            # 0.1 s each, 10 at a time per replica: ~7 s for both, so the queue still holds jobs
            # when replica-0's process notices its node is gone and exits (seconds, under load)
            n = 1500
            hs = await p.submit_many([{"prompt": f"job {i}", "sampling": {"max_tokens": 10}} for i in range(n)])
            await until(lambda: p.counters["results"] >= 30, 30, "the first results")
            await until(lambda: pending_of(redis_client, k.jobs, "replica-0"), 10, "replica-0 to hold jobs", interval=0.005)

            # A lost node takes its processes with it: SIGKILL node_a's raylet and the replica's
            # actor process (started by that raylet), which would otherwise notice the raylet's
            # death in its own time and might drain its jobs first. Its lease runs out lease_ttl
            # later at the earliest: what it holds now is what replica-1 must take back.
            cluster.raylet("a").kill()
            os.kill(where["replica-0"]["pid"], signal.SIGKILL)
            await until(lambda: not psutil.pid_exists(where["replica-0"]["pid"]), 30, "replica-0's actor process to exit")
            held = await pending_of(redis_client, k.jobs, "replica-0")
            assert held, "replica-0 held no jobs when its node died"
            held_ids = {decode_job(f[b"d"]).id for e in held for _, f in await redis_client.xrange(k.jobs, e["message_id"], e["message_id"])}
            assert len(held_ids) == len(held)

            got = await collect(p, n, timeout=60, settle=0.5)
            assert_exactly_once(got, [h.id for h in hs])
            assert p.counters["results"] == n, "a duplicate result reached the producer"
            redelivered = {i for i, rs in got.items() if rs[0].deliveries > 1}
            assert redelivered == held_ids
            assert all(got[i][0].replica == "replica-1" and got[i][0].deliveries == 2 for i in redelivered)
            assert await redis_client.xlen(k.jobs) == 0

            # A new node offering node_a joins; the launcher places replica 0 there again.
            cluster.start_worker("a2", "node_a")
            await asyncio.to_thread(_wait_nodes, {"node_a"})
            restarted: list[str] = []
            deadline = time.monotonic() + 90
            while "replica-0" not in restarted:
                assert time.monotonic() < deadline, "the launcher did not restart replica-0 within 90s"
                restarted += await asyncio.to_thread(launcher.check)
                await asyncio.sleep(0.2)
            await launcher.replicas["replica-0"].actor.ready.remote()
            again = _assert_across_nodes(launcher)
            assert again["replica-0"]["node_id"] != where["replica-0"]["node_id"]  # the new node_a
            assert launcher.replicas["replica-0"].restarts == 1

            hs2 = await p.submit_many([{"prompt": f"more {i}", "sampling": {"max_tokens": 10}} for i in range(60)])
            more = await collect(p, len(hs2), timeout=60, settle=0.5)
            assert_exactly_once(more, [h.id for h in hs2])
            assert {rs[0].replica for rs in more.values()} == {"replica-0", "replica-1"}
    finally:
        launcher.stop(timeout=20)
