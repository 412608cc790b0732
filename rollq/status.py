"""Read-only views of a queue (CLI ``status``, dashboards) and dead-letter administration.

Every view costs a bounded number of commands: no KEYS, no SCAN over job data. Reading never
changes anything; only :func:`dlq_requeue` and :func:`dlq_purge` write.

A sharded queue (rollq/shards.py) is shown as one queue: depth, in flight, counters and dead
letters are summed over its shards, with the depth of each shard beside the sum so an operator
sees an imbalance. A queue of one shard costs what it did before sharding existed, plus the
read of the recorded shard count (one ``HGET``) when the caller does not pass it.

>>> async def show(client):                                    # doctest: +SKIP
...     st = await queue_status(client, QueueKeys("grpo"))
...     print(st.depth, st.in_flight, [r.id for r in st.replicas])
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import msgspec
from redis.exceptions import ResponseError

from .connection import SUBMIT, Client, text
from .errors import BadQueueData, ShardCountMismatch
from .keys import FIELD, GROUP, QueueKeys
from .protocol import LATENCY_BUCKETS_MS, DeadLetter, ReplicaInfo, decode_dead_letter, decode_job, encode_job, short
from .replicas import heartbeating
from .shards import SHARDS_FIELD, check_shards, home_shard, read_shards

_FIELD = FIELD.encode()


@dataclass
class ReplicaView:
    """A replica as the registry shows it, plus whether its lease is live."""

    id: str
    alive: bool
    heartbeat_age_s: float
    info: dict[str, Any]


@dataclass
class QueueStatus:
    queue: str
    depth: int  # waiting, not yet delivered to any replica (shared + targeted streams)
    in_flight: int  # delivered, not yet finished
    oldest_waiting_s: float | None
    submitted: int
    completed: int
    failed: int
    dead_lettered: int
    dlq_length: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    version: int | None
    replicas: list[ReplicaView] = field(default_factory=list)
    at: float = field(default_factory=time.time)
    #: Shards of the queue (its recorded count; 1 if none is recorded).
    shards: int = 1
    #: Waiting and in-flight jobs of each shard (index = shard; targeted streams count in the
    #: replica's home shard); they add up to ``depth`` and ``in_flight``.
    shard_depth: list[int] = field(default_factory=list)
    shard_in_flight: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def _number(v: Any, key: str, field: Any) -> int:
    """``v``, a value rollq keeps as an integer at ``key`` (``field`` of a hash), as an int.

    Raises:
        BadQueueData: it is not an integer (anything can write Redis).
    """
    try:
        return int(v)
    except (TypeError, ValueError):
        name = text(field) if isinstance(field, bytes) else field
        raise BadQueueData(
            f"key {key!r} field {short(name, 60)!r} holds {short(text(v), 60)!r}, not an integer",
            key=key, field=name,
        ) from None


def _checked(results: list[Any], keys: list[str]) -> list[Any]:
    """The replies of a pipeline run with ``raise_on_error=False``, one per key of ``keys``: a
    command Redis refused (a key holding another type) raises :class:`BadQueueData` naming its
    key; any other error (the connection) raises as it is."""
    for r, key in zip(results, keys):
        if isinstance(r, ResponseError):
            raise BadQueueData(f"key {key!r} cannot be read: {short(str(r), 120)}", key=key) from r
        if isinstance(r, Exception):
            raise r
    return results


async def read_shard_count(client: Client, keys: QueueKeys) -> int:
    """The queue's recorded shard count for the views (1 if none is recorded).

    Raises:
        BadQueueData: the record is not a valid count, or its hash is not a hash.
    """
    config = keys.base.config
    try:
        return await read_shards(client, keys)
    except ShardCountMismatch as e:
        raise BadQueueData(f"key {config!r} field {SHARDS_FIELD!r}: {e}", key=config, field=SHARDS_FIELD) from None
    except ResponseError as e:
        raise BadQueueData(f"key {config!r} cannot be read: {short(str(e), 120)}", key=config) from e


def histogram_quantile(buckets: dict[int, int], q: float) -> float | None:
    """Quantile (upper bucket bound, ms) of a latency histogram ``{bucket index: count}``."""
    total = sum(buckets.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i in sorted(buckets):
        seen += buckets[i]
        if seen >= rank:
            return LATENCY_BUCKETS_MS[i] if i < len(LATENCY_BUCKETS_MS) else float("inf")
    return float("inf")


async def _group_info(client: Client, stream: str) -> tuple[int, int, bytes | None]:
    """``(waiting, pending, last delivered id)`` of the rollq group on ``stream``.

    rollq deletes every entry it acknowledges, so a stream holds exactly the waiting and the
    pending entries: waiting = XLEN - pending, in O(1) on every Redis version.
    """
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xinfo_groups(stream)
    try:
        length, groups = await pipe.execute()
    except Exception:  # no such stream
        return 0, 0, None
    return _waiting(length, groups)


def _waiting(length: Any, groups: list[dict[Any, Any]]) -> tuple[int, int, bytes | None]:
    for g in groups:
        if text(g.get("name")) == GROUP:
            pending = _int(g.get("pending"))
            return max(0, int(length) - pending), pending, g.get("last-delivered-id")
    return int(length), 0, None


async def _groups_info(client: Client, streams: list[str]) -> list[tuple[int, int, bytes | None]]:
    """:func:`_group_info` of several streams (one per shard), in one pipeline.

    One stream: exactly :func:`_group_info` (a queue of one shard issues what it always did).
    A stream that does not exist yet counts as empty; other errors raise.
    """
    if len(streams) == 1:
        return [await _group_info(client, streams[0])]
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
    res = await pipe.execute(raise_on_error=False)
    out = []
    for length, groups in zip(res[0::2], res[1::2]):
        for r in (length, groups):
            if isinstance(r, Exception) and not isinstance(r, ResponseError):
                raise r
        out.append((0, 0, None) if isinstance(groups, Exception) else _waiting(length, groups))
    return out


async def _oldest_waiting(client: Client, heads: list[tuple[str, bytes | None]]) -> float | None:
    """Age in seconds of the oldest waiting entry among ``(stream, last delivered id)``."""
    if not heads:
        return None
    pipe = client.pipeline(transaction=False)
    for stream, last in heads:
        pipe.xrange(stream, min=b"(" + last if last else "-", max="+", count=1)
    firsts = [int(nxt[0][0].split(b"-")[0]) for nxt in await pipe.execute() if nxt]
    return max(0.0, time.time() - min(firsts) / 1000) if firsts else None


async def queue_status(client: Client, keys: QueueKeys, shards: int | None = None) -> QueueStatus:
    """One snapshot of a queue: depth, in flight, counters, latency, replicas.

    Figures of a sharded queue are summed over its shards (``shard_depth`` and
    ``shard_in_flight`` keep each shard's). ``shards``: the queue's shard count where the
    caller already knows it (the dashboard re-reads it now and then); None reads the record.

    Raises:
        BadQueueData: a key of the queue holds a value rollq does not write there (a counter,
            a latency bucket, the version or the shard count that is not an integer, a
            registry entry that is not a replica's record, a key of another type). The error
            names the key; the views show the queue as unreadable and go on with the others.
    """
    keys = keys.base
    k = check_shards(shards) if shards is not None else await read_shard_count(client, keys)
    parts = keys.shards(k)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.stats)
    pipe.hgetall(keys.latency)
    pipe.hgetall(keys.consumers)
    pipe.xlen(keys.dlq)
    pipe.hget(keys.version, "v")
    read = [keys.stats, keys.latency, keys.consumers, keys.dlq, keys.version]
    for part in parts[1:]:  # every shard counts its own jobs and keeps its own dead letters
        pipe.hgetall(part.stats)
        pipe.xlen(part.dlq)
        read += [part.stats, part.dlq]
    res = _checked(await pipe.execute(raise_on_error=False), read)
    stats_raw, lat, registry, dlq_len, version = res[:5]
    stats: dict[str, int] = {}
    for h, key in zip((stats_raw, *res[5::2]), (keys.stats, *read[5::2])):
        for name, v in h.items():
            stats[text(name)] = stats.get(text(name), 0) + _number(v, key, name)
    dlq_len = int(dlq_len) + sum(int(n) for n in res[6::2])
    buckets = {_number(b, keys.latency, b): _number(v, keys.latency, b) for b, v in lat.items()}

    groups = await _groups_info(client, [part.jobs for part in parts])
    shard_depth = [g[0] for g in groups]
    shard_in_flight = [g[1] for g in groups]
    oldest = await _oldest_waiting(client, [(part.jobs, g[2]) for part, g in zip(parts, groups) if g[0]])

    replicas: list[ReplicaView] = []
    if registry:
        names = [text(n) for n in registry]
        alive = await heartbeating(client, keys, names)
        now = time.time()
        for n, a in zip(names, alive):
            try:
                info = msgspec.msgpack.decode(registry[n.encode()], type=ReplicaInfo)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise BadQueueData(
                    f"key {keys.consumers!r} field {short(n, 60)!r} is not a replica's record: {short(str(e), 120)}",
                    key=keys.consumers, field=n,
                ) from None
            d = msgspec.structs.asdict(info)
            home = home_shard(n, k)  # jobs targeted at a replica wait in its home shard
            d2, p2, _ = await _group_info(client, parts[home].replica_jobs(n))
            shard_depth[home] += d2
            shard_in_flight[home] += p2
            replicas.append(ReplicaView(id=n, alive=bool(a), heartbeat_age_s=round(now - info.heartbeat_at, 3), info=d))
    ver = _number(version, keys.version, "v") if version is not None else None
    return QueueStatus(
        queue=keys.queue, depth=sum(shard_depth), in_flight=sum(shard_in_flight), oldest_waiting_s=oldest,
        submitted=stats.get("submitted", 0), completed=stats.get("completed", 0),
        failed=stats.get("failed", 0), dead_lettered=stats.get("dead_lettered", 0),
        dlq_length=dlq_len, latency_p50_ms=histogram_quantile(buckets, 0.5),
        latency_p99_ms=histogram_quantile(buckets, 0.99), version=ver,
        replicas=sorted(replicas, key=lambda r: r.id),
        shards=k, shard_depth=shard_depth, shard_in_flight=shard_in_flight,
    )


# ----------------------------------------------------------------------------------------
# dead letters
# ----------------------------------------------------------------------------------------
@dataclass
class DeadLetterView:
    entry_id: str
    job_id: str | None
    reason: str
    error_type: str
    consumer: str
    deliveries: int
    at: float
    source: str
    requeueable: bool
    #: Bytes of the entry kept in the dead letter, and of the original entry (more when the
    #: consumer cut it: ``ConsumerSettings.dlq_payload_bytes``).
    kept_bytes: int = 0
    payload_bytes: int = 0
    #: The shard whose dead-letter stream holds the entry.
    shard: int = 0
    #: How to name the entry to :func:`dlq_requeue`: the entry id, qualified with its shard
    #: (``"SHARD/ENTRY"``) in a queue of several shards. Empty: ``entry_id``.
    ref: str = ""

    def __post_init__(self) -> None:
        self.ref = self.ref or self.entry_id

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _view(eid: bytes, d: DeadLetter) -> DeadLetterView:
    try:
        ok = not d.truncated and bool(decode_job(d.payload))
    except Exception:  # noqa: BLE001 - not a valid job: it stays where it is
        ok = False
    return DeadLetterView(
        entry_id=text(eid), job_id=d.job_id, reason=d.reason, error_type=d.error_type,
        consumer=d.consumer, deliveries=d.deliveries, at=d.at, source=d.source, requeueable=ok,
        kept_bytes=len(d.payload), payload_bytes=max(d.payload_bytes, len(d.payload)),
    )


def entry_ref(shard: int, entry_id: str, shards: int) -> str:
    """The name of a dead letter for :func:`dlq_requeue`: ``entry_id`` in a queue of one
    shard, ``"SHARD/ENTRY"`` in a sharded one (entry ids are per stream, so two shards can
    hold the same one).

    >>> entry_ref(0, "1700000000000-0", 1), entry_ref(2, "1700000000000-0", 4)
    ('1700000000000-0', '2/1700000000000-0')
    """
    return entry_id if shards == 1 else f"{shard}/{entry_id}"


def parse_ref(ref: str, shards: int) -> tuple[int | None, str]:
    """``(shard, entry id)`` of a dead letter's name; shard None for a plain entry id, which
    :func:`dlq_requeue` looks up in every shard.

    >>> parse_ref("2/1700000000000-0", 4), parse_ref("1700000000000-0", 4)
    ((2, '1700000000000-0'), (None, '1700000000000-0'))
    >>> parse_ref("5/1-0", 4)
    Traceback (most recent call last):
    ...
    ValueError: dead letter '5/1-0' names shard 5, but the queue has shards 0-3
    """
    head, sep, entry = ref.partition("/")
    if not sep:
        return None, ref
    if not head.isdigit() or not 0 <= int(head) < shards:
        raise ValueError(f"dead letter {ref[:80]!r} names shard {head[:20]}, but the queue has shards 0-{shards - 1}")
    return int(head), entry


def _entry_order(eid: bytes) -> tuple[int, ...]:
    return tuple(int(x) for x in eid.split(b"-"))


async def _shard_count(client: Client, keys: QueueKeys, shards: int | None) -> int:
    return check_shards(shards) if shards is not None else await read_shards(client, keys)


async def dlq_list(client: Client, keys: QueueKeys, count: int = 100, shards: int | None = None) -> list[DeadLetterView]:
    """The latest ``count`` dead letters, newest first (of every shard: ``shards``, None reads
    the queue's record)."""
    keys = keys.base
    k = await _shard_count(client, keys, shards)
    if k == 1:
        found = [(0, eid, f) for eid, f in await client.xrevrange(keys.dlq, count=count)]
    else:  # the newest ``count`` of each shard, merged by entry id (time, then sequence)
        pipe = client.pipeline(transaction=False)
        for part in keys.shards(k):
            pipe.xrevrange(part.dlq, count=count)
        found = [(i, eid, f) for i, entries in enumerate(await pipe.execute()) for eid, f in entries]
        found.sort(key=lambda e: _entry_order(e[1]), reverse=True)
        del found[count:]
    out = []
    for i, eid, fields in found:
        try:
            v = _view(eid, decode_dead_letter(fields[_FIELD]))
        except Exception as e:
            v = DeadLetterView(text(eid), None, f"unreadable dead letter: {e}", "ProtocolError", "", 0, 0.0, "", False)
        v.shard, v.ref = i, entry_ref(i, v.entry_id, k)
        out.append(v)
    return out


async def dlq_requeue(client: Client, keys: QueueKeys, entry_ids: list[str] | None = None,
                      shards: int | None = None) -> tuple[int, int]:
    """Put dead-lettered jobs back on their stream (all, or the given entries).

    A job goes back into the shard whose dead-letter stream held it (its id's shard, or its
    target replica's home shard). ``entry_ids``: names as :attr:`DeadLetterView.ref` gives
    them (``"SHARD/ENTRY"``; a plain entry id is looked up in every shard). Entries that are
    not valid jobs stay in the dead-letter stream. Returns ``(requeued, skipped)``.
    Idempotent per job id while the job is queued.

    Raises:
        ValueError: an entry names a shard the queue does not have.
    """
    keys = keys.base
    k = await _shard_count(client, keys, shards)
    parts = keys.shards(k)
    found: list[tuple[int, Any]] = []
    if entry_ids is None:
        for i, part in enumerate(parts):
            found.extend((i, e) for e in await client.xrange(part.dlq, count=100_000))
    else:
        for ref in entry_ids:
            shard, eid = parse_ref(ref, k)
            for i in range(k) if shard is None else (shard,):
                found.extend((i, e) for e in await client.xrange(parts[i].dlq, min=eid, max=eid, count=1))
    requeued = skipped = 0
    for i, (eid, fields) in found:
        part = parts[i]
        try:
            dl = decode_dead_letter(fields[_FIELD])
            job = decode_job(dl.payload)
        except Exception:
            skipped += 1
            continue
        job.deadline = None
        job.submitted = time.time()
        await SUBMIT(client, part.submit_keys(part.job_stream(job.replica)), [msgpack.packb([job.id if job.tracked else '', encode_job(job)], use_bin_type=False), job.reply])
        await client.xdel(part.dlq, eid)
        requeued += 1
    return requeued, skipped


async def dlq_purge(client: Client, keys: QueueKeys, shards: int | None = None) -> int:
    """Delete every dead letter (of every shard). Returns how many there were."""
    keys = keys.base
    n = 0
    for part in keys.shards(await _shard_count(client, keys, shards)):
        n += int(await client.xlen(part.dlq))
        await client.delete(part.dlq)
    return n
