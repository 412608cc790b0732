"""Which replicas of a queue are alive, read from their heartbeat records.

A replica is live while its heartbeat key (``QueueKeys.heartbeat``, a key with a TTL renewed
every heartbeat) exists; its :class:`~rollq.protocol.ReplicaInfo` sits in the registry hash
(``QueueKeys.consumers``). The publisher, the weight sender and the status views ask here
instead of scanning the registry themselves.
"""

from __future__ import annotations

import logging

import msgspec

from .keys import QueueKeys
from .protocol import ReplicaInfo

__all__ = ["live_replicas"]

log = logging.getLogger(__name__)


async def live_replicas(client, keys: QueueKeys) -> dict[str, ReplicaInfo]:
    """The live replicas of ``keys``' queue, ``{replica id: ReplicaInfo}``, in registry order.

    One HGETALL of the registry and one pipelined EXISTS per entry (no SCAN). An entry whose
    record cannot be decoded is logged and left out; an entry without a heartbeat key is dead.
    """
    registry = await client.hgetall(keys.consumers)
    if not registry:
        return {}
    names = [k.decode() if isinstance(k, bytes) else str(k) for k in registry]
    pipe = client.pipeline(transaction=False)
    for n in names:
        pipe.exists(keys.heartbeat(n))
    alive = await pipe.execute()
    out: dict[str, ReplicaInfo] = {}
    for (raw_name, data), n, a in zip(registry.items(), names, alive):
        if not a:
            continue
        try:
            out[n] = msgspec.msgpack.decode(data, type=ReplicaInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("replica %s has an unreadable registry record (%s); counted as not live", n[:128], str(e)[:200])
    return out
