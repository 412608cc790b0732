"""Read-only views of a queue (CLI ``status``, dashboards) and dead-letter administration.

Every view costs a bounded number of commands: no KEYS, no SCAN over job data. Reading never
changes anything; only :func:`dlq_requeue` and :func:`dlq_purge` write.

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

from .connection import SUBMIT, Client
from .keys import FIELD, GROUP, QueueKeys
from .protocol import LATENCY_BUCKETS_MS, DeadLetter, ReplicaInfo, decode_dead_letter, decode_job, encode_job
from .replicas import heartbeating

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


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
    for g in groups:
        if _s(g.get("name")) == GROUP:
            pending = _int(g.get("pending"))
            return max(0, int(length) - pending), pending, g.get("last-delivered-id")
    return int(length), 0, None


async def queue_status(client: Client, keys: QueueKeys) -> QueueStatus:
    """One snapshot of a queue: depth, in flight, counters, latency, replicas."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.stats)
    pipe.hgetall(keys.latency)
    pipe.hgetall(keys.consumers)
    pipe.xlen(keys.dlq)
    pipe.hget(keys.version, "v")
    stats, lat, registry, dlq_len, version = await pipe.execute()
    stats = {_s(k): int(v) for k, v in stats.items()}
    buckets = {int(k): int(v) for k, v in lat.items()}

    depth, in_flight, last = await _group_info(client, keys.jobs)
    oldest = None
    if depth:
        nxt = await client.xrange(keys.jobs, min=b"(" + last if last else "-", max="+", count=1)
        if nxt:
            ms = int(nxt[0][0].split(b"-")[0])
            oldest = max(0.0, time.time() - ms / 1000)

    replicas: list[ReplicaView] = []
    if registry:
        names = [_s(n) for n in registry]
        alive = await heartbeating(client, keys, names)
        now = time.time()
        for n, a in zip(names, alive):
            info = msgspec.msgpack.decode(registry[n.encode()], type=ReplicaInfo)
            d = msgspec.structs.asdict(info)
            d2, p2, _ = await _group_info(client, keys.replica_jobs(n))
            depth += d2
            in_flight += p2
            replicas.append(ReplicaView(id=n, alive=bool(a), heartbeat_age_s=round(now - info.heartbeat_at, 3), info=d))
    ver = int(version) if version is not None else None
    return QueueStatus(
        queue=keys.queue, depth=depth, in_flight=in_flight, oldest_waiting_s=oldest,
        submitted=stats.get("submitted", 0), completed=stats.get("completed", 0),
        failed=stats.get("failed", 0), dead_lettered=stats.get("dead_lettered", 0),
        dlq_length=int(dlq_len), latency_p50_ms=histogram_quantile(buckets, 0.5),
        latency_p99_ms=histogram_quantile(buckets, 0.99), version=ver,
        replicas=sorted(replicas, key=lambda r: r.id),
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _view(eid: bytes, d: DeadLetter) -> DeadLetterView:
    try:
        ok = not d.truncated and bool(decode_job(d.payload))
    except Exception:  # noqa: BLE001 - not a valid job: it stays where it is
        ok = False
    return DeadLetterView(
        entry_id=_s(eid), job_id=d.job_id, reason=d.reason, error_type=d.error_type,
        consumer=d.consumer, deliveries=d.deliveries, at=d.at, source=d.source, requeueable=ok,
        kept_bytes=len(d.payload), payload_bytes=max(d.payload_bytes, len(d.payload)),
    )


async def dlq_list(client: Client, keys: QueueKeys, count: int = 100) -> list[DeadLetterView]:
    """The latest ``count`` dead letters, newest first."""
    entries = await client.xrevrange(keys.dlq, count=count)
    out = []
    for eid, fields in entries:
        try:
            out.append(_view(eid, decode_dead_letter(fields[_FIELD])))
        except Exception as e:
            out.append(DeadLetterView(_s(eid), None, f"unreadable dead letter: {e}", "ProtocolError", "", 0, 0.0, "", False))
    return out


async def dlq_requeue(client: Client, keys: QueueKeys, entry_ids: list[str] | None = None) -> tuple[int, int]:
    """Put dead-lettered jobs back on their stream (all, or the given entries).

    Entries that are not valid jobs stay in the dead-letter stream. Returns
    ``(requeued, skipped)``. Idempotent per job id while the job is queued.
    """
    if entry_ids is None:
        entries = await client.xrange(keys.dlq, count=100_000)
    else:
        entries = []
        for eid in entry_ids:
            entries.extend(await client.xrange(keys.dlq, min=eid, max=eid, count=1))
    requeued = skipped = 0
    for eid, fields in entries:
        try:
            dl = decode_dead_letter(fields[_FIELD])
            job = decode_job(dl.payload)
        except Exception:
            skipped += 1
            continue
        job.deadline = None
        job.submitted = time.time()
        await SUBMIT(client, keys.submit_keys(keys.job_stream(job.replica)), [msgpack.packb([job.id if job.tracked else '', encode_job(job)], use_bin_type=False), job.reply])
        await client.xdel(keys.dlq, eid)
        requeued += 1
    return requeued, skipped


async def dlq_purge(client: Client, keys: QueueKeys) -> int:
    """Delete every dead letter. Returns how many there were."""
    n = await client.xlen(keys.dlq)
    await client.delete(keys.dlq)
    return int(n)
