"""``rollq serve --weight-transfer gloo``: a trainer's weight updates, received over a real gloo
group on loopback and published as rollq versions that a replica (fake workers: a plain torch
module, rollq's whole weight-sync path) loads.

TRL's own ``VLLMClient`` drives the HTTP sequence; its NCCL calls need CUDA, so the two vLLM
helpers it calls for the group (``trainer_init``, ``packed_nccl_broadcast_producer``) are
swapped for their gloo twins of :mod:`rollq.serve.gloo_trainer`, same signatures, same packed
format. What stays untested without GPUs: the NCCL group itself (vLLM's ``PyNcclCommunicator``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, AsyncIterator

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rollq import Consumer, ConsumerSettings
from rollq.consumer.engine import EchoEngine
from rollq.keys import QueueKeys
from rollq.serve import gloo_trainer
from rollq.serve.weights import WeightTransferConfig
from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.weightsync import MemmapStore, read_version
from tests.helpers import until
from tests.serve.conftest import http_server
from tests.vllm_fixtures import serving_replica

trl_client = pytest.importorskip("trl.generation.vllm_client")

MODEL = "tiny-weights"


class Tiny(torch.nn.Module):
    """Parameters named as a checkpoint names them: ``model.layers.0.proj.{weight,bias}``,
    ``model.norm.weight``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].proj = torch.nn.Linear(4, 8)
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.rand(4))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def model_dir(tmp_path):
    """The served model's folder: Tiny(seed=0) as model.safetensors."""
    d = tmp_path / "model"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in Tiny(0).state_dict().items()}, str(d / "model.safetensors"))
    return str(d)


@contextlib.asynccontextmanager
async def replica(redis_url: str, queue: str, root: str) -> AsyncIterator[tuple[Consumer, FakeWorkerEngine]]:
    """A consumer over fake workers holding Tiny(0), following the queue's versions."""
    engine = FakeWorkerEngine(lambda: Tiny(0))
    settings = ConsumerSettings(lease_ttl=5, heartbeat_interval=0.2, block=0.2)
    async with serving_replica(engine, redis_url, queue, root, settings=settings, consumer_id="r0", reconcile_interval=0.2,
                               stop_timeout=15) as (consumer, _):
        yield consumer, engine


def served(engine: FakeWorkerEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.workers[0].model_runner.model.module.named_parameters()}


@pytest.fixture
def gloo_trl(monkeypatch):
    """TRL's client module with its group helpers on gloo (CPU) and its address on loopback."""
    monkeypatch.setattr(trl_client, "open_trainer_endpoint", lambda info: gloo_trainer.trainer_init(info, timeout=30))
    monkeypatch.setattr(trl_client, "packed_nccl_broadcast_producer", gloo_trainer.packed_broadcast_producer)
    monkeypatch.setattr(trl_client, "get_ip", lambda: "127.0.0.1")
    return trl_client


async def test_trl_client_weight_update_becomes_a_version_every_replica_loads(redis_url, queue, tmp_path, model_dir,
                                                                           make_producer, gloo_trl):
    root = str(tmp_path / "weights")
    cfg = WeightTransferConfig(backend="gloo", root=root, model=model_dir, timeout=30)
    trainer = Tiny(seed=1)
    async with replica(redis_url, queue, root) as (consumer, engine):
        producer = await make_producer(queue)
        async with http_server(producer, model_name=MODEL, weights=cfg) as base:
            client = await asyncio.to_thread(gloo_trl.VLLMClient, base_url=base, group_port=free_port(),
                                             connection_timeout=10)
            assert (await asyncio.to_thread(client.get_server_info))["weight_transfer_config"] == {"backend": "gloo"}
            await asyncio.to_thread(client.init_communicator, "cuda")  # the device is only checked for its type
            await asyncio.to_thread(client.update_model_params, trainer)  # start, update (broadcast), finish
            await asyncio.to_thread(client.reset_prefix_cache)
            rec = await read_version(producer._client, QueueKeys(queue))
            assert rec is not None and rec.version == 1 and rec.num_tensors == 3
            await until(lambda: consumer.version == 1, 20, "the replica to load the trainer's version")
            got = served(engine)
            for name, p in trainer.named_parameters():
                assert torch.equal(got[name], p.detach()), name
            # A partial update (one tensor) is merged into the state the server holds.
            norm = torch.full((4,), 7.0)
            await asyncio.to_thread(client.update_named_param, "model.norm.weight", norm)
            await until(lambda: consumer.version == 2, 20, "the replica to load the partial update")
            got = served(engine)
            assert torch.equal(got["model.norm.weight"], norm)
            assert torch.equal(got["model.layers.0.proj.weight"], trainer.model.layers[0].proj.weight.detach())
            # Generation after the update is served by a replica at the new version.
            out = await asyncio.to_thread(client.generate, [[5, 6, 7]], max_tokens=3)
            assert len(out["completion_ids"]) == 1
            client.close_communicator()
            client.session.close()


