"""Fixtures of the ``rollq serve`` tests: the app over a producer, served by uvicorn on a free
loopback port in the test's own event loop (so that a real HTTP client, the ``openai`` SDK,
talks to it)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import uvicorn

from rollq.serve import create_app


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
