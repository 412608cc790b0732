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

A queue that ran with no record (one shard) grows when a count is first recorded. Clients
connected before the growth still count one shard: shard 0's SUBMIT calls and staleness bound
writes check the count they carry against the record and refuse a different one, and the
client reads the record and routes again. Caller-chosen ids queued before the growth keep
their record in shard 0 (field ``grown``, :func:`grew`): until none is left, a producer asks
shard 0 about such an id (a check call) before it enqueues it in its shard under the new
count.

>>> shard_of_id("job-1", 4), shard_of_id("job-1", 4) == shard_of_id("job-1", 4)
(3, True)
>>> split_budget(10, 4)
[3, 3, 2, 2]
>>> home_shard("replica-a", 1)
0

:class:`ShardMap` is the layout of one queue over its shards, used by producers and replicas
alike: the keys of each shard, and the shard that a key name, a job id or a replica belongs to.
"""

from __future__ import annotations

import zlib
from typing import Any, Iterator, Sequence, overload

from .connection import RECORD_SHARDS
from .errors import ShardCountMismatch
from .keys import MAX_SHARDS, QueueKeys, tag_of

#: Field of shard 0's config hash that holds the queue's number of shards.
SHARDS_FIELD = "shards"
#: Field of shard 0's config hash set when the queue grew from one shard while shard 0 held
#: caller-chosen ids (rollq/lua/record_shards.lua); removed once none is left there.
GROWN_FIELD = "grown"


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


class ShardMap(Sequence[QueueKeys]):
    """The layout of queue ``keys.queue`` over ``count`` shards: the keys of each (index =
    shard number), and where a key name, a job id, a replica or a budget belongs.

    >>> m = ShardMap(QueueKeys("grpo"), 4)
    >>> len(m), m[2].jobs, m.of_key(m[2].results("p1")) is m[2]
    (4, 'rollq:{grpo~2}:jobs', True)
    >>> m.of_id("job-1").shard_index == shard_of_id("job-1", 4), m.home("replica-a") is m[home_shard("replica-a", 4)]
    (True, True)
    >>> m.of_key("rollq:{other}:jobs")
    Traceback (most recent call last):
    ...
    KeyError: "'rollq:{other}:jobs' is in no shard of queue 'grpo' (4 shards)"
    """

    __slots__ = ("base", "size", "_shards", "_by_tag")

    def __init__(self, keys: QueueKeys, count: int) -> None:
        #: Shard 0's keys: the queue-wide ones (versions, weight sync, registry, config).
        self.base = keys.base
        self.size = check_shards(count)
        self._shards = self.base.shards(count)
        self._by_tag = {s.tag: s for s in self._shards}

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, i: int) -> QueueKeys: ...
    @overload
    def __getitem__(self, i: slice) -> list[QueueKeys]: ...
    def __getitem__(self, i: int | slice) -> QueueKeys | list[QueueKeys]:
        return self._shards[i]

    def __iter__(self) -> Iterator[QueueKeys]:
        return iter(self._shards)

    def __repr__(self) -> str:
        return f"ShardMap({self.base.queue!r}, {self.size})"

    def of_key(self, key: str) -> QueueKeys:
        """The keys of the shard that ``key`` (any key name of this queue: a stream, a result
        stream, a call record) belongs to, by its hash tag (:func:`rollq.keys.tag_of`).

        Raises:
            KeyError: ``key`` belongs to no shard of this queue under this count.
        """
        try:
            return self._by_tag[tag_of(key)]
        except (KeyError, ValueError):
            raise KeyError(f"{key[:200]!r} is in no shard of queue {self.base.queue!r} ({self.size} shards)") from None

    def of_id(self, job_id: str) -> QueueKeys:
        """The shard of a job with a caller-chosen id (:func:`shard_of_id`)."""
        return self._shards[shard_of_id(job_id, self.size)]

    def home(self, replica: str) -> QueueKeys:
        """A replica's home shard (:func:`home_shard`)."""
        return self._shards[home_shard(replica, self.size)]

    def split(self, total: int) -> list[int]:
        """``total`` (a staleness bound's ``batch``) split over the shards (:func:`split_budget`)."""
        return split_budget(total, self.size)