# -- the sequence over plain HTTP (multi-chunk packing, bad input) ------------------------------
@contextlib.asynccontextmanager
async def served_app(producer: Any, cfg: WeightTransferConfig | None) -> AsyncIterator[httpx.AsyncClient]:
    async with http_server(producer, model_name=MODEL, weights=cfg) as base:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            yield c


def init_info(port: int, **kw: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True, **kw}


async def join(c: httpx.AsyncClient, info: dict[str, Any]) -> gloo_trainer.GlooGroup:
    """POST /init_weight_transfer_engine while the trainer joins as rank 0; the group."""
    post = asyncio.create_task(c.post("/init_weight_transfer_engine", json={"init_info": info}))
    group = await asyncio.to_thread(gloo_trainer.trainer_init, info, 0, 30.0)
    r = await post
    assert r.status_code == 200 and r.json() == {"message": "Weight transfer initialized"}, r.text
    return group


def meta(items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {"names": [n for n, _ in items], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items]}


async def send(c: httpx.AsyncClient, group: Any, items: list[tuple[str, torch.Tensor]], buffer: int = 1 << 30,
               upto: int | None = None) -> httpx.Response:
    """POST /update_weights while the trainer broadcasts ``items`` (its first ``upto`` chunks)."""
    post = asyncio.create_task(c.post("/update_weights", json={"update_info": meta(items)}))
    chunks = iter(items)

    def produce() -> None:
        if upto is None:
            gloo_trainer.packed_broadcast_producer(chunks, group, 0, lambda it: it[1], buffer)
            return
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        for _ in range(upto):
            chunk = pack_tensors(chunks, lambda it: it[1], buffer)
            assert chunk is not None
            group.broadcast(chunk.packed_tensor, src=0)

    await asyncio.to_thread(produce)
    return await post


