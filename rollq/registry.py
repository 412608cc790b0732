"""The registry of queue names in use, so that ``rollq status`` and the dashboard list every
queue without a scan.

Producers register their queue when they connect, consumers when they start and again at
every heartbeat: ``ZADD rollq:queues <now> <queue>`` (:data:`~rollq.keys.QUEUES`). The
registrations at connect and start also drop the names nobody registered within
:data:`QUEUE_WINDOW`, so the views only read.

>>> async def main(client):                                         # doctest: +SKIP
...     await register_queue(client, "grpo")
...     print(await queues_in_use(client))                            # ['grpo']
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from .connection import Client
from .keys import QUEUES, QueueKeys, check_name
from .protocol import short
from .settings import DEFAULT_QUEUE

log = logging.getLogger(__name__)

#: Seconds a queue stays listed after its last registration (producer connect, consumer
#: heartbeat); registrations prune names older than this.
QUEUE_WINDOW = 7 * 24 * 3600.0
#: Most names one read returns, the most recently registered first (a deployment has a few).
MAX_QUEUES = 1000


def add_registration(pipe: Any, queue: str, *, prune: bool = True, now: float | None = None) -> None:
    """Queue the registration of ``queue`` on ``pipe`` (a pipeline, non-transactional: on
    Redis Cluster the registry lives on a node of its own): ``ZADD``, and with ``prune`` the
    ``ZREMRANGEBYSCORE`` of names older than :data:`QUEUE_WINDOW`."""
    now = time.time() if now is None else now
    pipe.zadd(QUEUES, {queue: now})
    if prune:
        pipe.zremrangebyscore(QUEUES, "-inf", f"({now - QUEUE_WINDOW!r}")


async def register_queue(client: Client, queue: str) -> bool:
    """Register ``queue`` and prune stale names, in one round trip.

    Returns False if Redis refused it (an ACL user limited to its queue's keys): the queue
    works as before, only the views that list every queue miss it. Connection errors raise.
    """
    pipe = client.pipeline(transaction=False)
    add_registration(pipe, queue)
    try:
        await pipe.execute()
    except ResponseError as e:
        log.warning("queue %r not registered, so `rollq status` and the dashboard list it only with "
                    "--queue: Redis refused %s: %s", queue, QUEUES, short(str(e), 200))
        return False
    return True


async def known_queues(client: Client, *, within: float = QUEUE_WINDOW) -> list[str]:
    """Names registered within the last ``within`` seconds, sorted. Read-only.

    Anything that can write Redis can write the registry: names that are not valid queue
    names are skipped.
    """
    raw = await client.zrevrangebyscore(QUEUES, "+inf", time.time() - within, start=0, num=MAX_QUEUES)
    names = set()
    for n in raw:
        try:
            names.add(check_name("queue", n.decode() if isinstance(n, bytes) else n))
        except (UnicodeDecodeError, ValueError):
            log.debug("skipping an invalid queue name in %s: %s", QUEUES, short(n, 80))
    return sorted(names)


async def queues_in_use(client: Client, *, within: float = QUEUE_WINDOW) -> list[str]:
    """:func:`known_queues`, plus ``default`` if it holds data (it may have been used by a
    rollq that did not register); just ``["default"]`` when nothing is known at all.
    Read-only: at most two commands."""
    names = await known_queues(client, within=within)
    if DEFAULT_QUEUE not in names:
        k = QueueKeys(DEFAULT_QUEUE)
        if not names or await client.exists(k.jobs, k.stats, k.consumers, k.dlq):
            names = sorted([*names, DEFAULT_QUEUE])
    return names
