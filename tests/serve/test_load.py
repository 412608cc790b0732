"""``rollq serve`` under load on loopback, over the echo engine: 1,000 concurrent connections
of every route, some of them bad or with session keys, and clients that go away mid-request. Each request gets
its answer or a clear HTTP error; the queue's counters show every job finished exactly once
(or cancelled, for clients that left) and nothing left behind."""

from __future__ import annotations

import asyncio
import json

import httpx

from rollq.consumer.engine import EchoEngine
from rollq.status import queue_status
from tests.helpers import until
from tests.serve.conftest import ECHO_MODEL, http_server

N = 1000


def request_of(i: int) -> tuple[str, dict | bytes, int]:
    """Request ``i``: (route, body, the status it must get)."""
    ids = [i % 500 + 1, 7]
    kind = i % 8
    if kind == 0:
        return "/v1/completions", b'{"prompt": [1, 2', 400  # malformed JSON
    if kind == 1:
        return "/inference/v1/generate", {"token_ids": ids, "sampling_params": {"max_tokens": 0}}, 400
    if kind == 2:
        return "/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404
    if kind == 3:  # OpenAI's `user` field: a session key, each request reads and writes the session map
        return "/v1/completions", {"prompt": ids, "max_tokens": 3, "return_token_ids": True, "user": f"s{i % 97}"}, 200
    if kind == 4:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2,
                                        "user": f"s{i % 89}"}, 200
    if kind == 5:
        return "/inference/v1/generate", {"token_ids": ids, "sampling_params": {"max_tokens": 3, "n": 2}}, 200
    if kind == 6:
        return "/inference/v1/generate", {"token_ids": ids, "stream": True, "sampling_params": {"max_tokens": 3}}, 200
    return "/v1/completions", {"prompt": ids, "max_tokens": 3, "stream": True, "return_token_ids": True}, 200


async def send(c: httpx.AsyncClient, i: int) -> tuple[int, list[dict]]:
    """(status, the response's bodies: one, or the stream's events)."""
    path, body, _ = request_of(i)
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    async with c.stream("POST", path, **kw) as r:
        raw = (await r.aread()).decode()
    if r.headers["content-type"].startswith("text/event-stream"):
        chunks = [ln[len("data: "):] for ln in raw.split("\n\n") if ln.startswith("data: ")]
        assert chunks[-1] == "[DONE]"
        return r.status_code, [json.loads(x) for x in chunks[:-1]]
    return r.status_code, [json.loads(raw)]


def merged(chunks: list[dict]) -> list[dict]:
    """A streamed response's choices: each choice's last chunk, with the token ids of all of
    its chunks (a chunk holds what is new)."""
    out: dict[int, dict] = {}
    for ch in chunks:
        ids = out[ch["index"]]["token_ids"] if ch["index"] in out else []
        out[ch["index"]] = {**ch, "token_ids": ids + (ch.get("token_ids") or [])}
    return list(out.values())


async def test_thousand_concurrent_connections(make_producer, make_consumer, queue, redis_client):
    make_consumer.start(make_consumer(queue, engine=EchoEngine()))
    producer = await make_producer(queue)
    async with http_server(producer, model_name=ECHO_MODEL) as base:
        limits = httpx.Limits(max_connections=N, max_keepalive_connections=0)  # a connection per request
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120) as c:
            got = await asyncio.wait_for(asyncio.gather(*(send(c, i) for i in range(N))), 300)
    job_ids = []
    for i, (status, bodies) in enumerate(got):
        path, body, want = request_of(i)
        assert status == want, (i, bodies)
        if want != 200:
            assert bodies[0]["error"]["code"] == want and bodies[0]["error"]["message"]
            continue
        choices = merged([ch for b in bodies for ch in b["choices"]])
        assert len(choices) == (2 if i % 8 == 5 else 1)
        if isinstance(body, dict) and "token_ids" in body:
            assert choices[0]["token_ids"] == (body["token_ids"] * 2)[:3]  # the echo of this request's own prompt
        if i % 8 in (3, 7):
            assert choices[0]["token_ids"] == (body["prompt"] * 2)[:3]
        job_ids.append(choices[0]["rollq"]["job_id"])
    good = sum(1 for i in range(N) if request_of(i)[2] == 200)
    assert len(set(job_ids)) == len(job_ids) == good  # one job per accepted request, none shared
    st = await queue_status(redis_client, producer.keys)
    assert (st.submitted, st.completed, st.failed, st.dead_lettered) == (good, good, 0, 0)
    assert st.depth == st.in_flight == st.dlq_length == 0
    assert producer.outstanding == 0


async def test_clients_that_leave_under_load_cancel_their_jobs(make_producer, make_consumer, queue, redis_client):
    engine = EchoEngine(delay_per_token=0.25)  # 40 tokens: 10 s a request unless cancelled
    make_consumer.start(make_consumer(queue, engine=engine))
    producer = await make_producer(queue)
    n = 200
    async with http_server(producer, model_name=ECHO_MODEL) as base:
        async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=n), timeout=120) as c:
            async def one(i: int) -> int:
                body = {"token_ids": [i + 1], "stream": i % 4 == 1, "sampling_params": {"max_tokens": 40}}
                async with c.stream("POST", "/inference/v1/generate", json=body) as r:
                    await r.aread()
                    return r.status_code

            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            await until(lambda: engine.stats().running == n, 30, "every job to run")
            for t in tasks[::2]:  # half the clients go away mid-request
                t.cancel()
            kept = await asyncio.wait_for(asyncio.gather(*tasks[1::2]), 60)
        assert kept == [200] * (n // 2)
        await until(lambda: engine.stats().running == 0 and producer.outstanding == 0, 30, "the left jobs to be cancelled")
    st = await queue_status(redis_client, producer.keys)
    stats = {k.decode(): int(v) for k, v in (await redis_client.hgetall(producer.keys.stats)).items()}
    # every job finished once: the kept ones completed, the left ones ended cancelled while
    # running (a cancelled running job finishes with a Cancelled error: counted as failed)
    assert stats == {"submitted": n, "completed": n // 2, "failed": n // 2}
    st = await queue_status(redis_client, producer.keys)
    assert st.depth == st.in_flight == st.dlq_length == st.dead_lettered == 0
