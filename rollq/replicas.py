"""Which replicas of a queue are alive, read from their heartbeat records.

A replica is live while its heartbeat key (``QueueKeys.heartbeat``, a key with a TTL renewed
every heartbeat) exists; its :class:`~rollq.protocol.ReplicaInfo` sits in the registry hash
(``QueueKeys.consumers``). The reclaimer, the status views, the weight publisher and
:mod:`rollq.torchrl` ask here instead of checking the heartbeat keys themselves.
"""

from __future__ import annotations

import logging

import msgspec

from .connection import text
from .keys import QueueKeys
from .protocol import ReplicaInfo

__all__ = ["heartbeating", "live_replicas"]

log = logging.getLogger(__name__)


async def heartbeating(client, keys: QueueKeys, names: list[str]) -> list[bool]:
    """Whether each of ``names`` has a live heartbeat key now (one pipelined EXISTS per name)."""
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for n in names:
        pipe.exists(keys.heartbeat(n))
    return [bool(a) for a in await pipe.execute()]


async def live_replicas(client, keys: QueueKeys) -> dict[str, ReplicaInfo]:
    """The live replicas of ``keys``' queue, ``{replica id: ReplicaInfo}``, in registry order.

    One HGETALL of the registry and one pipelined EXISTS per entry (no SCAN). An entry whose
    record cannot be decoded is logged and left out; an entry without a heartbeat key is dead.
    """
    registry = await client.hgetall(keys.consumers)
    names = [text(k) for k in registry]
    out: dict[str, ReplicaInfo] = {}
    for data, n, alive in zip(registry.values(), names, await heartbeating(client, keys, names)):
        if not alive:
            continue
        try:
            out[n] = msgspec.msgpack.decode(data, type=ReplicaInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("replica %s has an unreadable registry record (%s); counted as not live", n[:128], str(e)[:200])
    return out
