"""Which connections Redis holds blocked in a command now: a test waits for a read to be
in flight (a consumer blocked on its stream, a reader's XREAD sent) instead of sleeping."""

from __future__ import annotations

import asyncio
from typing import Any, Iterable


async def blocked_in(admin: Any, command: str) -> set[str]:
    """``ip:port`` (``CLIENT LIST``'s ``addr``) of every client blocked in ``command`` now."""
    return {c["addr"] for c in await admin.client_list() if c.get("cmd") == command and "b" in c.get("flags", "")}


def addrs_of(client: Any) -> set[str]:
    """``ip:port`` of the open connections of a redis-py asyncio ``client``, as Redis sees them."""
    pool = client.connection_pool
    return addrs_of_writers(getattr(c, "_writer", None) for c in [*pool._in_use_connections, *pool._available_connections])


def addrs_of_writers(writers: Iterable[asyncio.StreamWriter | None]) -> set[str]:
    """``ip:port`` of the local end of each open stream (a proxy's upstream connections)."""
    out = set()
    for w in writers:
        if w is not None and not w.is_closing():
            host, port = w.get_extra_info("sockname")[:2]
            out.add(f"{host}:{port}")
    return out
