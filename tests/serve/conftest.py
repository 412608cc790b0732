"""Fixtures of the ``rollq serve`` tests: the app over a producer, served by uvicorn on a free
loopback port in the test's own event loop (so that a real HTTP client, the ``openai`` SDK,
talks to it), and an httpx client of the app over an echo-engine consumer."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import httpx
import pytest
import uvicorn

from rollq.consumer.engine import EchoEngine
from rollq.serve import create_app

#: The model name the echo app serves.
ECHO_MODEL = "echo-model"
#: The echo app's API key and body bound.
ECHO_KEY, ECHO_MAX_BODY = "sk-test", 4096


@pytest.fixture
async def echo(make_producer, make_consumer, queue):
    """A producer of ``queue`` and the echo engine of the consumer serving it."""
    engine = EchoEngine()
    c = make_consumer(queue, engine=engine)
    make_consumer.start(c)
    return await make_producer(queue), engine


@pytest.fixture
async def client(echo):
    """An httpx client of the app over :func:`echo` (in process, API key sent)."""
    producer, _ = echo
    app = create_app(producer, model_name=ECHO_MODEL, api_key=ECHO_KEY, max_body_bytes=ECHO_MAX_BODY,
                     own_producer=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"Authorization": f"Bearer {ECHO_KEY}"}, timeout=30) as c:
        yield c


@contextlib.asynccontextmanager
async def http_server(producer: Any, **app_kwargs: Any) -> AsyncIterator[str]:
    """``rollq serve``'s app over ``producer`` on 127.0.0.1 (free port): yields its base URL."""
    app = create_app(producer, own_producer=False, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


def validate_as_vllm(name: str, body: Any) -> None:
    """Validate ``body`` with vLLM's own pydantic model ``name`` of the token-in generate route
    (``vllm.entrypoints.scale_out.token_in_token_out.protocol``), where the installed vLLM has
    it. rollq's route follows vLLM 0.32's models; vLLM 0.26 (the GPU lane's) has the module with
    older ones, and there the test's other assertions still run."""
    try:
        import vllm.entrypoints.scale_out.token_in_token_out.protocol as proto
    except ImportError:
        return
    model = getattr(proto, name, None)
    if model is not None:
        model.model_validate(body)
