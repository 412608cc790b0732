"""The dashboard's only reader of Redis: one sampler per process, shared by every viewer.

Every ``interval`` seconds the sampler takes one snapshot of each queue it watches and keeps
the last ``history`` seconds of them in a ring buffer. The web page, the JSON API, ``/metrics``
and ``rollq top`` all read that memory, never Redis, so ten browsers and a Prometheus scrape
cost Redis what one sample costs:

- :func:`rollq.status.queue_status`: 7 + 3·R commands (R: replicas in the registry), one more
  (``XRANGE COUNT 1``, the oldest waiting job) while jobs wait; no scan over job keys;
- ``HGETALL`` of the latency and of the policy-lag histograms: 2;
- the versions log and the dead letters (``XREVRANGE COUNT``, one each) only when the policy
  version or the dead-letter figures changed, and every ``refresh_lists`` seconds.

So 9 + 3·R commands (10 + 3·R while jobs wait) in 4 + R round trips, however many jobs there are
(tests/dashboard/test_dashboard.py counts them with ``INFO commandstats``). A queue of K shards
(rollq/shards.py) adds 4 commands per shard beyond the first (its counters, its dead letters,
its stream's length and group; one more while its jobs wait) in the same round trips, and its
dead letters are read from every shard. The queue's shard count is read (``HGET``, one round
trip) at the first sample and with the lists, every ``refresh_lists`` seconds. Watching every queue in use
(no ``--queue``) adds, once per round, the read of the registry of queue names
(:func:`rollq.registry.queues_in_use`: 2 commands, 1 once ``default`` is registered).

Rates come from deltas of the queue's counters between samples, latency quantiles from deltas
of the latency histogram, so nothing is counted twice and a dashboard restart loses nothing
but its chart history.

>>> async def main():                                               # doctest: +SKIP
...     async with Sampler("redis://127.0.0.1:6379/0", ["grpo"]) as s:
...         await s.sample_all()
...         print(s.document("grpo")["queue"]["waiting"])
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.exceptions import RedisError, ResponseError

from ..connection import Client, connect
from ..errors import BadQueueData
from ..keys import QueueKeys
from ..protocol import LATENCY_BUCKETS_MS, SCHEMA_VERSION
from ..registry import queues_in_use
from ..settings import DEFAULT_QUEUE, RedisSettings
from ..status import QueueStatus, dlq_list, histogram_quantile, queue_status, read_shard_count

log = logging.getLogger(__name__)

#: Seconds :meth:`Sampler.close` waits on the loop before cancelling it again.
_CANCEL_RETRY_S = 0.5

#: Counters of the queue's ``stats`` hash that the dashboard turns into rates.
COUNTERS = ("submitted", "completed", "failed", "dead_lettered")

#: Replica states as the dashboard shows them. The first four are what a replica reports
#: about itself while its lease is live; ``stale`` and ``dead`` are the dashboard's verdict.
STATES = ("serving", "paused", "draining", "starting", "stale", "dead")

#: Seconds one Redis command of a sample may take before the sample counts as failed.
SAMPLE_TIMEOUT = 5.0


@dataclass(frozen=True)
class DashboardSettings:
    """How often and how much the dashboard samples. Times in seconds."""

    #: Time between two samples of every queue.
    interval: float = 1.0
    #: History kept per queue (charts; the window of the "recent" policy lag).
    history: float = 600.0
    #: Rates are averaged over this window.
    rate_window: float = 5.0
    #: Latency quantiles are those of results recorded within this window.
    latency_window: float = 60.0
    #: A replica whose registry entry is older than this is stale, even with a live lease.
    stale_after: float = 10.0
    #: A replica without a lease whose last heartbeat is older than this is dead.
    dead_after: float = 60.0
    #: Versions read from the versions log.
    versions: int = 50
    #: Dead letters read from the dead-letter stream.
    dead_letters: int = 20
    #: The versions log and the dead letters are re-read at least this often.
    refresh_lists: float = 30.0


def replica_state(reported: str, lease: bool, heartbeat_age_s: float, s: DashboardSettings) -> str:
    """What the dashboard calls a replica: its own state while it is live, else stale or dead.

    >>> s = DashboardSettings()
    >>> replica_state("serving", True, 0.5, s), replica_state("serving", False, 3, s)
    ('serving', 'stale')
    >>> replica_state("serving", False, 120, s), replica_state("serving", True, 30, s)
    ('dead', 'stale')
    """
    if lease:
        return "stale" if heartbeat_age_s > s.stale_after else reported
    if reported == "stopped" or heartbeat_age_s > s.dead_after:
        return "dead"
    return "stale"


def quantile_ms(buckets: dict[int, int], q: float) -> float | None:
    """:func:`rollq.status.histogram_quantile`, with the +Inf bucket reported as the largest
    finite bound (as Prometheus' ``histogram_quantile`` does), so the value is valid JSON."""
    v = histogram_quantile(buckets, q)
    if v is not None and math.isinf(v):
        return float(LATENCY_BUCKETS_MS[-1])
    return v


def _delta(now: int, then: int) -> int:
    """Increase of a counter; a counter that went down was reset (keys deleted)."""
    return now - then if now >= then else now


def _delta_hist(now: dict[int, int], then: dict[int, int]) -> dict[int, int]:
    if any(now.get(k, 0) < v for k, v in then.items()):
        return dict(now)
    return {k: v - then.get(k, 0) for k, v in now.items() if v - then.get(k, 0) > 0}


def _ints(h: dict[Any, Any]) -> dict[int, int]:
    out = {}
    for k, v in h.items():
        try:
            out[int(k)] = int(v)
        except ValueError:
            continue
    return out


def _decode_version(data: bytes) -> dict[str, Any] | None:
    """A versions-log record as a dict, without importing the weight-sync transports (torch).

    A :class:`~rollq.weightsync.versions.VersionRecord` is a msgpack map, so a plain decode
    gives its fields; records of another schema are skipped.
    """
    try:
        r = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(r, dict) or r.get("v") != SCHEMA_VERSION or "version" not in r:
        return None
    return {
        "version": r["version"], "published_at": r.get("published_at"), "transport": r.get("transport"),
        "nbytes": r.get("nbytes"), "num_tensors": r.get("num_tensors"), "checksum": r.get("checksum"),
        "trainer": r.get("trainer", ""), "timings": r.get("timings") or {},
    }


@dataclass(slots=True)
class Point:
    """One sample of one queue: what Redis said, and the rates derived from the samples before."""

    t: float  # wall clock (display)
    m: float  # monotonic (deltas)
    waiting: int
    in_flight: int
    dlq: int
    counters: dict[str, int]
    latency: dict[int, int]  # cumulative latency histogram
    lag: dict[int, int]  # cumulative policy-lag counts
    tokens_per_s: float
    live_replicas: int
    rates: dict[str, float] = field(default_factory=dict)  # per second; empty on the first sample
    p50_ms: float | None = None
    p99_ms: float | None = None


class _Queue:
    """Everything the sampler knows about one queue."""

    def __init__(self, name: str, maxlen: int):
        self.keys = QueueKeys(name)
        self.points: deque[Point] = deque(maxlen=maxlen)
        self.doc: dict[str, Any] | None = None  # latest document, without history
        self.error: str | None = None
        self.errors = 0
        self.samples = 0
        self.duration_s = 0.0
        self.versions: list[dict[str, Any]] = []
        self.versions_key: Any = None
        self.dead: list[dict[str, Any]] = []
        self.dead_key: Any = None
        self.lists_at = 0.0
        self.shards: int | None = None  # the queue's recorded shard count, re-read with the lists


class Sampler:
    """Samples queues every ``settings.interval`` seconds; serves the latest data from memory.

    Args:
        url: Redis URL (``$ROLLQ_REDIS_URL`` if None).
        queues: names of the queues to watch (the dashboard shows only these); None: every
            queue in use (:func:`rollq.registry.queues_in_use`), re-read every round, so a
            queue used later joins (one seen once stays while the sampler runs).
        settings: :class:`DashboardSettings`.
    """

    def __init__(self, url: str | RedisSettings | None, queues: list[str] | None = None,
                 settings: DashboardSettings | None = None):
        if queues is not None and not queues:
            raise ValueError("the dashboard needs at least one queue (--queue), or None: every queue in use")
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.settings = s = settings or DashboardSettings()
        #: True when the sampler watches every queue in use (no queues given).
        self.discovering = queues is None
        self._maxlen = max(2, int(math.ceil(s.history / s.interval)) + 1)
        self._queues = {q: _Queue(q, self._maxlen) for q in dict.fromkeys(queues or [])}
        self._discover_error: str | None = None
        self._client: Client | None = None
        self._task: asyncio.Task | None = None
        self._closing = False

    @property
    def queues(self) -> list[str]:
        return list(self._queues)

    def __contains__(self, queue: str) -> bool:
        return queue in self._queues

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> Sampler:
        if self._client is None:
            # a short command timeout: a hung Redis shows as an error within seconds
            self._client = connect(self.redis_settings, max_connections=8, socket_timeout=SAMPLE_TIMEOUT)
        return self

    async def client(self) -> Client:
        """The sampler's Redis client (the requeue endpoint borrows it)."""
        await self.open()
        return self._client

    def start(self) -> None:
        """Run the sampling loop as a task (until :meth:`close`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="rollq-dashboard-sampler")

    async def close(self) -> None:
        """Stop the sampling loop and close the client.

        The loop also checks a closing flag between rounds: a cancellation can be lost inside a
        Redis call whose own timeout fires at the same moment (Python 3.11's ``wait_for``), so
        the cancel is repeated until the task has ended.
        """
        task, self._task = self._task, None
        if task is not None:
            self._closing = True
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=_CANCEL_RETRY_S)
            if not task.cancelled() and task.exception() is not None:
                log.warning("dashboard sampler ended with %s", type(task.exception()).__name__)
            self._closing = False
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> Sampler:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _loop(self) -> None:
        await self.open()
        interval = self.settings.interval
        next_at = time.monotonic()
        while not self._closing:
            await self.sample_all()
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow round: skip the missed ticks instead of bursting
                next_at = time.monotonic()
                delay = 0
            await asyncio.sleep(delay)

    # -- sampling ------------------------------------------------------------------------
    async def discover(self) -> None:
        """Watch the queues in use that are not watched yet (only without a queue list).

        Reads the registry, writes nothing. Unreadable: the queues stay as they are (the
        ``default`` queue if none yet, whose samples then report the error); never raises.
        """
        if not self.discovering:
            return
        await self.open()
        try:
            names = await queues_in_use(self._client)
        except (RedisError, OSError) as e:
            if self._discover_error is None:
                log.warning("dashboard: cannot read the registry of queues: %s: %s", type(e).__name__, e)
            self._discover_error = f"{type(e).__name__}: {e}"
            names = [] if self._queues else [DEFAULT_QUEUE]
        else:
            self._discover_error = None
        new = [n for n in names if n not in self._queues]
        if new:  # a new dict, in name order: readers iterating the old one are not disturbed
            self._queues = dict(sorted({**self._queues, **{n: _Queue(n, self._maxlen) for n in new}}.items()))

    async def sample_all(self) -> None:
        """One sample of every queue, concurrently (first, without a queue list, the registry)."""
        await self.discover()
        await asyncio.gather(*(self.sample(q) for q in self._queues))

    async def sample(self, queue: str) -> None:
        """One sample of ``queue``; a failure is recorded (shown as ``error``), not raised."""
        q = self._queues[queue]
        await self.open()
        t0 = time.monotonic()
        try:
            st, lat, lag = await self._read(q)
        except BadQueueData as e:  # a stray value at one of its keys: named, the queue shown as bad
            self._failed(q, f"unreadable: {e}")
            return
        except ResponseError as e:
            self._failed(q, f"redis refused a read: {e}")
            return
        except (RedisError, OSError) as e:
            self._failed(q, f"redis unreachable: {type(e).__name__}: {e}")
            return
        except Exception as e:  # a viewer must outlive odd data: say what went wrong, keep going
            self._failed(q, f"{type(e).__name__}: {e}", traceback=True)
            return
        if q.error is not None:
            log.info("dashboard: queue %r readable again", queue)
        q.error = None
        q.samples += 1
        q.duration_s = time.monotonic() - t0
        point = self._point(q, st, lat, lag)
        q.points.append(point)
        q.doc = self._document(q, st, point)

    def _failed(self, q: _Queue, message: str, traceback: bool = False) -> None:
        if q.error is None:  # log the first failure of a run, not one line per interval
            log.warning("dashboard: cannot sample queue %r: %s", q.keys.queue, message, exc_info=traceback)
        q.error = message
        q.errors += 1

    async def _read(self, q: _Queue) -> tuple[QueueStatus, dict[int, int], dict[int, int]]:
        client = self._client
        keys = q.keys
        now = time.monotonic()
        refresh = now - q.lists_at >= self.settings.refresh_lists
        if refresh or q.shards is None:  # recorded once per queue: no need to read it every sample
            q.shards = await read_shard_count(client, keys)
        st = await queue_status(client, keys, q.shards)
        read_versions = refresh or st.version != q.versions_key
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(keys.latency)  # queue_status keeps only two quantiles; rates need the buckets
        pipe.hgetall(keys.lag)
        if read_versions:
            pipe.xrevrange(keys.versions_log, count=self.settings.versions)
        res = await pipe.execute()
        lat, lag = _ints(res[0]), _ints(res[1])
        if read_versions:
            q.versions = [v for _, f in res[2] if (v := _decode_version(f.get(b"d", b""))) is not None]
            q.versions_key = st.version
        dead_key = (st.dlq_length, st.dead_lettered)
        if refresh or dead_key != q.dead_key:
            q.dead = [d.to_dict() for d in await dlq_list(client, keys, self.settings.dead_letters, q.shards)]
            q.dead_key = dead_key
        if refresh:
            q.lists_at = now
        return st, lat, lag

    # -- derived figures -----------------------------------------------------------------
    @staticmethod
    def _ref(points: deque[Point], m: float, window: float) -> Point | None:
        """The newest earlier point at least ``window`` seconds old (else the oldest one)."""
        ref = None
        for p in reversed(points):
            ref = p
            if m - p.m >= window:
                break
        return ref

    def _point(self, q: _Queue, st: QueueStatus, lat: dict[int, int], lag: dict[int, int]) -> Point:
        s = self.settings
        counters = {c: getattr(st, c) for c in COUNTERS}
        p = Point(
            t=st.at, m=time.monotonic(), waiting=st.depth, in_flight=st.in_flight, dlq=st.dlq_length,
            counters=counters, latency=lat, lag=lag,
            tokens_per_s=round(sum(float(r.info.get("tokens_per_s") or 0.0) for r in st.replicas if r.alive), 1),
            live_replicas=sum(1 for r in st.replicas if r.alive),
        )
        ref = self._ref(q.points, p.m, s.rate_window)
        if ref is not None and p.m > ref.m:
            dt = p.m - ref.m
            p.rates = {f"{c}_per_s": round(_delta(counters[c], ref.counters.get(c, 0)) / dt, 3) for c in COUNTERS}
        ref = self._ref(q.points, p.m, s.latency_window)
        if ref is not None:
            recent = _delta_hist(p.latency, ref.latency)
            p.p50_ms, p.p99_ms = quantile_ms(recent, 0.5), quantile_ms(recent, 0.99)
        return p

    def _document(self, q: _Queue, st: QueueStatus, p: Point) -> dict[str, Any]:
        s = self.settings
        replicas = []
        for r in st.replicas:
            i = r.info
            age = max(0.0, r.heartbeat_age_s)
            replicas.append({
                "id": r.id,
                "state": replica_state(i.get("state", "serving"), r.alive, age, s),
                "reported_state": i.get("state"),
                "lease": r.alive,
                "heartbeat_at": i.get("heartbeat_at"),
                "heartbeat_age_s": round(age, 3),
                "version": i.get("version"),
                "versions_behind": None if st.version is None else st.version - i["version"],
                "inflight": i.get("inflight"), "cap": i.get("cap"),
                "kv_usage": i.get("kv_usage"), "tokens_per_s": i.get("tokens_per_s"),
                "completed": i.get("completed"), "failed": i.get("failed"),
                "last_update_s": i.get("last_update_s"), "last_pause_s": i.get("last_pause_s"),
                "paused_s_total": i.get("paused_s_total"), "updates": i.get("updates", 0),
                "engine": i.get("engine"), "model": i.get("model"), "device": i.get("device"),
                "host": i.get("host"), "pid": i.get("pid"), "started_at": i.get("started_at"),
                "labels": i.get("labels") or {},
            })
        states = {k: 0 for k in STATES}
        for r in replicas:
            states[r["state"]] = states.get(r["state"], 0) + 1
        first = q.points[0] if q.points else p
        recent_lag = _delta_hist(p.lag, first.lag) if first is not p else dict(p.lag)
        return {
            "queue": {
                "name": st.queue, "waiting": st.depth, "in_flight": st.in_flight,
                "oldest_waiting_s": None if st.oldest_waiting_s is None else round(st.oldest_waiting_s, 3),
                "dlq_length": st.dlq_length, "submitted": st.submitted, "completed": st.completed,
                "failed": st.failed, "dead_lettered": st.dead_lettered,
                # a sharded queue: the figures above are sums; each shard's (index = shard)
                "shards": st.shards, "shard_waiting": st.shard_depth, "shard_in_flight": st.shard_in_flight,
            },
            "rates": {**{f"{c}_per_s": p.rates.get(f"{c}_per_s") for c in COUNTERS},
                      "tokens_per_s": p.tokens_per_s, "window_s": s.rate_window},
            "latency": {
                "p50_ms": p.p50_ms, "p99_ms": p.p99_ms, "window_s": s.latency_window,
                "all_time": {"p50_ms": quantile_ms(p.latency, 0.5), "p99_ms": quantile_ms(p.latency, 0.99),
                             "count": sum(p.latency.values())},
                "buckets_ms": list(LATENCY_BUCKETS_MS),
                "buckets": [p.latency.get(i, 0) for i in range(len(LATENCY_BUCKETS_MS) + 1)],
            },
            "replicas": replicas,
            "replica_states": states,
            "versions": {
                "current": st.version,
                "log": q.versions,
                "lag": {
                    "recent": [{"lag": k, "count": v} for k, v in sorted(recent_lag.items())],
                    "window_s": round(p.t - first.t, 1),
                    "all_time": [{"lag": k, "count": v} for k, v in sorted(p.lag.items())],
                },
            },
            "dead_letters": {"length": st.dlq_length, "total": st.dead_lettered, "latest": q.dead},
        }

    # -- reading (no Redis) ----------------------------------------------------------------
    def latest(self, queue: str) -> Point | None:
        pts = self._queues[queue].points
        return pts[-1] if pts else None

    def sampler_info(self, queue: str) -> dict[str, Any]:
        q = self._queues[queue]
        last = q.points[-1].t if q.points else None
        return {
            "ok": q.error is None and last is not None, "error": q.error, "samples": q.samples,
            "errors": q.errors, "interval_s": self.settings.interval, "history_s": self.settings.history,
            "last_sample_at": last, "last_duration_ms": round(q.duration_s * 1000, 2),
        }

    def history(self, queue: str, since: float | None = None) -> dict[str, list[Any]]:
        """Chart series of the points newer than ``since`` (all kept points if None)."""
        pts = [p for p in self._queues[queue].points if since is None or p.t > since]
        return {
            "t": [p.t for p in pts],
            "waiting": [p.waiting for p in pts],
            "in_flight": [p.in_flight for p in pts],
            "dlq": [p.dlq for p in pts],
            "submitted_per_s": [p.rates.get("submitted_per_s") for p in pts],
            "completed_per_s": [p.rates.get("completed_per_s") for p in pts],
            "failed_per_s": [p.rates.get("failed_per_s") for p in pts],
            "p50_ms": [p.p50_ms for p in pts],
            "p99_ms": [p.p99_ms for p in pts],
            "tokens_per_s": [p.tokens_per_s for p in pts],
            "live_replicas": [p.live_replicas for p in pts],
        }

    def document(self, queue: str, *, since: float | None = None, history: bool = True) -> dict[str, Any]:
        """Everything the page shows about ``queue``, from the latest sample (one JSON object)."""
        q = self._queues[queue]
        doc: dict[str, Any] = {"name": queue, "at": q.points[-1].t if q.points else None}
        doc.update(q.doc or {})
        doc["sampler"] = self.sampler_info(queue)
        if history:
            doc["history"] = self.history(queue, since)
        return doc

    def summary(self, queue: str) -> dict[str, Any]:
        """A line of the queue list: the headline figures only."""
        d = self._queues[queue].doc or {}
        qd, rates, lat = d.get("queue", {}), d.get("rates", {}), d.get("latency", {})
        return {
            "name": queue, "ok": self.sampler_info(queue)["ok"], "waiting": qd.get("waiting"),
            "in_flight": qd.get("in_flight"), "dlq_length": qd.get("dlq_length"),
            "completed_per_s": rates.get("completed_per_s"), "p99_ms": lat.get("p99_ms"),
            "replicas": len(d.get("replicas", [])), "version": d.get("versions", {}).get("current"),
            "shards": qd.get("shards"),
        }
