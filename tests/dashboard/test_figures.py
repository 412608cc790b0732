"""The dashboard's figures from samples (rollq/dashboard/figures.py): no Redis, points given."""

from __future__ import annotations

from rollq.dashboard.figures import COUNTERS, history_series, make_point, queue_document, ref_point
from rollq.dashboard.sampler import DashboardSettings
from rollq.protocol import LATENCY_BUCKETS_MS
from rollq.status import QueueStatus, ReplicaView

S = DashboardSettings(rate_window=5.0, latency_window=20.0, stale_after=10.0, dead_after=60.0)


def status(at: float, *, submitted: int = 0, completed: int = 0, replicas=(), version=None) -> QueueStatus:
    return QueueStatus(
        queue="q", depth=3, in_flight=2, oldest_waiting_s=1.23456, submitted=submitted, completed=completed,
        failed=0, dead_lettered=0, dlq_length=0, latency_p50_ms=None, latency_p99_ms=None, version=version,
        replicas=list(replicas), at=at,
    )


def test_rates_are_deltas_over_the_rate_window_and_a_reset_counts_from_zero():
    pts = [make_point([], status(100.0, submitted=0), {}, {}, S, m=0.0)]
    for i in range(1, 11):  # one point a second, 10 jobs submitted per second
        pts.append(make_point(pts, status(100.0 + i, submitted=10 * i), {}, {}, S, m=float(i)))
    assert pts[0].rates == {}
    last = pts[-1]
    assert ref_point(pts[:-1], last.m, S.rate_window) is pts[5]  # the newest point 5 s old
    assert last.rates["submitted_per_s"] == 10.0 and set(last.rates) == {f"{c}_per_s" for c in COUNTERS}
    reset = make_point(pts, status(111.0, submitted=7), {}, {}, S, m=11.0)  # keys deleted: 7 since
    assert reset.rates["submitted_per_s"] == round(7 / 5, 3)


def test_latency_quantiles_are_those_of_the_window_only():
    old = {0: 100}  # 100 results in the fastest bucket, long ago
    pts = [make_point([], status(0.0), old, {}, S, m=0.0)]
    pts.append(make_point(pts, status(30.0), old, {}, S, m=30.0))
    slow = len(LATENCY_BUCKETS_MS) - 2
    p = make_point(pts, status(40.0), {0: 100, slow: 5}, {}, S, m=40.0)
    assert p.p50_ms == p.p99_ms == LATENCY_BUCKETS_MS[slow]  # only the 5 recent ones
    doc = queue_document(status(40.0), p, pts + [p], [], [], S)
    assert doc["latency"]["all_time"]["count"] == 105 and doc["latency"]["all_time"]["p50_ms"] == LATENCY_BUCKETS_MS[0]
    # the +Inf bucket reads as the largest finite bound (valid JSON)
    inf = make_point([], status(0.0), {len(LATENCY_BUCKETS_MS): 3}, {}, S, m=0.0)
    assert inf.latency and queue_document(status(0.0), inf, [inf], [], [], S)["latency"]["all_time"]["p99_ms"] == LATENCY_BUCKETS_MS[-1]


def test_document_judges_replicas_and_counts_recent_policy_lag():
    live = ReplicaView(id="a", alive=True, heartbeat_age_s=0.5, info={"state": "serving", "version": 3, "tokens_per_s": 12.5})
    stale = ReplicaView(id="b", alive=False, heartbeat_age_s=3.0, info={"state": "serving", "version": 1})
    dead = ReplicaView(id="c", alive=False, heartbeat_age_s=600.0, info={"state": "paused", "version": 1})
    first = make_point([], status(0.0, version=3), {}, {0: 4, 1: 2}, S, m=0.0)
    st = status(10.0, version=3, replicas=[live, stale, dead])
    p = make_point([first], st, {}, {0: 10, 1: 2, 2: 1}, S, m=10.0)
    assert p.tokens_per_s == 12.5 and p.live_replicas == 1
    doc = queue_document(st, p, [first, p], [{"version": 3}], [{"id": "j"}], S)
    assert [(r["id"], r["state"], r["versions_behind"]) for r in doc["replicas"]] == [
        ("a", "serving", 0), ("b", "stale", 2), ("c", "dead", 2)]
    assert doc["replica_states"] == {"serving": 1, "paused": 0, "draining": 0, "starting": 0, "stale": 1, "dead": 1}
    assert doc["versions"]["lag"]["recent"] == [{"lag": 0, "count": 6}, {"lag": 2, "count": 1}]
    assert doc["versions"]["lag"]["window_s"] == 10.0 and doc["versions"]["log"] == [{"version": 3}]
    assert doc["dead_letters"]["latest"] == [{"id": "j"}] and doc["queue"]["oldest_waiting_s"] == 1.235


def test_history_series_take_the_points_newer_than_since():
    pts = [make_point([], status(100.0 + i, completed=i), {}, {}, S, m=float(i)) for i in range(3)]
    h = history_series(pts, since=100.0)
    assert h["t"] == [101.0, 102.0] and h["waiting"] == [3, 3] and set(h) >= {"p99_ms", "live_replicas"}
    assert history_series(pts)["t"] == [100.0, 101.0, 102.0]
