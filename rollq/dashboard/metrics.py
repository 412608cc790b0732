"""``/metrics``: the sampler's latest snapshot in the Prometheus text format.

A custom collector reads the sampler's memory at scrape time, so a scrape costs Redis nothing.
Counters are the queue's own (``stats`` hash), so ``rate()`` in Prometheus gives the same
figures the page shows; ``rollq_latency_ms`` is the queue's latency histogram as it is (bucket
bounds in milliseconds, no ``_sum``: rollq does not record one).

Names: ``rollq_queue_*`` (per queue), ``rollq_jobs_*_total``, ``rollq_latency_ms``,
``rollq_policy_*``, ``rollq_replica_*`` (per queue and replica), ``rollq_dashboard_*`` (the
sampler itself). deploy/grafana/rollq.json charts them.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..protocol import LATENCY_BUCKETS_MS
from .figures import COUNTERS, STATES
from .sampler import Sampler

#: Content type of :func:`render`: the classic text format every Prometheus version reads
#: (metric names are plain ASCII, so nothing needs the 1.0.0 format's escaping).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_PROGRESS_COUNTERS = (
    # (registry field, help): streamed jobs' progress (rollq/consumer/_progress.py)
    ("progress_sent", "Progress entries of streamed jobs the replica wrote to Redis."),
    ("progress_dropped", "Tokens of streamed jobs' progress the replica dropped (the results hold them)."),
    ("progress_failed", "Progress flushes of the replica that Redis refused."),
)
_REPLICA_GAUGES = (
    # (metric, registry field, help)
    ("rollq_replica_inflight", "inflight", "Jobs the replica is running."),
    ("rollq_replica_capacity", "cap", "The replica's current in-flight cap."),
    ("rollq_replica_kv_usage_ratio", "kv_usage", "Fraction of the replica's KV-cache blocks in use."),
    ("rollq_replica_tokens_per_second", "tokens_per_s", "Tokens the replica generates per second."),
    ("rollq_replica_policy_version", "version", "Policy version the replica has loaded."),
    ("rollq_replica_heartbeat_age_seconds", "heartbeat_age_s", "Seconds since the replica's last heartbeat."),
    ("rollq_replica_last_update_seconds", "last_update_s", "Duration of the replica's last weight update."),
    ("rollq_replica_last_pause_seconds", "last_pause_s", "Generation stopped during the last weight update."),
)


class SamplerCollector(Collector):
    """Metrics of every queue a :class:`~rollq.dashboard.sampler.Sampler` watches."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def collect(self) -> Iterator[Metric]:
        Q, R = ["queue"], ["queue", "replica"]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        jobs = {c: counter(f"rollq_jobs_{c}", f"Jobs {c.replace('_', ' ')} (the queue's counter).", labels=Q)
                for c in COUNTERS}
        waiting = gauge("rollq_queue_waiting", "Jobs waiting, not yet delivered to a replica.", labels=Q)
        in_flight = gauge("rollq_queue_in_flight", "Jobs delivered to a replica, not yet finished.", labels=Q)
        oldest = gauge("rollq_queue_oldest_waiting_seconds", "Age of the oldest waiting job.", labels=Q)
        dlq = gauge("rollq_queue_dead_letters", "Entries in the dead-letter stream.", labels=Q)
        shards = gauge("rollq_queue_shards", "Shards of the queue (rollq/shards.py).", labels=Q)
        shard_waiting = gauge("rollq_queue_shard_waiting", "Jobs waiting in one shard of the queue.",
                              labels=["queue", "shard"])
        shard_in_flight = gauge("rollq_queue_shard_in_flight", "Jobs of one shard delivered, not yet finished.",
                                labels=["queue", "shard"])
        latency = HistogramMetricFamily("rollq_latency_ms", "Submit-to-result latency of completed jobs.", labels=Q)
        quantile = gauge("rollq_latency_quantile_ms", "Latency quantile of recent results (the page's figure).",
                         labels=["queue", "quantile"])
        version = gauge("rollq_policy_version", "Latest committed policy version.", labels=Q)
        lag = counter("rollq_policy_lag_results", "Finished jobs by policy lag (versions).", labels=["queue", "lag"])
        replicas = gauge("rollq_replicas", "Replicas in the registry, by state.", labels=["queue", "state"])
        up = gauge("rollq_replica_up", "1 while the replica's lease is live.", labels=R)
        state = gauge("rollq_replica_state", "1 for the replica's current state.", labels=["queue", "replica", "state"])
        paused = counter("rollq_replica_paused_seconds", "Time the replica was paused for weight updates.", labels=R)
        done = counter("rollq_replica_jobs_completed", "Jobs the replica completed since it started.", labels=R)
        progress = {key: counter(f"rollq_replica_{key}", doc, labels=R) for key, doc in _PROGRESS_COUNTERS}
        per_replica = {name: gauge(name, doc, labels=R) for name, _, doc in _REPLICA_GAUGES}
        age = gauge("rollq_dashboard_sample_age_seconds", "Seconds since the dashboard's last good sample.", labels=Q)
        errors = counter("rollq_dashboard_sample_errors", "Samples of the queue that failed.", labels=Q)

        now = time.time()
        for queue in self.sampler.queues:
            doc = self.sampler.document(queue, history=False)
            info = doc["sampler"]
            errors.add_metric([queue], info["errors"])
            if "queue" not in doc:
                continue  # never sampled: no figures rather than zeros
            age.add_metric([queue], max(0.0, now - info["last_sample_at"]))
            q = doc["queue"]
            waiting.add_metric([queue], q["waiting"])
            in_flight.add_metric([queue], q["in_flight"])
            oldest.add_metric([queue], q["oldest_waiting_s"] or 0.0)
            dlq.add_metric([queue], q["dlq_length"])
            shards.add_metric([queue], q["shards"])
            for i, (w, f) in enumerate(zip(q["shard_waiting"], q["shard_in_flight"])):
                shard_waiting.add_metric([queue, str(i)], w)
                shard_in_flight.add_metric([queue, str(i)], f)
            for c in COUNTERS:
                jobs[c].add_metric([queue], q[c])
            lat = doc["latency"]
            bounds = [*(f"{b:g}" for b in LATENCY_BUCKETS_MS), "+Inf"]
            latency.add_metric([queue], list(zip(bounds, itertools.accumulate(lat["buckets"]))), None)
            for qn, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
                if lat[key] is not None:
                    quantile.add_metric([queue, qn], lat[key])
            if doc["versions"]["current"] is not None:
                version.add_metric([queue], doc["versions"]["current"])
            for row in doc["versions"]["lag"]["all_time"]:
                lag.add_metric([queue, str(row["lag"])], row["count"])
            for s in STATES:
                replicas.add_metric([queue, s], doc["replica_states"].get(s, 0))
            for r in doc["replicas"]:
                lab = [queue, r["id"]]
                up.add_metric(lab, 1.0 if r["lease"] else 0.0)
                state.add_metric([*lab, r["state"]], 1.0)
                paused.add_metric(lab, r["paused_s_total"] or 0.0)
                done.add_metric(lab, r["completed"] or 0)
                for key, _ in _PROGRESS_COUNTERS:
                    progress[key].add_metric(lab, r.get(key) or 0)
                for name, key, _ in _REPLICA_GAUGES:
                    if r.get(key) is not None:
                        per_replica[name].add_metric(lab, r[key])
        yield from jobs.values()
        yield from (waiting, in_flight, oldest, dlq, shards, shard_waiting, shard_in_flight, latency, quantile, version, lag, replicas, up, state, paused, done)
        yield from per_replica.values()
        yield from progress.values()
        yield from (age, errors)


def make_registry(sampler: Sampler) -> CollectorRegistry:
    """A registry of its own (not the process-wide default) holding the sampler's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SamplerCollector(sampler))
    return reg


def render(registry: Any) -> bytes:
    return generate_latest(registry)
