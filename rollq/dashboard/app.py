"""The web dashboard: a page, a JSON API and ``/metrics``, all served from the sampler's memory.

    GET  /                                  the page (rollq/dashboard/static/, nothing from a CDN)
    GET  /api/queues                        the watched queues (--queue, else every queue in use), headlines
    GET  /api/queues/{queue}[?since=T]      one document, every section; history newer than T
    GET  /metrics                           Prometheus text format
    GET  /healthz                           200 while every queue's last sample succeeded
    POST /api/queues/{queue}/dlq/requeue    the one write: needs ``Authorization: Bearer TOKEN``

Requests never reach Redis (the requeue excepted): the sampler task reads Redis once per
interval for every viewer. Every method but GET/HEAD/OPTIONS passes :class:`WriteGuard`, so a
write endpoint added later is guarded without a line of its own.
"""

from __future__ import annotations

import hmac
import json
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from redis.exceptions import ResponseError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ..keys import QueueKeys
from ..status import dlq_requeue
from . import DEFAULT_PORT, ENV_TOKEN
from .metrics import CONTENT_TYPE, make_registry, render
from .sampler import Sampler

STATIC = Path(__file__).parent / "static"

_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class WriteGuard:
    """Refuses every non-read request without ``Authorization: Bearer <token>``.

    No token configured: writes are disabled (403). Missing or wrong token: 401.
    """

    def __init__(self, app: ASGIApp, token: str | None):
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _READ_METHODS:
            await self.app(scope, receive, send)
            return
        if self.token is None:
            resp: Response = _error(403, f"writes are disabled: start the dashboard with --token or ${ENV_TOKEN}")
        else:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token):
                await self.app(scope, receive, send)
                return
            resp = _error(401, "missing or wrong bearer token")
            resp.headers["WWW-Authenticate"] = 'Bearer realm="rollq"'
        await resp(scope, receive, send)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(sampler: Sampler, *, token: str | None = None) -> Starlette:
    """The dashboard app over ``sampler``; its lifespan runs the sampler's loop and closes it.

    ``token``: the bearer token writes need (None: writes are refused). The routes are small
    closures over ``sampler`` and ``token``, defined here together so the whole HTTP surface
    and its write guard read in one place (hence the length).
    """
    registry = make_registry(sampler)

    def known(request: Request) -> str:
        queue = request.path_params["queue"]
        if queue not in sampler:
            raise _NotWatched(queue)
        return queue

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=_PAGE_HEADERS)

    async def queues(request: Request) -> Response:
        return JSONResponse({
            "queues": [sampler.summary(q) for q in sampler.queues],
            "interval_s": sampler.settings.interval, "history_s": sampler.settings.history,
        })

    async def queue(request: Request) -> Response:
        q = known(request)
        since = request.query_params.get("since")
        try:
            since_t = float(since) if since else None
        except ValueError:
            return _error(400, f"since must be a UNIX time in seconds, not {since!r}")
        return JSONResponse(sampler.document(q, since=since_t))

    async def requeue(request: Request) -> Response:
        q = known(request)
        body = await request.body()
        try:
            spec = json.loads(body) if body.strip() else {}
            ids = spec.get("entry_ids")
            if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
                raise ValueError
        except (ValueError, AttributeError):
            return _error(400, 'body must be empty (requeue all) or {"entry_ids": ["<dead letter ref>", ...]} '
                               '(a dead letter\'s "ref": its entry id, "SHARD/ENTRY" in a sharded queue)')
        try:
            n, skipped = await dlq_requeue(await sampler.client(), QueueKeys(q), ids)
        except (ResponseError, ValueError) as e:  # not a stream entry id, a shard the queue lacks
            return _error(400, f"requeue refused: {e}")
        await sampler.sample(q)  # the next view shows it
        return JSONResponse({"requeued": n, "skipped": skipped})

    async def metrics(request: Request) -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE)

    async def healthz(request: Request) -> Response:
        infos = {q: sampler.sampler_info(q) for q in sampler.queues}
        ok = all(i["ok"] for i in infos.values())
        return JSONResponse({"ok": ok, "queues": infos}, status_code=200 if ok else 503)

    async def not_watched(request: Request, exc: Exception) -> Response:
        return _error(404, f"queue {exc.args[0]!r} is not watched by this dashboard (--queue)")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await sampler.open()
        await sampler.discover()  # the first page load lists the queues in use
        sampler.start()
        try:
            yield
        finally:
            await sampler.close()

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/queues", queues),
            Route("/api/queues/{queue}", queue),
            Route("/api/queues/{queue}/dlq/requeue", requeue, methods=["POST"]),
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=[Middleware(WriteGuard, token=token)],
        exception_handlers={_NotWatched: not_watched},
        lifespan=lifespan,
    )


class _NotWatched(Exception):
    """A queue the dashboard was not asked to watch (404)."""


def resolve_token(token: str | None) -> str | None:
    """``--token``, else ``$ROLLQ_DASHBOARD_TOKEN``, else None (writes disabled)."""
    return token or os.environ.get(ENV_TOKEN) or None


def make_server(app: Any, host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_level: str = "warning") -> Any:
    """A uvicorn server for ``app`` (``await server.serve()``; ``server.should_exit = True``)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on")
    return uvicorn.Server(config)
