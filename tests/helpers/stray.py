"""Queues with one stray value each, for the tests of the views (``rollq status``, the
dashboard, ``rollq top``): anything that can write Redis can write these."""

from __future__ import annotations

from typing import Any

from rollq.keys import QueueKeys
from rollq.registry import register_queue
from rollq.shards import SHARDS_FIELD

K = 3

#: queue suffix -> (key of the queue's keys, field, value), all on a queue of K shards.
STRAY = {
    "stats": (lambda k: k.shard(2).stats, "submitted", "abc"),
    "bucket": (lambda k: k.latency, "3", "1.5"),
    "version": (lambda k: k.version, "v", "seven"),
    "shards": (lambda k: k.config, SHARDS_FIELD, "three"),
    "registry": (lambda k: k.consumers, "rep-0", b"\xc1 not msgpack"),
}


async def plant(client: Any, prefix: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """A good queue and one queue per stray value of :data:`STRAY`, all registered. Returns
    the good queue's name and ``{bad queue: (key, field)}``."""
    good = f"{prefix}-good"
    bad: dict[str, tuple[str, str]] = {}
    for name in (good, *(f"{prefix}-{s}" for s in STRAY)):
        k = QueueKeys(name)
        await client.hset(k.config, SHARDS_FIELD, K)
        await client.hset(k.stats, "submitted", 4)
        await client.hset(k.shard(2).stats, "submitted", 3)
        await client.hset(k.latency, "3", 7)
        await client.hset(k.version, "v", 2)
        await register_queue(client, name)
    for suffix, (key_of, field, value) in STRAY.items():
        name = f"{prefix}-{suffix}"
        key = key_of(QueueKeys(name))
        await client.hset(key, field, value)
        bad[name] = (key, field)
    return good, bad
