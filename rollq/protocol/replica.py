"""Wire format of what replicas publish: the registry entry, the free slots and the latency
histogram.

Every heartbeat a replica writes a :class:`ReplicaInfo` (msgpack) into the queue's registry
hash (``QueueKeys.consumers``), and adds the latencies of the results it recorded into the
queue's latency hash (``QueueKeys.latency``: bucket index -> count, buckets of
:data:`LATENCY_BUCKETS_MS`). Status views, the dashboard and the trainer read both. Each beat it also writes its
:class:`FreeSlots` into the queue's free-slots hash (``QueueKeys.free``), which its peers read
to take their share of a burst (rollq/consumer/_share.py).

>>> latency_bucket(0.3), latency_bucket(1.0), latency_bucket(1e9) == len(LATENCY_BUCKETS_MS)
(0, 1, True)
"""

from __future__ import annotations

import bisect
from typing import Any, Iterator

import msgspec

__all__ = ["LATENCY_BUCKETS_MS", "FreeSlots", "ReplicaInfo", "latency_bucket", "read_free_slots"]

#: Latency histogram bucket upper bounds, milliseconds (last bucket: +inf).
LATENCY_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000, 120000, 300000)


def latency_bucket(ms: float) -> int:
    """Index of the bucket of :data:`LATENCY_BUCKETS_MS` that holds ``ms`` (upper bounds
    inclusive; ``len(LATENCY_BUCKETS_MS)`` is the +inf bucket)."""
    return bisect.bisect_left(LATENCY_BUCKETS_MS, ms)


class FreeSlots(msgspec.Struct, array_like=True):
    """A replica's free capacity as of its last heartbeat (msgpack, array-like).

    >>> msgspec.msgpack.decode(msgspec.msgpack.encode(FreeSlots(12, 1700000000000, 0, 64)), type=FreeSlots)
    FreeSlots(free=12, at_ms=1700000000000, home=0, cap=64)
    """

    #: Jobs it may take now (0 while paused or stopping).
    free: int
    #: When it wrote this, unix milliseconds.
    at_ms: int
    #: Its home shard (rollq/shards.py): the shard it blocks on.
    home: int = 0
    #: Its in-flight cap (0 while paused or stopping).
    cap: int = 0


_decode_slots = msgspec.msgpack.Decoder(FreeSlots).decode


def read_free_slots(table: dict[Any, Any]) -> Iterator[tuple[str, FreeSlots | None]]:
    """Each entry of the free-slots hash as read (``HGETALL``): the replica's name and its
    :class:`FreeSlots`, or None where the entry is malformed (anything that can write Redis
    can write the hash).

    >>> dict(read_free_slots({b"r0": msgspec.msgpack.encode(FreeSlots(3, 5)), b"r1": b"junk"}))
    {'r0': FreeSlots(free=3, at_ms=5, home=0, cap=0), 'r1': None}
    """
    for k, v in table.items():
        name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        try:
            yield name, _decode_slots(v)
        except (msgspec.DecodeError, TypeError):
            yield name, None


class ReplicaInfo(msgspec.Struct, kw_only=True):
    """What a replica publishes in the registry every heartbeat."""

    id: str
    host: str
    pid: int
    engine: str
    model: str
    device: str
    version: int
    inflight: int
    cap: int
    kv_usage: float | None
    tokens_per_s: float
    completed: int
    failed: int
    started_at: float
    heartbeat_at: float
    state: str  # serving | paused | draining | stopped
    labels: dict[str, str] = {}
    paused_s_total: float = 0.0
    last_update_s: float | None = None  # last weight update: noticed -> serving the new version
    last_pause_s: float | None = None  # last weight update: generation stopped
    updates: int = 0
    #: Devices per replica (vLLM ``tensor_parallel_size``): the workers a weight broadcast reaches.
    tp_size: int = 1
    #: dtype the engine serves the weights in ("" for engines without weights).
    served_dtype: str = ""
    #: dtypes of the served policy version that the engine converts to ``served_dtype``.
    converted_from: list[str] = []
    #: Streamed jobs' progress (:mod:`rollq.consumer._progress`): entries written to Redis,
    #: tokens dropped (buffer full, a swap's thrown-away run, a failed flush), flushes failed.
    progress_sent: int = 0
    progress_dropped: int = 0
    progress_failed: int = 0
