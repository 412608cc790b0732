"""Redis clients (single node or cluster) and the Lua scripts rollq runs on them."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources
from typing import Any, Sequence

import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .settings import RedisSettings

Client = Any  # redis.asyncio.Redis | redis.asyncio.RedisCluster

#: Errors that mean "Redis is unreachable for now": callers back off and retry.
RETRYABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def connect(settings: RedisSettings | str | None = None, **overrides: Any) -> Client:
    """An asyncio Redis client for ``settings`` (binary replies, no decoding).

    Pass ``socket_timeout=None`` for a client used for blocking reads.
    """
    if not isinstance(settings, RedisSettings):
        settings = RedisSettings.from_url(settings)
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    kw: dict[str, Any] = dict(
        # A pooled connection that a Redis restart closed fails on first use: retry on a fresh
        # one (the command never reached the server). See Producer.submit_many on idempotency.
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionResetError],
        socket_connect_timeout=settings.connect_timeout,
        socket_timeout=settings.command_timeout,
        health_check_interval=15,
        socket_keepalive=True,
        decode_responses=False,
    )
    kw["max_connections"] = settings.max_connections
    kw.update(overrides)
    if settings.cluster:
        from redis.asyncio.cluster import RedisCluster

        kw.pop("health_check_interval", None)
        return RedisCluster.from_url(settings.url, **kw)
    return aredis.Redis.from_url(settings.url, **kw)


def _unparsed(response: Any, **_: Any) -> Any:
    return response


def raw_replies(client: Client, *commands: str) -> Client:
    """Make ``client`` return the replies of ``commands`` as Redis sent them (nested lists of
    bytes), skipping redis-py's parsing into dicts. For clients a hot path owns alone: their
    callers must read the raw form (a cluster client may still parse; accept both)."""
    for name in commands:
        client.set_response_callback(name, _unparsed)
    return client


@lru_cache(maxsize=None)
def _source(name: str) -> tuple[str, bytes]:
    text = resources.files("rollq").joinpath("lua", f"{name}.lua").read_text()
    return text, hashlib.sha1(text.encode()).hexdigest().encode()


class Script:
    """A Lua script from ``rollq/lua/``, run with EVALSHA and loaded on NOSCRIPT.

    Works on pipelines too (``await script.queue(pipe, keys, args)`` then ``pipe.execute()``),
    where a missing script is loaded first with SCRIPT LOAD.
    """

    def __init__(self, name: str):
        self.name = name
        self.source, self.sha = _source(name)

    async def __call__(self, client: Client, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)

    async def ensure_loaded(self, client: Client) -> None:
        await client.script_load(self.source)


SUBMIT = Script("submit")
FINISH = Script("finish")
RECLAIM = Script("reclaim")
CANCEL = Script("cancel")
DROP_EMPTY = Script("drop_empty")
PUBLISH_VERSION = Script("publish_version")


async def load_scripts(client: Client) -> None:
    for s in (SUBMIT, FINISH, RECLAIM, CANCEL, DROP_EMPTY, PUBLISH_VERSION):
        await s.ensure_loaded(client)
