"""The dashboard against a real Redis: JSON API, /metrics, replica states, dead letters, the
write guard, Redis cost per sample, ``rollq top``."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from rollq.connection import Client, connect
from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer, ReplicaInfo
from rollq.dashboard import cli as dashboard_cli
from rollq.dashboard.app import create_app, make_server
from rollq.dashboard.sampler import DashboardSettings, Sampler
from rollq.keys import QueueKeys
from rollq.producer.client import Producer
from rollq.server import free_port
from rollq.settings import ConsumerSettings
from tests.helpers import FAST as FAST_CONSUMER
from tests.helpers import bounded, until

# Every async fixture here names its loop scope, the same as the tests', so the module does not
# depend on the project's default fixture loop scope.
LOOP = "function"
pytestmark = pytest.mark.asyncio(loop_scope=LOOP)

#: Samples every 0.2 s so tests see changes quickly.
FAST = dict(interval=0.2, rate_window=1.0)
JOB = {"prompt": "hello", "sampling": {"max_tokens": 8}}


@dataclass
class Dash:
    url: str
    sampler: Sampler
    http: httpx.AsyncClient

    async def doc(self, queue: str, **params: Any) -> dict[str, Any]:
        r = await self.http.get(f"/api/queues/{queue}", params=params)
        assert r.status_code == 200, r.text
        return r.json()

    async def until_doc(self, queue: str, pred: Any, what: str, timeout: float = 15) -> dict[str, Any]:
        """Poll the API until ``pred(doc)`` holds; return that document."""
        last: dict[str, Any] = {}

        async def check() -> bool:
            nonlocal last
            last = await self.doc(queue)
            return "queue" in last and bool(pred(last))

        try:
            await until(check, timeout, what, interval=0.05)
        except AssertionError as e:
            brief = json.dumps({k: v for k, v in last.items() if k != "history"})[:3000]
            raise AssertionError(f"{e}; last document: {brief}") from None
        return last


class Rig:
    """Factories for what a dashboard test runs: Redis clients, producers, consumers, dashboards.

    Everything made is stopped and closed after the test, in reverse order of dependence.
    """

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self._clients: list[Client] = []
        self._producers: list[Producer] = []
        self._consumers: dict[Consumer, asyncio.Task] = {}
        self._servers: list[tuple[Any, asyncio.Task, httpx.AsyncClient]] = []

    def client(self, url: str | None = None) -> Client:
        c = connect(url or self.redis_url)
        self._clients.append(c)
        return c

    async def producer(self, queue: str, url: str | None = None) -> Producer:
        p = Producer(url or self.redis_url, queue)
        self._producers.append(p)
        return await p.connect()

    def consumer(self, queue: str, engine: Any = None, consumer_id: str | None = None, url: str | None = None,
                 **settings: Any) -> Consumer:
        return Consumer(engine or EchoEngine(), url or self.redis_url, queue, consumer_id=consumer_id,
                        settings=ConsumerSettings(**{**FAST_CONSUMER, **settings}))

    def start(self, c: Consumer) -> Consumer:
        self._consumers[c] = asyncio.create_task(c.run(), name=f"test-consumer-{c.id}")
        return c

    async def burst(self, c: Consumer, timeout: float = 20) -> int:
        return await bounded(c.run(burst=True), timeout, f"consumer {c.id} to drain the queue")

    async def dashboard(self, queues: list[str], url: str | None = None, token: str | None = None,
                        **settings: Any) -> Dash:
        """The app served by uvicorn on a free port in this event loop, its sampler running."""
        sampler = Sampler(url or self.redis_url, queues, DashboardSettings(**{**FAST, **settings}))
        server = make_server(create_app(sampler, token=token), port=free_port())
        task = asyncio.create_task(server.serve())
        await until(lambda: server.started or task.done(), 10, "uvicorn to start")
        assert not task.done(), task.exception()
        base = f"http://127.0.0.1:{server.config.port}"
        http = httpx.AsyncClient(base_url=base, timeout=10)
        self._servers.append((server, task, http))
        return Dash(base, sampler, http)

    async def close(self) -> None:
        for server, task, http in self._servers:
            await http.aclose()
            server.should_exit = True
            await asyncio.wait_for(task, 10)
        for c in self._consumers:
            c.stop()
        for t in self._consumers.values():
            await asyncio.wait_for(t, 15)
        for p in self._producers:
            await asyncio.wait_for(p.close(), 10)
        for c in self._clients:
            await c.aclose()


@pytest_asyncio.fixture(loop_scope=LOOP)
async def rig(redis_url):
    r = Rig(redis_url)
    yield r
    await r.close()


async def register_replica(client: Any, queue: str, replica: str, *, age_s: float = 0.0, lease: bool = True) -> None:
    """A registry entry as a consumer writes it (for replicas that run no loop)."""
    keys = QueueKeys(queue)
    now = time.time()
    info = ReplicaInfo(
        id=replica, host="h", pid=1, engine="echo", model="m", device="cpu", version=0, inflight=0, cap=8,
        kv_usage=0.25, tokens_per_s=0.0, completed=0, failed=0, started_at=now - age_s, heartbeat_at=now - age_s,
        state="serving",
    )
    await client.hset(keys.consumers, replica, msgspec.msgpack.encode(info))
    if lease:
        await client.set(keys.heartbeat(replica), b"1", px=60_000)


# ----------------------------------------------------------------------------------------
# JSON API
# ----------------------------------------------------------------------------------------
async def test_api_matches_what_was_submitted_and_completed(queue, rig):
    d = await rig.dashboard([queue])
    r = await d.http.get("/api/queues")
    assert r.status_code == 200
    assert [q["name"] for q in r.json()["queues"]] == [queue]

    # 30 jobs wait: no replica yet
    p = await rig.producer(queue)
    handles = await p.submit_many([JOB] * 30)
    # (one sample takes a few round trips, not one atomic read: wait for both figures)
    doc = await d.until_doc(queue, lambda x: x["queue"]["waiting"] == x["queue"]["submitted"] == 30, "30 waiting")
    assert doc["queue"]["in_flight"] == 0
    assert doc["queue"]["oldest_waiting_s"] is not None and doc["queue"]["oldest_waiting_s"] >= 0
    assert doc["replicas"] == []

    # a replica drains them: 8 tokens x 2 ms each
    c = rig.consumer(queue, engine=EchoEngine(delay_per_token=0.002), consumer_id="rep-a")
    rig.start(c)
    await p.gather(handles, timeout=15)
    doc = await d.until_doc(queue, lambda x: x["latency"]["all_time"]["count"] == 30, "latency of 30 results")
    q = doc["queue"]
    assert (q["waiting"], q["in_flight"], q["submitted"], q["completed"], q["failed"]) == (0, 0, 30, 30, 0)
    assert q["oldest_waiting_s"] is None and q["dlq_length"] == 0
    assert doc["latency"]["all_time"]["p50_ms"] is not None
    assert doc["latency"]["all_time"]["p50_ms"] <= doc["latency"]["all_time"]["p99_ms"]
    assert sum(doc["latency"]["buckets"]) == 30
    [rep] = doc["replicas"]
    assert rep["id"] == "rep-a" and rep["state"] == "serving" and rep["lease"] is True
    assert rep["version"] == 0 and rep["cap"] >= 1 and rep["heartbeat_age_s"] < 5
    assert doc["replica_states"]["serving"] == 1
    assert doc["versions"]["lag"]["all_time"] == [{"lag": 0, "count": 30}]
    assert doc["dead_letters"] == {"length": 0, "total": 0, "latest": []}
    assert doc["sampler"]["ok"] and doc["sampler"]["error"] is None
    # registry counters catch up at the next heartbeat
    await d.until_doc(queue, lambda x: x["replicas"][0]["completed"] == 30, "replica's own count")

    # history: parallel series, and ?since= returns only newer points
    h = doc["history"]
    assert len(h["t"]) >= 2 and all(len(v) == len(h["t"]) for v in h.values())
    assert max(h["waiting"]) == 30
    later = await d.doc(queue, since=h["t"][-1])
    assert all(t > h["t"][-1] for t in later["history"]["t"])

    # unknown queues and bad parameters
    assert (await d.http.get("/api/queues/not-watched")).status_code == 404
    assert (await d.http.get(f"/api/queues/{queue}", params={"since": "yesterday"})).status_code == 400


async def test_rates_become_positive_after_jobs(queue, rig):
    d = await rig.dashboard([queue])
    c = rig.consumer(queue, engine=EchoEngine(delay_per_token=0.001))
    rig.start(c)
    doc = await d.until_doc(queue, lambda x: x["rates"]["completed_per_s"] is not None, "a first rate")
    assert doc["rates"]["completed_per_s"] == 0 and doc["rates"]["submitted_per_s"] == 0

    p = await rig.producer(queue)
    await p.gather(await p.submit_many([JOB] * 50), timeout=15)
    doc = await d.until_doc(
        queue, lambda x: x["rates"]["submitted_per_s"] > 0 and x["rates"]["completed_per_s"] > 0, "rates > 0"
    )
    h = doc["history"]
    assert max(v or 0 for v in h["completed_per_s"]) > 0
    # the rates come back to zero once the counters stop moving (1 s window)
    await d.until_doc(queue, lambda x: x["rates"]["completed_per_s"] == 0, "rates back to 0")


async def test_replica_goes_stale_then_dead_when_its_lease_is_gone(queue, redis_url, spawn, rig):  # noqa: F811
    client = rig.client()
    d = await rig.dashboard([queue], dead_after=4.0)
    # a replica in a process of its own, with a lease that would outlive the test
    proc = await spawn(redis_url, queue, "rep-proc", 0, lease_ttl=60, heartbeat=0.2).ready()
    await d.until_doc(queue, lambda x: [r["state"] for r in x["replicas"]] == ["serving"], "replica serving")

    proc.kill()
    await client.delete(QueueKeys(queue).heartbeat("rep-proc"))
    doc = await d.until_doc(queue, lambda x: x["replicas"][0]["state"] == "stale", "replica stale")
    rep = doc["replicas"][0]
    assert rep["lease"] is False and rep["reported_state"] == "serving" and rep["heartbeat_age_s"] < 4.0
    assert doc["replica_states"]["stale"] == 1 and doc["replica_states"]["serving"] == 0

    doc = await d.until_doc(queue, lambda x: x["replicas"][0]["state"] == "dead", "replica dead", timeout=10)
    assert doc["replicas"][0]["heartbeat_age_s"] > 4.0 and doc["replica_states"]["dead"] == 1


async def test_dead_letters_appear_with_their_reason(queue, rig):
    client = rig.client()
    d = await rig.dashboard([queue])
    rig.start(rig.consumer(queue))
    await client.xadd(QueueKeys(queue).jobs, {b"d": b"garbage"})
    doc = await d.until_doc(queue, lambda x: x["dead_letters"]["latest"], "a dead letter")
    dl = doc["dead_letters"]
    assert dl["length"] == 1 and dl["total"] == 1
    [entry] = dl["latest"]
    assert entry["error_type"] == "JobRejected" and "msgpack" in entry["reason"]
    assert entry["source"] == QueueKeys(queue).jobs and entry["requeueable"] is False
    assert entry["deliveries"] == 1 and entry["at"] > 0 and entry["entry_id"]
    assert doc["queue"]["dlq_length"] == 1 and doc["queue"]["failed"] == 1 and doc["queue"]["dead_lettered"] == 1

    # a second one shows up first (newest first)
    await client.xadd(QueueKeys(queue).jobs, {b"other": b"1"})
    doc = await d.until_doc(queue, lambda x: len(x["dead_letters"]["latest"]) == 2, "two dead letters")
    assert "no 'd' field" in doc["dead_letters"]["latest"][0]["reason"]


async def test_versions_timeline_and_lag(queue, rig):
    from rollq.weightsync.versions import VersionRecord, commit_version

    client = rig.client()
    d = await rig.dashboard([queue])
    keys = QueueKeys(queue)
    c = rig.consumer(queue, consumer_id="rep-v")
    rig.start(c)
    for v in (1, 2, 3):
        rec = VersionRecord(version=v, transport="memmap", checksum=f"c{v}", num_tensors=4, nbytes=1 << 20,
                            trainer="t0")
        assert await commit_version(client, keys, rec)
    c.version = 2  # this replica loaded v2 and is one behind
    p = await rig.producer(queue)
    await p.gather(await p.submit_many([JOB] * 5), timeout=10)
    doc = await d.until_doc(
        queue, lambda x: x["versions"]["current"] == 3 and x["replicas"] and x["replicas"][0]["version"] == 2
        and x["versions"]["lag"]["all_time"], "version 3 and the replica at 2",
    )
    log = doc["versions"]["log"]
    assert [v["version"] for v in log] == [3, 2, 1]
    assert log[0]["transport"] == "memmap" and log[0]["nbytes"] == 1 << 20 and log[0]["trainer"] == "t0"
    assert log[0]["published_at"] >= log[-1]["published_at"]
    assert doc["replicas"][0]["versions_behind"] == 1
    assert doc["versions"]["lag"]["all_time"] == [{"lag": 0, "count": 5}]
    assert doc["versions"]["lag"]["recent"] == [{"lag": 0, "count": 5}]


# ----------------------------------------------------------------------------------------
# /metrics, the page, health
# ----------------------------------------------------------------------------------------
async def test_metrics_parse_and_carry_the_queue_figures(queue, rig):
    d = await rig.dashboard([queue])
    c = rig.consumer(queue, consumer_id="rep-m")
    rig.start(c)
    p = await rig.producer(queue)
    await p.gather(await p.submit_many([JOB] * 12), timeout=10)
    await d.until_doc(
        queue, lambda x: x["latency"]["all_time"]["count"] == 12 and x["versions"]["lag"]["all_time"], "12 results"
    )

    r = await d.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[tuple[str, tuple], float] = {}
    types = {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"queue": queue, **labels}.items())))]

    assert get("rollq_queue_waiting") == 0 and get("rollq_queue_in_flight") == 0
    assert get("rollq_jobs_submitted_total") == 12 and get("rollq_jobs_completed_total") == 12
    assert get("rollq_jobs_failed_total") == 0 and get("rollq_queue_dead_letters") == 0
    assert types["rollq_jobs_completed"] == "counter" and types["rollq_latency_ms"] == "histogram"
    assert get("rollq_latency_ms_bucket", le="+Inf") == 12
    assert get("rollq_latency_ms_bucket", le="0.5") <= get("rollq_latency_ms_bucket", le="300000") == 12
    assert get("rollq_policy_lag_results_total", lag="0") == 12
    assert get("rollq_replica_inflight", replica="rep-m") == 0
    assert get("rollq_replica_policy_version", replica="rep-m") == 0
    assert get("rollq_replica_up", replica="rep-m") == 1
    assert get("rollq_replica_state", replica="rep-m", state="serving") == 1
    assert get("rollq_replica_progress_sent_total", replica="rep-m") == 0  # no job was streamed
    assert types["rollq_replica_progress_dropped"] == "counter"
    assert get("rollq_replicas", state="serving") == 1 and get("rollq_replicas", state="dead") == 0
    assert get("rollq_dashboard_sample_errors_total") == 0

    # every metric the Grafana dashboard charts is one /metrics exposes
    suffix = {"counter": "_total", "histogram": "_bucket"}
    exposed = {name + suffix.get(kind, "") for name, kind in types.items()}
    grafana = (Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "rollq.json").read_text()
    charted = set(re.findall(r"\brollq_[a-z_]+", grafana))
    assert charted and charted <= exposed, charted - exposed


async def test_page_and_assets_are_served_locally(queue, rig):
    d = await rig.dashboard([queue])
    r = await d.http.get("/")
    assert r.status_code == 200 and "<title>rollq dashboard</title>" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for asset in ("/static/app.js", "/static/style.css"):
        assert (await d.http.get(asset)).status_code == 200
    static = Path(__file__).resolve().parents[2] / "rollq" / "dashboard" / "static"
    for f in static.iterdir():
        text = f.read_text()
        # nothing from a CDN: the only absolute URL is the SVG namespace
        assert text.replace("http://www.w3.org/2000/svg", "").count("://") == 0, f


async def test_unreachable_redis_is_reported_not_raised(queue, rig):
    d = await rig.dashboard([queue], url=f"redis://127.0.0.1:{free_port()}/0")
    await until(lambda: d.sampler.sampler_info(queue)["errors"] >= 1, 10, "a failed sample")
    doc = await d.doc(queue)
    assert doc["sampler"]["ok"] is False and "unreachable" in doc["sampler"]["error"]
    assert "queue" not in doc  # never sampled: no figures rather than zeros
    assert (await d.http.get("/healthz")).status_code == 503
    m = (await d.http.get("/metrics")).text
    assert f'rollq_dashboard_sample_errors_total{{queue="{queue}"}}' in m


# ----------------------------------------------------------------------------------------
# the write endpoint and its bearer token
# ----------------------------------------------------------------------------------------
async def test_requeue_needs_the_bearer_token(queue, rig):
    # a valid job the engine refuses (prompt + max_tokens > context): dead-lettered, requeueable
    p = await rig.producer(queue)
    await p.submit_many([{"prompt": "hello", "sampling": {"max_tokens": 100}}])
    await rig.burst(rig.consumer(queue, engine=EchoEngine(max_model_len=16)))

    d = await rig.dashboard([queue], token="s3cret")
    doc = await d.until_doc(queue, lambda x: x["dead_letters"]["latest"], "the dead letter")
    entry = doc["dead_letters"]["latest"][0]
    assert entry["requeueable"] is True

    url = f"/api/queues/{queue}/dlq/requeue"
    r = await d.http.post(url)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert (await d.http.post(url, headers={"Authorization": "Bearer wrong"})).status_code == 401
    assert (await d.http.post(url, headers={"Authorization": "Basic s3cret"})).status_code == 401
    assert (await d.doc(queue))["queue"]["dlq_length"] == 1  # nothing happened
    # reads need no token
    assert (await d.http.get(f"/api/queues/{queue}")).status_code == 200

    auth = {"Authorization": "Bearer s3cret"}
    assert (await d.http.post(url, headers=auth, content=b'{"entry_ids": 5}')).status_code == 400
    assert (await d.http.post(url, headers=auth, json={"entry_ids": ["not-an-id"]})).status_code == 400
    r = await d.http.post(url, headers=auth, json={"entry_ids": [entry["entry_id"]]})
    assert r.status_code == 200 and r.json() == {"requeued": 1, "skipped": 0}
    doc = await d.doc(queue)  # the endpoint re-samples before answering
    assert doc["queue"]["dlq_length"] == 0 and doc["queue"]["waiting"] == 1


async def test_writes_are_disabled_without_a_token(queue, monkeypatch, rig):
    monkeypatch.delenv("ROLLQ_DASHBOARD_TOKEN", raising=False)
    d = await rig.dashboard([queue])
    r = await d.http.post(f"/api/queues/{queue}/dlq/requeue", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "disabled" in r.json()["error"]


async def test_token_comes_from_the_environment(monkeypatch):
    from rollq.dashboard.app import resolve_token

    monkeypatch.setenv("ROLLQ_DASHBOARD_TOKEN", "from-env")
    assert resolve_token(None) == "from-env" and resolve_token("flag") == "flag"
    monkeypatch.setenv("ROLLQ_DASHBOARD_TOKEN", "")
    assert resolve_token(None) is None


# ----------------------------------------------------------------------------------------
# Redis cost
# ----------------------------------------------------------------------------------------
async def _commands(client: Any) -> int:
    """Commands Redis executed so far, INFO itself excluded."""
    stats = await client.info("commandstats")
    n = 0
    for name, st in stats.items():
        if name != "cmdstat_info":
            n += int(st.get("calls", 0)) + int(st.get("rejected_calls", 0))  # calls include failed calls
    return n


async def test_commands_per_sample_do_not_grow_with_jobs(fresh_redis, rig):
    """Redis commands of one sample, counted with INFO commandstats on a Redis of its own
    while nothing else talks to it."""
    url, queue = fresh_redis.url, "cost"
    keys = QueueKeys(queue)
    client = rig.client(url)
    # something to show: 200 results, a dead letter, two registered replicas
    p = await rig.producer(queue, url=url)
    handles = await p.submit_many([JOB] * 200)
    await client.xadd(keys.jobs, {b"d": b"garbage"})
    await rig.burst(rig.consumer(queue, url=url))
    await p.gather(handles, timeout=20)
    await p.close()
    for name in ("ghost-1", "ghost-2"):
        await register_replica(client, queue, name)

    sampler = Sampler(url, [queue], DashboardSettings(refresh_lists=3600))
    async with sampler:
        await sampler.sample(queue)  # connects; reads the versions log and dead letters once

        async def cost() -> int:
            before = await _commands(client)
            await sampler.sample(queue)
            return await _commands(client) - before

        idle = await cost()
        raw = [{"prompt": "x", "sampling": {"max_tokens": 4}}]
        p = await rig.producer(queue, url=url)
        await p.submit_many(raw * 10)
        await p.close()
        with_10 = await cost()
        p = await rig.producer(queue, url=url)
        await p.submit_many(raw * 5000)
        await p.close()
        with_5010 = await cost()
        doc = sampler.document(queue, history=False)
        assert doc["queue"]["waiting"] == 5010 and len(doc["replicas"]) == 2

        # one more replica: 3 more commands (lease, its stream's length and group)
        await register_replica(client, queue, "ghost-3")
        await sampler.sample(queue)
        with_3_replicas = await cost()
    R = 2
    assert idle == 9 + 3 * R, idle  # queue_status 7 + 3R, latency and lag histograms 2
    assert with_10 == with_5010 == idle + 1  # + the oldest waiting entry (XRANGE COUNT 1)
    assert with_3_replicas == with_5010 + 3
    print(f"\nredis commands per sample: idle {idle}, with waiting jobs {with_10} (2 replicas); +3 per replica")


# ----------------------------------------------------------------------------------------
# rollq top and the CLI
# ----------------------------------------------------------------------------------------
async def test_top_once_renders(queue, redis_url, capsys, rig):
    rig.start(rig.consumer(queue, consumer_id="rep-top"))
    p = await rig.producer(queue)
    await p.gather(await p.submit_many([JOB] * 3), timeout=10)
    client = rig.client()

    async def serving() -> bool:  # the registry entry written after the first jobs
        return b"serving" in (await client.hget(QueueKeys(queue).consumers, "rep-top") or b"")

    await until(serving, 5, "the replica to report serving")
    # asyncio.run in a thread of its own, as the command runs
    rc = await asyncio.to_thread(dashboard_cli.main, ["top", "--once", "--url", redis_url, "-q", queue])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("queues", queue, "replicas", "rep-top", "serving"):
        assert text in out, out
    rc = await asyncio.to_thread(dashboard_cli.main, ["top", "--json", "--url", redis_url, "-q", queue])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["queue"]["completed"] == 3 and doc["replicas"][0]["id"] == "rep-top"


async def test_register_adds_both_commands():
    import argparse

    p = argparse.ArgumentParser()
    dashboard_cli.register(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(["dashboard", "-q", "a", "-q", "b", "--port", "9000", "--token", "t"])
    assert a.fn is dashboard_cli.cmd_dashboard and a.queues == ["a", "b"] and a.port == 9000 and a.token == "t"
    assert a.host == "127.0.0.1"
    a = p.parse_args(["top", "--once"])
    assert a.fn is dashboard_cli.cmd_top and a.once and a.queues is None


class _LosesOneCancel(Sampler):
    """A sampler whose round loses the first cancellation that lands in it, as Python 3.11's
    ``wait_for`` does when a Redis call's own timeout fires at the moment of the cancel."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.inside = asyncio.Event()
        self.lost = 0

    async def sample_all(self) -> None:
        await super().sample_all()
        self.inside.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            self.lost += 1
            if self.lost > 1:
                raise
        finally:
            self.inside.clear()


async def test_close_ends_the_loop_even_when_a_cancel_is_lost(queue, redis_url):
    sampler = _LosesOneCancel(redis_url, [queue], DashboardSettings(interval=0.01))
    sampler.start()
    await bounded(sampler.inside.wait(), 10, "a sampling round")
    await bounded(sampler.close(), 5, "the sampler to close")
    assert sampler.lost == 1