async def read_shards(client: Any, keys: QueueKeys) -> int:
    """The queue's number of shards as recorded (1 if none is)."""
    raw = await client.hget(keys.base.config, SHARDS_FIELD)
    return _parse(keys, raw) if raw is not None else 1


async def declare_shards(client: Any, keys: QueueKeys, k: int | None) -> int:
    """Agree on the queue's number of shards: with ``k`` None, follow the record (1 if none);
    else record ``k`` unless a number is recorded, and refuse a different one. Recording
    ``k`` > 1 for a queue that ran unsharded carries its version and staleness bound over to
    the new shards (:func:`_carry_over`); replicas that follow the record take the new shards
    up within ``rollq.consumer._lease.SHARD_RECORD_INTERVAL``.

    Raises:
        ShardCountMismatch: the queue is recorded with another number of shards.
        ValueError: ``k`` is not a valid count, or exceeds the staleness bound's ``batch``.
    """
    if k is None:
        return await read_shards(client, keys)
    check_shards(k)
    base = keys.base
    max_lag, batch, recorded = await client.hmget(base.config, "max_lag", "batch", SHARDS_FIELD)
    if recorded is not None:
        return _agree(keys, _parse(keys, recorded), k)
    bound = [max_lag, batch] if k > 1 else [None, None]
    if bound[1] is not None and int(bound[1]) < k:
        raise ValueError(
            f"queue {keys.queue!r} has a staleness bound of batch={int(bound[1])}, fewer jobs than {k} shards "
            "(each shard's budget is a part of batch, at least 1 job): set a larger batch first"
        )
    recorded_now, have = await RECORD_SHARDS(client, [base.config, base.ids], [k])
    if recorded_now:
        if k > 1:
            await _carry_over(client, keys, k, bound)
        return k
    return _agree(keys, _parse(keys, have), k)


async def grew(client: Any, keys: QueueKeys) -> bool:
    """Whether the queue grew from one shard with caller-chosen ids left in shard 0's record
    (:data:`GROWN_FIELD`): a producer checks shard 0 for such an id before it enqueues it in
    its shard under the new count, so each id stays queued once across the growth."""
    return bool(await client.hexists(keys.base.config, GROWN_FIELD))


def _agree(keys: QueueKeys, have: int, k: int) -> int:
    if have != k:
        raise ShardCountMismatch(
            f"queue {keys.queue!r} has {have} shard(s), not {k}: every producer and consumer of a queue "
            f"uses its recorded count (pass shards=None to follow it; a new count needs a new queue)"
        )
    return k


async def _carry_over(client: Any, keys: QueueKeys, k: int, bound: list[Any]) -> None:
    """A queue that ran unsharded now has ``k`` shards: carry its state over to shards 1..k-1.

    - the current policy version is mirrored into every shard (their SUBMIT calls read it);
    - a staleness bound is split (:func:`split_budget`), and what shard 0 admitted beyond its
      new part is charged to the other shards' counters, so the queue's total stays within
      the bound it had (the jobs admitted before were all counted in shard 0).

    Grow a queue while its producers are idle: a submission admitted in shard 0 between the
    read of its counter here and the new budget can exceed the bound by that submission."""
    from .weightsync.versions import mirror_version  # weight sync builds on the queue's keys

    base = keys.base
    shards = keys.shards(k)
    raw_v = await client.hget(base.version, "v")
    version = int(raw_v) if raw_v is not None else 0
    if version:
        await mirror_version(client, keys, version, k)
    if bound[1] is None:
        return
    max_lag, parts = int(bound[0] or 0), split_budget(int(bound[1]), k)
    limits = [(max_lag + version + 1) * part for part in parts]
    excess = max(0, int(await client.hget(base.admission, "admitted") or 0) - limits[0])
    await client.hset(base.config, "batch", parts[0])
    for shard, part, limit in zip(shards[1:], parts[1:], limits[1:]):
        charge = min(limit, excess)
        excess -= charge
        await client.hset(shard.config, mapping={"max_lag": max_lag, "batch": part})
        if charge:
            await client.hincrby(shard.admission, "admitted", charge)


def _parse(keys: QueueKeys, raw: bytes | str) -> int:
    try:
        return check_shards(int(raw))
    except ValueError:
        raise ShardCountMismatch(f"queue {keys.queue!r} records an invalid shard count {raw!r}") from None
