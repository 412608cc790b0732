"""Redis clients (single node or cluster) and the Lua scripts rollq runs on them."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from functools import lru_cache
from importlib import resources
from typing import Any, Sequence

import redis
import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .pools import WaitingCluster, WaitingConnectionPool
from .settings import RedisSettings

Client = Any  # redis.asyncio.Redis | redis.asyncio.RedisCluster

_REDIS_PY_VERSION = getattr(redis, "__version__", "99.99.99")

#: Errors that mean "Redis is unreachable for now": callers back off and retry.
RETRYABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def text(v: Any) -> str:
    """A Redis reply (bytes here: clients do not decode) or any value, as text.

    >>> text(b"r0"), text("r0"), text(3)
    ('r0', 'r0', '3')
    """
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def connect(settings: RedisSettings | str | None = None, **overrides: Any) -> Client:
    """An asyncio Redis client for ``settings`` (binary replies, no decoding).

    Pass ``socket_timeout=None`` for a client used for blocking reads. More commands at once
    than ``max_connections`` wait for a free connection (:mod:`rollq.pools`).
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
        if not hasattr(WaitingCluster, "pubsub"):  # replicas follow cancels and versions on pub/sub
            import redis

            raise RuntimeError(
                f"Redis Cluster needs redis-py >= 8.0 (asyncio cluster pub/sub); this is {redis.__version__}"
            )

        kw.pop("health_check_interval", None)
        return WaitingCluster.from_url(settings.url, pool_timeout=settings.pool_timeout, **kw)
    # The version redis-py reports with CLIENT SETINFO: given, it is not looked up in the
    # package metadata for every new connection (milliseconds each).
    kw.setdefault("lib_version", _REDIS_PY_VERSION)
    pool = WaitingConnectionPool.from_url(settings.url, pool_timeout=settings.pool_timeout, **kw)
    pool.connection_class = _auth_fails_fast(pool.connection_class)
    client = aredis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # closed with the client, as from_url's pool is
    return client


@lru_cache(maxsize=None)
def _auth_fails_fast(base: type) -> type:
    """``base`` (redis-py's connection class the URL chose: TCP, TLS or unix socket) whose
    handshake raises :class:`~rollq.errors.RedisAuthError` when Redis refuses the credentials,
    and :class:`~rollq.errors.RedisTLSError` when its TLS certificate fails the check.

    redis-py reports a wrong password as ``AuthenticationError``, a kind of
    ``ConnectionError``, which every retry loop here (and redis-py's own retry) takes for an
    outage and retries forever."""
    from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError

    from .errors import RedisAuthError, RedisTLSError

    class FailFastAuth(base):  # type: ignore[misc, valid-type]
        async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
            try:
                await super().connect_check_health(*args, **kwargs)
            except RedisConnectionError as e:
                # redis-py reports a certificate that fails the check as a ConnectionError
                # raised while handling the ssl error: an outage to every retry loop.
                cert = e.__cause__ or e.__context__
                if not isinstance(cert, ssl.SSLCertVerificationError):
                    raise
                where = f"Redis at {self.host}:{self.port}" if hasattr(self, "host") else "Redis"
                raise RedisTLSError(
                    f"{where}: TLS certificate check failed: {cert.verify_message or cert} (check ssl_ca_certs "
                    "and the server's certificate and host name; ssl_cert_reqs=none turns the check off)"
                ) from None

        async def on_connect_check_health(self, *args: Any, **kwargs: Any) -> None:
            try:
                await super().on_connect_check_health(*args, **kwargs)
            except (AuthenticationError, AuthorizationError, NoPermissionError) as e:
                await self.disconnect()
                user = self.username or "default"
                raise RedisAuthError(
                    f"Redis at {self.host}:{self.port} refused user {user!r}: {e} "
                    "(check the password in the URL, $ROLLQ_REDIS_URL or --url-file)"
                    if hasattr(self, "host") else f"Redis refused user {user!r}: {e}"
                ) from None

    FailFastAuth.__name__ = FailFastAuth.__qualname__ = f"FailFastAuth{base.__name__}"
    return FailFastAuth


class deadline:
    """``async with deadline(seconds, what):`` bounds the Redis calls inside (None: unbounded).

    For clients made with ``socket_timeout=None`` on hot paths: redis-py bounds every send of a
    client with a socket timeout by ``asyncio.wait_for``, which on Python 3.11 runs each send
    as a task of its own (several event-loop turns per command); ``asyncio.timeout`` costs one
    timer. A call that runs out of time raises redis' ``TimeoutError`` (one of
    :data:`RETRYABLE`) saying what took too long; redis-py drops the connection it was using.
    """

    __slots__ = ("_seconds", "_what", "_cm")

    def __init__(self, seconds: float | None, what: str):
        self._seconds = seconds
        self._what = what

    async def __aenter__(self) -> None:
        self._cm = asyncio.timeout(self._seconds)
        await self._cm.__aenter__()

    async def __aexit__(self, et: Any, e: Any, tb: Any) -> bool | None:
        try:
            return await self._cm.__aexit__(et, e, tb)
        except TimeoutError as err:
            raise RedisTimeoutError(
                f"{self._what} took longer than {self._seconds}s (RedisSettings.command_timeout)"
            ) from err


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
RECORD_SHARDS = Script("record_shards")
SET_BOUND = Script("set_bound")


async def load_scripts(client: Client) -> None:
    for s in (SUBMIT, FINISH, RECLAIM, CANCEL, DROP_EMPTY, PUBLISH_VERSION, RECORD_SHARDS, SET_BOUND):
        await s.ensure_loaded(client)