async def test_multi_chunk_updates_and_refused_input(redis_url, queue, tmp_path, model_dir, make_producer):
    """Packed chunks smaller than a tensor, then each bad input gets vLLM's status and a message
    naming it; the group stays usable after a refused (but received) update."""
    root = str(tmp_path / "weights")
    cfg = WeightTransferConfig(backend="gloo", root=root, model=model_dir, timeout=30)
    producer = await make_producer(queue)
    async with served_app(producer, cfg) as c:
        r = await c.post("/update_weights", json={"update_info": meta([])})
        assert r.status_code == 500 and "start_weight_update must be called before update_weights" in r.json()["error"]["message"]
        r = await c.post("/finish_weight_update", json={})
        assert r.status_code == 500 and "without a matching start_weight_update" in r.json()["error"]["message"]
        group = await join(c, init_info(free_port(), packed_buffer_size_bytes=130))
        assert (await c.post("/start_weight_update", json={})).status_code == 200
        r = await c.post("/start_weight_update", json={})
        assert r.status_code == 500 and "already active" in r.json()["error"]["message"]
        new = Tiny(seed=3)
        items = [(n, p.detach()) for n, p in new.named_parameters()]  # 128 + 32 + 16 bytes: chunks [w, b], [norm]
        r = await send(c, group, items, buffer=130)
        assert r.status_code == 200 and r.json() == {"message": "Weights updated"}, r.text
        r = await c.post("/finish_weight_update", json={})
        assert r.status_code == 200 and r.json()["rollq"]["version"] == 1, r.text
        rec = await read_version(producer._client, QueueKeys(queue))
        stored = dict(MemmapStore(root).read(rec.memmap_slot, version=1, checksum=rec.checksum))
        assert set(stored) == {n for n, _ in items}
        for n, t in items:
            assert torch.equal(stored[n], t), n
        # unknown name, wrong shape, wrong dtype: received (the group stays in step), refused
        for bad, needle in [([("model.nope.weight", torch.zeros(2))], "unexpected (model.nope.weight)"),
                            ([("model.norm.weight", torch.zeros(5))], "model.norm.weight: sent [5], served [4]"),
                            ([("model.norm.weight", torch.zeros(4, dtype=torch.bfloat16))], "dtype mismatch")]:
            assert (await c.post("/start_weight_update", json={})).status_code == 200
            r = await send(c, group, bad)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
            r = await c.post("/finish_weight_update", json={})
            assert r.status_code == 500, "a refused update ends the update, as vLLM's does"
        # the group still carries a good update
        assert (await c.post("/start_weight_update", json={})).status_code == 200
        r = await send(c, group, [("model.norm.weight", torch.full((4,), 2.0))])
        assert r.status_code == 200, r.text
        r = await c.post("/finish_weight_update", json={"weight_version": "5"})
        assert r.json()["rollq"]["version"] == 5
        r = await c.post("/start_weight_update", json={})
        r = await c.post("/finish_weight_update", json={"weight_version": "v6"})
        assert r.status_code == 200 and "rollq" not in r.json(), "nothing received: nothing published"
        # update_info that does not describe its bytes: refused before the receive, group dropped
        assert (await c.post("/start_weight_update", json={})).status_code == 200
        r = await c.post("/update_weights", json={"update_info": {"names": ["a"], "dtype_names": ["nope"], "shapes": [[1]]}})
        assert r.status_code == 400 and "not a torch dtype" in r.json()["error"]["message"]
        r = await c.post("/start_weight_update", json={})
        r = await c.post("/update_weights", json={"update_info": meta(items)})
        assert r.status_code == 500 and "not initialized" in r.json()["error"]["message"]
        # sizes a server cannot hold: refused before anything is allocated or received
        for upd, needle in [({"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[1 << 40]]}, "bytes, more than"),
                            ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1] * 9]}, "more than 8"),
                            ({"names": [f"n{i}" for i in range(100_001)], "dtype_names": ["float32"] * 100_001,
                              "shapes": [[1]] * 100_001}, "at most 100000")]:
            await join(c, init_info(free_port()))  # each refusal drops the group
            assert (await c.post("/start_weight_update", json={})).status_code == 200
            r = await c.post("/update_weights", json={"update_info": upd})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        for bad in ({"packed_buffer_size_bytes": 1 << 50}, {"world_size": 1 << 20}):
            r = await c.post("/init_weight_transfer_engine", json={"init_info": {**init_info(free_port()), **bad}})
            assert r.status_code == 400, r.text
        # a body without init_info / update_info: vLLM's validation error
        r = await c.post("/init_weight_transfer_engine", json={})
        assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
        rec = await read_version(producer._client, QueueKeys(queue))
        assert rec is not None and rec.version == 5


async def test_init_twice(redis_url, queue, tmp_path, model_dir, make_producer):
    """A second init while the first waits for its trainer is refused; a trainer that comes
    back and initialises again (no update in progress) replaces the old group; an init during
    an update is refused."""
    cfg = WeightTransferConfig(backend="gloo", root=str(tmp_path / "w"), model=model_dir, timeout=30)
    producer = await make_producer(queue)
    async with served_app(producer, cfg) as c:
        port = free_port()
        first = asyncio.create_task(c.post("/init_weight_transfer_engine", json={"init_info": init_info(port)}))
        await asyncio.sleep(0.5)  # the server waits for the trainer's rendezvous
        r = await c.post("/init_weight_transfer_engine", json={"init_info": init_info(free_port())})
        assert r.status_code == 400 and "already waiting" in r.json()["error"]["message"]
        await asyncio.to_thread(gloo_trainer.trainer_init, init_info(port), 0, 30.0)
        assert (await first).status_code == 200
        group = await join(c, init_info(free_port()))  # again: replaces the group
        assert (await c.post("/start_weight_update", json={})).status_code == 200
        r = await c.post("/init_weight_transfer_engine", json={"init_info": init_info(free_port())})
        assert r.status_code == 400 and "in progress" in r.json()["error"]["message"]
        r = await send(c, group, [("model.norm.weight", torch.full((4,), 3.0))])
        assert r.status_code == 200, "the replacing group carries updates"
        assert (await c.post("/finish_weight_update", json={})).json()["rollq"]["version"] == 1


