"""One queue over several streams: which shard a job, a replica or a budget belongs to, and the
queue's record of how many shards it has.

One Redis core serves one hash slot, and every key of a queue shares one slot (rollq/keys.py),
so one queue tops out at what one core does (about 34k-67k jobs/s, benchmarks/README.md). A
queue with ``shards=K`` spreads its jobs over K sub-queues, each a complete set of job keys
under its own tag (``QueueKeys.shard``), which Redis Cluster places on different masters:

- a job with a caller-chosen id goes to ``shard_of_id(id)``, so a resubmission meets the
  first one's record (idempotency is per shard, and every id has one shard); a job with a
  generated id goes round robin; a job targeted at a replica goes to the replica's home shard;
- each replica has a home shard (:func:`home_shard`): it blocks there and reads the other
  shards in turn whenever its home read left slots free, so every shard is drained by every
  replica with room;
- results go to the producer's result stream in the job's shard;
- the staleness bound is split into per-shard budgets (:func:`split_budget`) that add up to
  the queue's, so the bound holds exactly for the whole queue;
- policy versions, weight sync, the replica registry and settings stay in shard 0.

The number of shards is part of the queue: shard 0's config hash holds it (field
``shards``), written once by the first producer or consumer that names it, and every later
one that names a different number is refused (:class:`~rollq.errors.ShardCountMismatch`).
Clients that name none follow the record.

>>> shard_of_id("job-1", 4), shard_of_id("job-1", 4) == shard_of_id("job-1", 4)
(3, True)
>>> split_budget(10, 4)
[3, 3, 2, 2]
>>> home_shard("replica-a", 1)
0
"""

from __future__ import annotations

import zlib
from typing import Any

from .errors import ShardCountMismatch
from .keys import MAX_SHARDS, QueueKeys

#: Field of shard 0's config hash that holds the queue's number of shards.
SHARDS_FIELD = "shards"


def check_shards(k: Any) -> int:
    """A shard count is an int in 1..MAX_SHARDS.

    >>> check_shards(0)
    Traceback (most recent call last):
    ...
    ValueError: invalid shard count 0: use 1-256
    """
    if type(k) is not int or not 1 <= k <= MAX_SHARDS:
        raise ValueError(f"invalid shard count {k!r}: use 1-{MAX_SHARDS}")
    return k


def _hash(name: str) -> int:
    # crc32: the same in every process and language (Python's hash() is salted per process).
    return zlib.crc32(name.encode())


def shard_of_id(job_id: str, k: int) -> int:
    """The shard of a job with a caller-chosen id (the same in every producer)."""
    return _hash(job_id) % k if k > 1 else 0


def home_shard(replica: str, k: int) -> int:
    """A replica's home shard: where it blocks, and where jobs targeted at it go."""
    return _hash(replica) % k if k > 1 else 0


def split_budget(total: int, k: int) -> list[int]:
    """Split ``total`` over ``k`` shards as evenly as integers allow (the first ones get the
    remainder); the parts add up to ``total``."""
    q, r = divmod(total, k)
    return [q + (1 if i < r else 0) for i in range(k)]


async def read_shards(client: Any, keys: QueueKeys) -> int:
    """The queue's number of shards as recorded (1 if none is)."""
    raw = await client.hget(keys.base.config, SHARDS_FIELD)
    return _parse(keys, raw) if raw is not None else 1


async def declare_shards(client: Any, keys: QueueKeys, k: int | None) -> int:
    """Agree on the queue's number of shards: with ``k`` None, follow the record (1 if none);
    else record ``k`` unless a number is recorded, and refuse a different one.

    Raises:
        ShardCountMismatch: the queue is recorded with another number of shards.
    """
    if k is None:
        return await read_shards(client, keys)
    check_shards(k)
    if await client.hsetnx(keys.base.config, SHARDS_FIELD, k):
        return k
    have = await read_shards(client, keys)
    if have != k:
        raise ShardCountMismatch(
            f"queue {keys.queue!r} has {have} shard(s), not {k}: every producer and consumer of a queue "
            f"uses its recorded count (pass shards=None to follow it; a new count needs a new queue)"
        )
    return k


def _parse(keys: QueueKeys, raw: bytes | str) -> int:
    try:
        return check_shards(int(raw))
    except ValueError:
        raise ShardCountMismatch(f"queue {keys.queue!r} records an invalid shard count {raw!r}") from None
