"""Bucketed gathering of DTensor-sharded state: 2 gloo ranks, each holding half of each tensor."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollq.weightsync.sharded import iter_full_buckets, plan_buckets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
