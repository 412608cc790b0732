"""``stream: true`` sends a job's tokens while its replica generates them (rollq/serve/streaming.py).

The echo engine reports its tokens in pieces over the job's delay; every chunk that carries
tokens is checked to arrive while the job still runs in the engine (its running count, not a
timer), and the chunks put together are the non-streamed answer.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rollq.consumer.engine import EchoEngine
from rollq.protocol import ProgressEntry, pack_i32
from rollq.serve.streaming import Choice, Diverged
from tests.serve.conftest import http_server

MODEL = "echo-stream"


class _Letters:
    """A tokenizer stand-in: token ``t`` decodes to one letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        return [ord(ch) % 26 for m in messages for ch in m["content"]]


@pytest.fixture
async def slow(make_producer, make_consumer, queue):
    """An app over an echo engine that takes 20 ms a token; yields (client, engine)."""
    engine = EchoEngine(delay_per_token=0.02)
    make_consumer.start(make_consumer(queue, engine=engine))
    producer = await make_producer(queue)
    # over HTTP: httpx's in-process transport would hand over the body only once it is whole
    async with http_server(producer, model_name=MODEL, tokenizer=_Letters()) as base:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            yield c, engine


async def _events(client: httpx.AsyncClient, route: str, body: dict[str, Any], engine: EchoEngine) -> tuple[list[dict], int]:
    """The stream's events, and how many of those with tokens came while the job ran."""
    events, live = [], 0
    async with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        async for ln in r.aiter_lines():
            if not ln:
                continue
            if ln == "data: [DONE]":
                break
            ev = json.loads(ln[len("data: ") :])
            events.append(ev)
            if any(c.get("token_ids") for c in ev.get("choices", ())) and engine.stats().running:
                live += 1
    return events, live


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
async def test_chunks_arrive_while_the_job_runs_and_add_up_to_the_answer(slow, route):
    client, engine = slow
    if route == "/inference/v1/generate":
        body: dict[str, Any] = {
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 60, "n": 2, "logprobs": 0},
            "output_mode": "text",
            "return_token_ids": True,
        }
    elif route == "/v1/completions":
        body = {"prompt": [1, 2, 3], "max_tokens": 60, "n": 2, "logprobs": 0, "return_token_ids": True}
    else:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "n": 2,
            "logprobs": True,
            "return_token_ids": True,
        }
    plain = (await client.post(route, json=body)).json()
    events, live = await _events(client, route, {**body, "stream": True}, engine)
    assert live >= 2, f"only {live} chunks with tokens came while the job ran"
    choices = [c for e in events for c in e["choices"]]
    for want in plain["choices"]:
        mine = [c for c in choices if c["index"] == want["index"]]
        assert sum((c.get("token_ids") or [] for c in mine), []) == want["token_ids"]
        if route == "/v1/chat/completions":
            text = "".join(c["delta"].get("content") or "" for c in mine)
            assert text == want["message"]["content"]
            lps = [x["logprob"] for c in mine if c["logprobs"] for x in c["logprobs"]["content"]]
            assert lps == [x["logprob"] for x in want["logprobs"]["content"]]
        else:
            assert "".join(c["text"] for c in mine) == want["text"]
        assert mine[-1]["finish_reason"] == want["finish_reason"] and mine[-1]["rollq"]["token_versions"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert [len(c["token_ids"]) for c in plain["choices"]] == [60, 60]


def _piece(delivery: int, offset: int, ids: list[int]) -> ProgressEntry:
    return ProgressEntry(delivery=delivery, sample=0, offset=offset, tokens=pack_i32(ids))


def _dec(ids: list[int]) -> str:
    return _Letters().decode(ids)


def test_a_new_delivery_that_agrees_continues_the_choice():
    c = Choice()
    assert c.piece(_piece(1, 0, [1, 2, 3]), _dec) == ([1, 2, 3], [], "bc")  # the last token's text waits
    assert c.piece(_piece(2, 0, [1, 2]), _dec) is None  # run again: catching up
    assert c.piece(_piece(2, 2, [3, 4]), _dec) == ([4], [], "d")
    assert c.rest([1, 2, 3, 4, 5], [], "bcdef") == ([5], [], "ef")


def test_a_new_delivery_that_differs_is_an_error():
    c = Choice()
    c.piece(_piece(1, 0, [1, 2, 3]), _dec)
    with pytest.raises(Diverged):
        c.piece(_piece(2, 0, [1, 7]), _dec)
    c = Choice()
    c.piece(_piece(1, 0, [1, 2, 3]), _dec)
    with pytest.raises(Diverged):
        c.rest([1, 7, 3, 4], [], "bhde")


def test_a_missed_piece_waits_for_the_result():
    c = Choice()
    c.piece(_piece(1, 0, [1]), _dec)
    assert c.piece(_piece(1, 3, [4]), _dec) is None  # offsets 1..2 were trimmed
    assert c.piece(_piece(1, 4, [5]), _dec) is None
    assert c.rest([1, 2, 3, 4, 5], [], "bcdef") == ([2, 3, 4, 5], [], "bcdef")


async def test_a_redelivered_job_continues_the_stream(queue, redis_url, make_producer, make_consumer, spawn):
    """The replica streaming a job dies; another runs it again (the echo engine: the same
    tokens), and the client gets the rest of them, no error, nothing twice."""
    producer = await make_producer(queue)
    proc = await spawn(redis_url, queue, "doomed", 50.0, lease_ttl=1.0, heartbeat=0.2).ready()
    body = {"prompt": [4, 5, 6], "max_tokens": 80, "return_token_ids": True, "stream": True}
    ids: list[int] = []
    replica = None
    async with http_server(producer, model_name=MODEL) as base, httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for ln in r.aiter_lines():
                if not ln or ln == "data: [DONE]":
                    continue
                ev = json.loads(ln[len("data: ") :])
                assert "error" not in ev, ev
                for c in ev["choices"]:
                    ids += c.get("token_ids") or []
                    replica = c.get("rollq", {}).get("replica") or replica
                if ids and proc.popen.poll() is None:
                    proc.kill()
                    make_consumer.start(make_consumer(queue, EchoEngine(delay_per_token=0.01), consumer_id="survivor"))
    assert proc.popen.poll() is not None and replica == "survivor"
    assert ids == ([4, 5, 6] * 27)[:80]


def test_text_decoded_otherwise_in_pieces_is_no_divergence():
    """The same tokens: what the text adds is sent, however the pieces decoded."""
    c = Choice()
    c.piece(ProgressEntry(delivery=1, sample=0, offset=0, tokens=pack_i32([1, 2]), text="a ."), None)
    assert c.rest([1, 2, 3], [], "a.b") == ([3], [], ".b")
