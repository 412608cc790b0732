"""A replica's share of a burst: how many of the jobs waiting in a stream it reads now.

Replicas pull; no router assigns jobs. A read takes at most ``min(free slots, batch)``
entries, so without a share a burst smaller than one replica's free capacity lands whole on
whichever replica reads first. Each replica therefore advertises its free slots every
heartbeat in the queue's :attr:`~rollq.keys.QueueKeys.free` hash and reads the others' in
the same pipeline (no extra round trip); :class:`Fleet` holds what it read. When peers have
free slots, the puller wakes on a read of one entry, reads how many entries wait in the
stream and how many are in flight (:func:`waiting`: the group's lag and pending count, one
round trip), and takes :func:`fill_share`: what fills it to the fleet's level, each replica
holding the same fraction of its in-flight cap once the waiting entries are taken (the
pending count is current, so what a peer took a moment ago counts at once; the caps change
slowly, so their figures from the last beat hold). Whatever is left after a short yield, it
reads again the same way, so another idle replica takes its share first; if no peer takes
any for a while, it takes the rest, so a peer that advertises room it no longer has
(busy, stuck, gone) leaves no job behind.

A replica with no live peer holding free slots (alone, or every peer full) reads as before:
everything it has room for, in one read.

>>> fair_share(64, mine=64, peers=64, most=64)
32
>>> fair_share(64, mine=64, peers=0, most=64)
64
>>> fair_share(3, mine=64, peers=192, most=64)
1
>>> fill_share(62, pending=2, mine_inflight=1, mine_cap=64, peers_cap=64, most=63)  # woken with one each
31
>>> fill_share(30, pending=34, mine_inflight=1, mine_cap=64, peers_cap=64, most=63)  # a peer took 33 already
31

On a sharded queue (:mod:`rollq.shards`) the share is per shard: a replica blocks on its
home shard, so it shares that shard's jobs with the peers of the same home shard (each entry
names its replica's home); a read of another shard takes only what that shard's own
replicas have no room for (:attr:`Fleet.free_by_home`; see :mod:`~rollq.consumer._puller`).

>>> f = Fleet("r0")
>>> table = {b"r0": entry(64, 1000, cap=64), b"r1": entry(32, 1000, cap=64), b"r2": entry(16, 10, cap=16),
...          b"r3": entry(8, 1000, home=1, cap=8)}
>>> f.update(table, now_ms=2000, ttl_ms=5000, home=0)
[]
>>> f.peers_free, f.peers_cap, f.free_by_home
(48, 80, {0: 48, 1: 8})
>>> f.update(table, now_ms=6000, ttl_ms=5000, home=0)
['r2']
>>> f.peers_free
32
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
from redis.exceptions import ResponseError

from ..keys import GROUP
from ..protocol import FreeSlots
from ..protocol.replica import read_free_slots

_encode = msgspec.msgpack.Encoder().encode


def fair_share(waiting: int, *, mine: int, peers: int, most: int) -> int:
    """Entries to read of ``waiting``: ``ceil(waiting * mine / (mine + peers))``, at least 1
    and at most ``most`` (the free slots and read size). ``peers``: the free slots of the
    other live replicas."""
    if mine <= 0 or most <= 0:
        return 0
    total = mine + max(0, peers)
    n = math.ceil(max(0, waiting) * mine / total)
    return max(1, min(most, n))


def fill_share(waiting: int, *, pending: int, mine_inflight: int, mine_cap: int, peers_cap: int, most: int) -> int:
    """Entries to read of ``waiting`` so that this replica holds its part, by in-flight cap,
    of everything in flight once they are all taken (``pending``: the entries delivered and
    not yet finished, of every replica): ``ceil((pending + waiting) * mine_cap / (mine_cap +
    peers_cap)) - mine_inflight``, at least 1 and at most ``most``."""
    if most <= 0:
        return 0
    total = max(1, mine_cap + max(0, peers_cap))
    n = math.ceil((max(0, pending) + max(0, waiting)) * mine_cap / total) - max(0, mine_inflight)
    return max(1, min(most, n))


def entry(free: int, now_ms: int | None = None, home: int = 0, cap: int = 0) -> bytes:
    """This replica's value in the free-slots hash: a msgpack :class:`~rollq.protocol.FreeSlots`."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return _encode(FreeSlots(max(0, free), now_ms, home, max(0, cap)))


class Fleet:
    """The free slots of the peers of one home shard, as last read from the queue's
    free-slots hash."""

    def __init__(self, me: str) -> None:
        self.me = me
        #: Free slots of the other live replicas of the home shard (entries younger than
        #: the lease TTL).
        self.peers_free = 0
        #: ... and their in-flight caps.
        self.peers_cap = 0
        #: Free slots of the other live replicas, by their home shard (every shard).
        self.free_by_home: dict[int, int] = {}

    def update(self, table: dict[Any, Any], *, now_ms: int, ttl_ms: int, home: int = 0) -> list[str]:
        """Take in the hash as read (``HGETALL``), counting the peers whose home shard is
        ``home``; returns the replicas whose entry is older than ``ttl_ms`` (dead or gone:
        the caller deletes them). Malformed entries (anything that can write Redis can
        write the hash) count as stale."""
        total, caps, stale = 0, 0, []
        by_home: dict[int, int] = {}
        for name, slots in read_free_slots(table):
            if name == self.me:
                continue
            if slots is None or now_ms - slots.at_ms > ttl_ms:
                stale.append(name)
                continue
            by_home[slots.home] = by_home.get(slots.home, 0) + max(0, slots.free)
            if slots.home == home:
                total += max(0, slots.free)
                caps += max(0, slots.cap)
        self.peers_free, self.peers_cap, self.free_by_home = total, caps, by_home
        return stale


async def waiting(client: Any, stream: str) -> tuple[int, int]:
    """Entries of ``stream`` not yet delivered to the group, and those delivered and not
    finished (the group's pending count). The first is the group's ``lag`` (``XINFO
    GROUPS``), or where Redis does not know it, ``XLEN`` less the pending entries (finished
    entries are deleted). One round trip; (0, 0) when the stream is missing."""
    pipe = client.pipeline(transaction=False)
    pipe.xinfo_groups(stream)
    pipe.xlen(stream)
    try:
        groups, length = await pipe.execute()
    except ResponseError:
        return 0, 0
    for g in groups:
        name = g.get("name") or g.get(b"name")
        if name in (GROUP, GROUP.encode()):
            lag = g.get("lag", g.get(b"lag"))
            pending = int(g.get("pending", g.get(b"pending")) or 0)
            if lag is not None:
                return int(lag), pending
            return max(0, int(length) - pending), pending
    return int(length), 0