async def test_a_trainer_that_stops_mid_transfer_times_out_and_completions_go_on(redis_url, queue, tmp_path, model_dir,
                                                                                   make_producer, make_consumer):
    """The trainer sends one chunk of two and goes quiet: the receive ends at the timeout with
    504 naming the setting, nothing is published, and completions are served throughout."""
    cfg = WeightTransferConfig(backend="gloo", root=str(tmp_path / "w"), model=model_dir, timeout=2)
    make_consumer.start(make_consumer(queue, engine=EchoEngine()))
    producer = await make_producer(queue)
    async with served_app(producer, cfg) as c:
        group = await join(c, init_info(free_port(), packed_buffer_size_bytes=130))
        assert (await c.post("/start_weight_update", json={})).status_code == 200
        items = [(n, p.detach()) for n, p in Tiny(4).named_parameters()]
        update = asyncio.create_task(send(c, group, items, buffer=130, upto=1))
        for _ in range(3):  # while the server waits for the rest
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["rollq"]["version_start"] == 0
        r = await update
        assert r.status_code == 504, r.text
        assert "--weight-timeout" in r.json()["error"]["message"] and "init_weight_transfer_engine again" in r.json()["error"]["message"]
        r = await c.post("/finish_weight_update", json={})
        assert r.status_code == 500, "the failed update ended it"
        assert await read_version(producer._client, QueueKeys(queue)) is None
        r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200


TRAINER_DIES = """
import os, sys, torch
from rollq.serve import gloo_trainer
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors
info = {"master_address": "127.0.0.1", "master_port": int(sys.argv[1]), "rank_offset": 1, "world_size": 2}
group = gloo_trainer.trainer_init(info, 0, 30.0)
print("joined", flush=True)
sys.stdin.readline()  # the server is in /update_weights
items = iter([("model.layers.0.proj.weight", torch.ones(8, 4)), ("model.norm.weight", torch.ones(4))])
group.broadcast(pack_tensors(items, lambda it: it[1], 100).packed_tensor, src=0)
os._exit(1)  # dies before the second chunk
"""


async def test_a_trainer_that_dies_mid_transfer_fails_the_update_at_once(redis_url, queue, tmp_path, model_dir,
                                                                         make_producer, make_consumer):
    """The trainer process dies after one chunk of two: the update answers 500 well before the
    timeout, naming the failure; completions are served after it."""
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT

    cfg = WeightTransferConfig(backend="gloo", root=str(tmp_path / "w"), model=model_dir, timeout=60)
    make_consumer.start(make_consumer(queue, engine=EchoEngine()))
    producer = await make_producer(queue)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", TRAINER_DIES, str(port)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        async with served_app(producer, cfg) as c:
            r = await c.post("/init_weight_transfer_engine", json={"init_info": init_info(port, packed_buffer_size_bytes=100)})
            assert r.status_code == 200, r.text
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "joined"
            assert (await c.post("/start_weight_update", json={})).status_code == 200
            items = [("model.layers.0.proj.weight", torch.ones(8, 4)), ("model.norm.weight", torch.ones(4))]
            t0 = time.monotonic()
            update = asyncio.create_task(c.post("/update_weights", json={"update_info": meta(items)}))
            await asyncio.sleep(0.3)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            r = await update
            assert time.monotonic() - t0 < 30
            assert r.status_code == 500 and "receiving the update failed" in r.json()["error"]["message"], r.text
            assert (await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})).status_code == 200
            assert await read_version(producer._client, QueueKeys(queue)) is None
    finally:
        proc.kill()
        proc.wait(10)


