"""What the dashboard shows, derived from samples: no Redis, no clock of its own.

The sampler (:mod:`rollq.dashboard.sampler`) reads a queue and hands the reading here: a
:class:`Point` per sample (rates from deltas of the counters against an earlier point,
latency quantiles from deltas of the latency histogram), the page's document of the queue
(:func:`queue_document`), and the charts' series (:func:`history_series`).

>>> from rollq.dashboard.sampler import DashboardSettings
>>> w = DashboardSettings(rate_window=5.0, latency_window=60.0)
>>> zero = dict(queue="q", depth=0, in_flight=0, oldest_waiting_s=None, failed=0, dead_lettered=0,
...             dlq_length=0, latency_p50_ms=None, latency_p99_ms=None, version=None)
>>> st = QueueStatus(**zero, submitted=10, completed=0, at=100.0)
>>> first = make_point([], st, {}, {}, w, m=0.0)
>>> st2 = QueueStatus(**zero, submitted=60, completed=25, at=105.0)
>>> p = make_point([first], st2, {3: 25}, {}, w, m=5.0)
>>> p.rates["submitted_per_s"], p.rates["completed_per_s"], p.p50_ms
(10.0, 5.0, 5)
>>> queue_document(st2, p, [first, p], [], [], w)["rates"]["completed_per_s"]
5.0
>>> history_series([first, p], since=100.0)["completed_per_s"]
[5.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from ..protocol import LATENCY_BUCKETS_MS
from ..status import QueueStatus, histogram_quantile

#: Counters of the queue's ``stats`` hash that the dashboard turns into rates.
COUNTERS = ("submitted", "completed", "failed", "dead_lettered")

#: Replica states as the dashboard shows them. The first four are what a replica reports
#: about itself while its lease is live; ``stale`` and ``dead`` are the dashboard's verdict.
STATES = ("serving", "paused", "draining", "starting", "stale", "dead")


class WindowSettings(Protocol):
    """What the figures need of :class:`~rollq.dashboard.sampler.DashboardSettings`."""

    @property
    def rate_window(self) -> float: ...
    @property
    def latency_window(self) -> float: ...
    @property
    def stale_after(self) -> float: ...
    @property
    def dead_after(self) -> float: ...


def replica_state(reported: str, lease: bool, heartbeat_age_s: float, s: WindowSettings) -> str:
    """What the dashboard calls a replica: its own state while it is live, else stale or dead.

    >>> from rollq.dashboard.sampler import DashboardSettings
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


def delta(now: int, then: int) -> int:
    """Increase of a counter; a counter that went down was reset (keys deleted)."""
    return now - then if now >= then else now


def delta_hist(now: dict[int, int], then: dict[int, int]) -> dict[int, int]:
    if any(now.get(k, 0) < v for k, v in then.items()):
        return dict(now)
    return {k: v - then.get(k, 0) for k, v in now.items() if v - then.get(k, 0) > 0}


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


def ref_point(points: Sequence[Point], m: float, window: float) -> Point | None:
    """The newest earlier point at least ``window`` seconds old (else the oldest one)."""
    ref = None
    for p in reversed(points):
        ref = p
        if m - p.m >= window:
            break
    return ref

def make_point(points: Sequence[Point], st: QueueStatus, lat: dict[int, int], lag: dict[int, int],
               s: WindowSettings, *, m: float) -> Point:
    """The point of a sample (``st`` and the latency and policy-lag histograms read with it,
    at monotonic time ``m``), its rates and recent quantiles from the earlier ``points``."""
    counters = {c: getattr(st, c) for c in COUNTERS}
    p = Point(
        t=st.at, m=m, waiting=st.depth, in_flight=st.in_flight, dlq=st.dlq_length,
        counters=counters, latency=lat, lag=lag,
        tokens_per_s=round(sum(float(r.info.get("tokens_per_s") or 0.0) for r in st.replicas if r.alive), 1),
        live_replicas=sum(1 for r in st.replicas if r.alive),
    )
    ref = ref_point(points, p.m, s.rate_window)
    if ref is not None and p.m > ref.m:
        dt = p.m - ref.m
        p.rates = {f"{c}_per_s": round(delta(counters[c], ref.counters.get(c, 0)) / dt, 3) for c in COUNTERS}
    ref = ref_point(points, p.m, s.latency_window)
    if ref is not None:
        recent = delta_hist(p.latency, ref.latency)
        p.p50_ms, p.p99_ms = quantile_ms(recent, 0.5), quantile_ms(recent, 0.99)
    return p

def queue_document(st: QueueStatus, p: Point, points: Sequence[Point], versions: list[dict[str, Any]],
                   dead: list[dict[str, Any]], s: WindowSettings) -> dict[str, Any]:
    """What the page shows of a queue (without the charts): ``st`` and its point ``p``, the
    kept ``points`` (the recent policy lag is counted since the oldest), the versions log and
    the latest dead letters as read."""
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
            "progress_sent": i.get("progress_sent", 0), "progress_dropped": i.get("progress_dropped", 0),
            "progress_failed": i.get("progress_failed", 0),
            "engine": i.get("engine"), "model": i.get("model"), "device": i.get("device"),
            "host": i.get("host"), "pid": i.get("pid"), "started_at": i.get("started_at"),
            "labels": i.get("labels") or {},
        })
    states = {k: 0 for k in STATES}
    for shown in replicas:
        states[shown["state"]] = states.get(shown["state"], 0) + 1
    first = points[0] if points else p
    recent_lag = delta_hist(p.lag, first.lag) if first is not p else dict(p.lag)
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
            "log": versions,
            "lag": {
                "recent": [{"lag": k, "count": v} for k, v in sorted(recent_lag.items())],
                "window_s": round(p.t - first.t, 1),
                "all_time": [{"lag": k, "count": v} for k, v in sorted(p.lag.items())],
            },
        },
        "dead_letters": {"length": st.dlq_length, "total": st.dead_lettered, "latest": dead},
    }


def history_series(points: Sequence[Point], since: float | None = None) -> dict[str, list[Any]]:
    """Chart series of the points newer than ``since`` (all of ``points`` if None)."""
    pts = [p for p in points if since is None or p.t > since]
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
