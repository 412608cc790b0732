"""SUBMIT checks what it depends on before it writes: a stray value at one of a shard's keys
fails the call whole, naming the key, and leaves nothing behind (no entry, no recorded id)."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from rollq.keys import QueueKeys
from rollq.shards import shard_of_id

K = 3
BAD = 2


def _ids(n: int, prefix: str) -> list[str]:
    """``n`` caller-chosen job ids that the producer routes to shard ``BAD``."""
    return [j for j in (f"{prefix}{i}" for i in range(20 * n)) if shard_of_id(j, K) == BAD][:n]


async def test_a_counter_that_is_not_an_integer_fails_the_call_before_its_jobs_are_added(
        queue, make_producer, redis_client):
    """Used to: the script raised at HINCRBY after its XADDs, so the jobs ran with no handle."""
    shard = QueueKeys(queue).shard(BAD)
    p = await make_producer(queue, shards=K)
    await redis_client.hset(shard.stats, "submitted", "abc")
    ids = _ids(5, "a")
    with pytest.raises(ResponseError) as err:
        await p.submit_many([{"prompt_token_ids": [1], "id": j} for j in ids])
    assert await redis_client.xlen(shard.jobs) == 0
    assert await redis_client.hlen(shard.ids) == 0
    assert f"{shard.stats} field submitted holds \"abc\", not an integer" in str(err.value)
    assert p.outstanding == 0  # no handle is owed for a job that is not queued
    # Repaired, the same ids go in (none was recorded as queued).
    await redis_client.hset(shard.stats, "submitted", 0)
    hs = await p.submit_many([{"prompt_token_ids": [1], "id": j} for j in ids])
    assert [h.id for h in hs] == ids and await redis_client.xlen(shard.jobs) == len(ids)
    assert p.counters["duplicates"] == 0


async def test_a_string_at_the_job_stream_leaves_no_recorded_id(queue, make_producer, redis_client):
    """Used to: HSETNX recorded the id, then XADD met WRONGTYPE; once the key was repaired the
    id was skipped as queued, and its job was never run."""
    shard = QueueKeys(queue).shard(BAD)
    p = await make_producer(queue, shards=K)
    await redis_client.set(shard.jobs, b"garbage")
    ids = _ids(3, "b")
    with pytest.raises(ResponseError) as err:
        await p.submit_many([{"prompt_token_ids": [1], "id": j} for j in ids])
    assert await redis_client.hlen(shard.ids) == 0
    assert f"{shard.jobs} holds a string, not a stream" in str(err.value)
    await redis_client.delete(shard.jobs)
    hs = await p.submit_many([{"prompt_token_ids": [1], "id": j} for j in ids])
    assert await redis_client.xlen(shard.jobs) == len(ids) and p.counters["duplicates"] == 0
    assert all(h._entry is not None for h in hs)
