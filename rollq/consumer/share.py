"""A replica's share of a burst: how many of the jobs waiting in a stream it reads now.

Replicas pull; no router assigns jobs. A read takes at most ``min(free slots, batch)``
entries, so without a share a burst smaller than one replica's free capacity lands whole on
whichever replica reads first. Each replica therefore advertises its free slots every
heartbeat in the queue's :attr:`~rollq.keys.QueueKeys.free` hash and reads the others' in
the same pipeline (no extra round trip); :class:`Fleet` holds what it read. When peers have
free slots, the puller wakes on a read of one entry, reads how many wait in the stream
(:func:`waiting`), and takes :func:`fair_share` of them: in proportion to its own free slots
against all the live replicas' (its own counted now, the peers' as of their last beat).
Whatever is left after a short yield, it reads again the same way, so another idle replica
takes its share first and a lone busy replica still leaves no job behind.

A replica with no live peer holding free slots (alone, or every peer full) reads as before:
everything it has room for, in one read.

>>> fair_share(64, mine=64, peers=64, most=64)
32
>>> fair_share(64, mine=64, peers=0, most=64)
64
>>> fair_share(3, mine=64, peers=192, most=64)
1

On a sharded queue (:mod:`rollq.shards`) the share is per shard: a replica blocks on its
home shard, so it shares that shard's jobs with the peers of the same home shard (each entry
names its replica's home); the reads of other shards take what they have room for.

>>> f = Fleet("r0")
>>> f.update({b"r0": b"64 1000 0", b"r1": b"32 1000 0", b"r2": b"16 10 0", b"r3": b"8 1000 1"},
...          now_ms=2000, ttl_ms=5000, home=0)
[]
>>> f.peers_free
48
>>> f.update({b"r1": b"32 1000 0", b"r2": b"16 10 0"}, now_ms=9000, ttl_ms=5000, home=0)
['r1', 'r2']
>>> f.peers_free
0
"""

from __future__ import annotations

import math
import time
from typing import Any

from redis.exceptions import ResponseError

from ..keys import GROUP


def fair_share(waiting: int, *, mine: int, peers: int, most: int) -> int:
    """Entries to read of ``waiting``: ``ceil(waiting * mine / (mine + peers))``, at least 1
    and at most ``most`` (the free slots and read size). ``peers``: the free slots of the
    other live replicas."""
    if mine <= 0 or most <= 0:
        return 0
    total = mine + max(0, peers)
    n = math.ceil(max(0, waiting) * mine / total)
    return max(1, min(most, n))


def entry(free: int, now_ms: int | None = None, home: int = 0) -> bytes:
    """This replica's value in the free-slots hash: ``b"<free> <unix ms> <home shard>"``."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return f"{max(0, free)} {now_ms} {home}".encode()


class Fleet:
    """The free slots of the peers of one home shard, as last read from the queue's
    free-slots hash."""

    def __init__(self, me: str) -> None:
        self.me = me
        #: Free slots of the other live replicas of the home shard (entries younger than
        #: the lease TTL).
        self.peers_free = 0

    def update(self, table: dict[Any, Any], *, now_ms: int, ttl_ms: int, home: int = 0) -> list[str]:
        """Take in the hash as read (``HGETALL``), counting the peers whose home shard is
        ``home``; returns the replicas whose entry is older than ``ttl_ms`` (dead or gone:
        the caller deletes them). Malformed entries (anything that can write Redis can
        write the hash) count as stale."""
        total, stale = 0, []
        for k, v in table.items():
            name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
            if name == self.me:
                continue
            try:
                free_s, at_s, home_s = (v.decode() if isinstance(v, bytes) else str(v)).split()
                free, at, their_home = int(free_s), int(at_s), int(home_s)
            except (UnicodeDecodeError, ValueError):
                stale.append(name)
                continue
            if now_ms - at > ttl_ms:
                stale.append(name)
            elif their_home == home:
                total += max(0, free)
        self.peers_free = total
        return stale


async def waiting(client: Any, stream: str) -> int:
    """Entries of ``stream`` not yet delivered to the group: its ``lag`` (``XINFO GROUPS``),
    or where Redis does not know it, ``XLEN`` less the group's pending entries (delivered
    entries are deleted once finished). One round trip; 0 when the stream is missing."""
    pipe = client.pipeline(transaction=False)
    pipe.xinfo_groups(stream)
    pipe.xlen(stream)
    try:
        groups, length = await pipe.execute()
    except ResponseError:
        return 0
    for g in groups:
        name = g.get("name") or g.get(b"name")
        if name in (GROUP, GROUP.encode()):
            lag = g.get("lag", g.get(b"lag"))
            if lag is not None:
                return int(lag)
            return max(0, int(length) - int(g.get("pending", g.get(b"pending")) or 0))
    return int(length)