# -- without --weight-transfer --------------------------------------------------------------
async def test_without_the_flag_the_routes_answer_as_vllms_without_a_weight_transfer_engine(echo):
    producer, _ = echo
    async with served_app(producer, None) as c:
        info = (await c.get("/server_info", params={"config_format": "json"})).json()
        assert info["vllm_config"]["weight_transfer_config"] is None
        assert (await c.get("/get_world_size")).json() == {"world_size": 1}
        for path, body in [("/init_weight_transfer_engine", {"init_info": init_info(1)}), ("/start_weight_update", {}),
                           ("/update_weights", {"update_info": meta([])}), ("/finish_weight_update", {})]:
            r = await c.post(path, json=body)
            assert r.status_code == 500, path
            err = r.json()["error"]
            assert err["type"] == "InternalServerError" and "Weight transfer not configured" in err["message"]
        with pytest.raises(RuntimeError, match="no weight-transfer engine"):
            client = await asyncio.to_thread(trl_client.VLLMClient, base_url=str(c.base_url), connection_timeout=5)
            await asyncio.to_thread(client.init_communicator, "cuda")


# -- pause, resume, prefix cache --------------------------------------------------------------
async def test_pause_holds_new_requests_until_resume_and_reset_prefix_cache_reaches_replicas(echo, redis_client):
    producer, _ = echo
    async with served_app(producer, None) as c:
        pubsub = redis_client.pubsub()
        await pubsub.subscribe(producer.keys.control)
        assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
        msg = None
        for _ in range(50):
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if msg is not None:
                break
        assert msg is not None and msg["data"] == b"reset-prefix-cache"
        await pubsub.aclose()
        r = await c.post("/pause", params={"mode": "sideways"})
        assert r.status_code == 400
        assert (await c.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await c.get("/is_paused")).json() == {"is_paused": True}
        held = asyncio.create_task(c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}))
        await asyncio.sleep(0.5)
        assert not held.done(), "a request waits while paused"
        assert (await c.post("/resume")).json() == {"status": "resumed"}
        assert (await held).status_code == 200
        assert (await c.get("/is_paused")).json() == {"is_paused": False}
        assert (await c.post("/pause", params={"mode": "wait"})).json() == {"status": "paused"}
        await c.post("/resume")



async def test_pause_abort_cancels_this_servers_jobs_in_flight(make_producer, make_consumer, queue):
    make_consumer.start(make_consumer(queue, engine=EchoEngine(delay_per_token=0.5)))
    producer = await make_producer(queue)
    async with served_app(producer, None) as c:
        slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": [1], "max_tokens": 40, "ignore_eos": True}))
        await until(lambda: len(producer._ledger.handles) == 1, 10, "the job to be submitted")
        await asyncio.sleep(0.3)
        assert (await c.post("/pause", params={"mode": "abort"})).json() == {"status": "paused"}
        r = await asyncio.wait_for(slow, 10)  # 20 s of generation left: cancelled instead
        assert r.status_code >= 400 and "ancel" in r.text, r.text
        await c.post("/resume")


async def test_a_trainer_that_never_joins_times_out(redis_url, queue, tmp_path, model_dir, make_producer):
    cfg = WeightTransferConfig(backend="gloo", root=str(tmp_path / "w"), model=model_dir, timeout=2)
    producer = await make_producer(queue)
    async with served_app(producer, cfg) as c:
        r = await c.post("/init_weight_transfer_engine", json={"init_info": init_info(free_port())})
        assert r.status_code == 504 and "--weight-timeout" in r.json()["error"]["message"], r.text
        assert (await c.get("/v1/models")).status_code == 200
        assert (await c.post("/start_weight_update", json={})).status_code == 200  # no group: updates say so
        r = await c.post("/update_weights", json={"update_info": meta([])})
        assert r.status_code == 500 and "not initialized" in r.json()["error"]["message"]


def test_the_server_needs_torch_only_where_weight_transfer_is_on():
    """``rollq serve`` runs on the dashboard extra alone: its app imports no torch."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = "import sys, rollq.serve.app, rollq.serve.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
