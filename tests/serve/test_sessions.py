"""Sticky sessions of ``rollq serve`` (rollq/serve/sessions.py): real redis-server, real
consumers on echo engines, the app served by uvicorn (its startup opens the session map)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import httpx
import pytest

from rollq.connection import connect
from rollq.consumer.engine import EchoEngine
from rollq.consumer._share import entry
from rollq.keys import QueueKeys
from rollq.serve.sessions import Sessions
from tests.helpers import until
from tests.serve.conftest import http_server

MODEL = "echo-model"


@pytest.fixture
async def sessions(redis_url, queue):
    client = connect(redis_url)
    yield Sessions(client, QueueKeys(queue), margin=8, ttl=60), client
    await client.aclose()


async def test_a_session_sticks_to_its_replica_and_escapes_when_it_is_gone_or_overloaded(sessions, queue):
    s, client = sessions
    keys = QueueKeys(queue)
    now = int(time.time() * 1000)
    await client.hset(keys.free, mapping={"a": entry(60, now, cap=64), "b": entry(64, now, cap=64)})
    assert await s.pick("s1") is None  # a new session goes to the queue
    await s.served("s1", "a")
    assert await s.pick("s1") == "a"  # 4 in flight against 0: within the margin
    await client.hset(keys.free, "a", entry(50, now, cap=64))
    assert await s.pick("s1") is None  # 14 against 0: it escapes
    await client.hset(keys.free, "a", entry(64, now, cap=0))
    assert await s.pick("s1") == "a"  # paused for a weight update: it keeps its sessions
    await client.hset(keys.free, "a", entry(64, now - 60_000, cap=64))
    assert await s.pick("s1") is None  # its entry is older than the lease: gone
    await client.hdel(keys.free, "a")
    assert await s.pick("s1") is None
    assert (s.pinned, s.escaped) == (2, 3)
    assert await client.ttl(keys.session("s1")) > 0  # forgotten after its TTL


async def test_session_keys_of_any_form_make_short_fixed_keys(queue):
    keys = QueueKeys(queue)
    odd = ["x" * 100_000, "\udcff", "a:b:{c}", " "]
    made = {keys.session(k) for k in odd}
    assert len(made) == len(odd) and all(len(k) == len(keys.session("s")) for k in made)


async def _turns(base: str, sessions: int, turns: int, *, header: bool = True) -> dict[str, list[str]]:
    """Run ``sessions`` conversations of ``turns`` requests each, concurrently; the replica of
    each turn, by session."""
    seen: dict[str, list[str]] = defaultdict(list)

    async def one(sid: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            for t in range(turns):
                body = {"model": MODEL, "prompt": [1 + t, 2, 3], "max_tokens": 2}
                if not header:
                    body["user"] = sid
                r = await c.post("/v1/completions", json=body, headers={"X-Session-ID": sid} if header else {})
                assert r.status_code == 200, r.text
                seen[sid].append(r.json()["choices"][0]["rollq"]["replica"])

    await asyncio.wait_for(asyncio.gather(*(one(f"s{i}") for i in range(sessions))), 120)
    return seen


async def _two_replicas(make_consumer, queue):
    cs = [make_consumer(queue, engine=EchoEngine(delay_per_token=0.005), consumer_id=f"r{i}") for i in range(2)]
    for c in cs:
        make_consumer.start(c)
    keys = QueueKeys(queue)
    probe = connect(cs[0].redis_settings)
    try:
        await until(lambda: len(cs) == sum(c.state == "serving" for c in cs), 20, "both replicas running")
        for _ in range(200):  # both have written their free slots
            if len(await probe.hgetall(keys.free)) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await probe.aclose()
    return cs


@pytest.mark.parametrize("header", [True, False], ids=["x-session-id", "user"])
async def test_every_turn_of_a_session_after_the_first_goes_to_its_replica(make_producer, make_consumer, queue, header):
    await _two_replicas(make_consumer, queue)
    producer = await make_producer(queue)
    async with http_server(producer, model_name=MODEL) as base:
        seen = await _turns(base, sessions=8, turns=8, header=header)
    assert all(len(set(r)) == 1 for r in seen.values()), seen
    # the sessions' first turns went through the queue: both replicas served some
    assert len(Counter(r[0] for r in seen.values())) == 2, seen


async def test_the_token_in_generate_route_keeps_sessions_too(make_producer, make_consumer, queue):
    """prime-rl's orchestrator pins a trajectory with X-Session-ID on the generate route."""
    await _two_replicas(make_consumer, queue)
    producer = await make_producer(queue)
    seen: dict[str, list[str]] = defaultdict(list)
    async with http_server(producer, model_name=MODEL) as base, httpx.AsyncClient(base_url=base, timeout=30) as c:
        for turn in range(6):
            for sid in ("a", "b", "c", "d"):
                r = await c.post("/inference/v1/generate", headers={"X-Session-ID": sid},
                                 json={"token_ids": [1 + turn, 2, 3], "sampling_params": {"max_tokens": 2}})
                assert r.status_code == 200, r.text
                seen[sid].append(r.json()["choices"][0]["rollq"]["replica"])
    assert all(len(set(v)) == 1 for v in seen.values()), seen


async def test_the_map_survives_a_restart_of_serve_and_is_shared_by_two_serves(make_producer, make_consumer, queue):
    await _two_replicas(make_consumer, queue)
    p1, p2 = await make_producer(queue), await make_producer(queue)
    async with http_server(p1, model_name=MODEL) as base:
        first = await _turns(base, sessions=6, turns=2)
    async with http_server(p1, model_name=MODEL) as again, http_server(p2, model_name=MODEL) as other:
        later = await _turns(again, sessions=6, turns=2)
        shared = await _turns(other, sessions=6, turns=2)
    for sid, replicas in first.items():
        assert set(later[sid]) == set(shared[sid]) == {replicas[0]}, (sid, first[sid], later[sid], shared[sid])


async def test_without_sessions_the_header_changes_nothing(make_producer, make_consumer, queue, redis_client):
    await _two_replicas(make_consumer, queue)
    producer = await make_producer(queue)
    async with http_server(producer, model_name=MODEL, session_margin=None) as base:
        await _turns(base, sessions=2, turns=2)
    assert not [k async for k in redis_client.scan_iter(match=QueueKeys(queue).session("*").rsplit(":", 1)[0] + ":*")]
