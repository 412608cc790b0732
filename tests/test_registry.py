"""The registry of queue names in use (rollq/registry.py): producers register their queue when
they connect, consumers when they start and at every heartbeat; ``rollq status``, ``rollq top``
and the dashboard list every queue from it (no SCAN) when no ``--queue`` is given.

Each test runs a redis-server of its own: the registry is one key for the whole server, so on
the shared server every other test's queues would be listed too.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import pytest_asyncio

from rollq.dashboard import cli as dashboard_cli
from rollq.keys import QUEUES, QueueKeys
from rollq.registry import QUEUE_WINDOW, known_queues, queues_in_use
from tests import cluster_fixtures
from tests.helpers import until
from tests.test_cli import ROOT, rollq
from tests.dashboard.test_dashboard import JOB, LOOP, Rig

pytestmark = pytest.mark.asyncio(loop_scope=LOOP)
redis_cluster = cluster_fixtures.redis_cluster  # a fixture: this module gets a cluster of its own


@pytest_asyncio.fixture(loop_scope=LOOP)
async def rig(fresh_redis):
    r = Rig(fresh_redis.url)
    yield r
    await r.close()


async def _cli(*args: str, url: str) -> subprocess.CompletedProcess:
    """``rollq ARGS`` as a subprocess, off the event loop (consumers may be running in it)."""
    r = await asyncio.to_thread(rollq, *args, url=url)
    assert r.returncode == 0, r.stderr
    return r


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def _calls(client, command: str) -> int:
    st = (await client.info("commandstats")).get(f"cmdstat_{command}", {})
    return int(st.get("calls", 0))


# ----------------------------------------------------------------------------------------
# rollq status
# ----------------------------------------------------------------------------------------
async def test_status_without_queue_lists_a_producers_and_a_consumers_queue(fresh_redis, rig):
    url = fresh_redis.url
    p = await rig.producer("a")  # registers at connect
    await p.submit_many([JOB] * 2)  # waits in "a": nobody consumes it
    rig.start(rig.consumer("b", consumer_id="rb"))  # registers at start
    client = rig.client()
    await until(lambda: client.hexists(QueueKeys("b").consumers, "rb"), 10, "the consumer of b to register")

    docs = _json_lines((await _cli("status", "--json", url=url)).stdout)
    assert [d["queue"] for d in docs] == ["a", "b"], docs  # default holds nothing: not listed
    a, b = docs
    assert a["depth"] == 2 and a["submitted"] == 2 and a["replicas"] == []
    assert b["depth"] == 0 and [r["id"] for r in b["replicas"]] == ["rb"]

    human = (await _cli("status", url=url)).stdout
    assert "queue a" in human and "queue b" in human and "rb" in human, human

    # --queue: that queue only, one object, as before
    (only,) = _json_lines((await _cli("status", "--queue", "b", "--json", url=url)).stdout)
    assert only["queue"] == "b"
    (empty,) = _json_lines((await _cli("status", "--queue", "default", "--json", url=url)).stdout)
    assert empty["queue"] == "default" and empty["submitted"] == 0


async def test_status_parser_defaults_to_every_queue():
    from rollq.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["status"]).queue is None
    assert p.parse_args(["status", "-q", "x"]).queue == "x"
    assert p.parse_args(["dlq", "list"]).queue == "default"  # other commands keep their default
    help_text = subprocess.run(
        [sys.executable, "-m", "rollq.cli", "status", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60,
    ).stdout
    assert "every queue in use" in help_text and "None" not in help_text, help_text


# ----------------------------------------------------------------------------------------
# reading the registry
# ----------------------------------------------------------------------------------------
async def test_stale_and_bad_names_are_not_listed(fresh_redis, rig):
    client = rig.client()
    now = time.time()
    await client.zadd(QUEUES, {
        "fresh": now, "old": now - QUEUE_WINDOW - 60,
        # written by anything that can write Redis: names no queue can have are skipped
        "bad name": now, "x{y}": now, "a:b": now, "x" * 129: now, "ünï".encode(): now, b"\xff\xfe": now,
    })
    assert await known_queues(client) == ["fresh"]
    assert await known_queues(client, within=QUEUE_WINDOW + 3600) == ["fresh", "old"]
    docs = _json_lines((await _cli("status", "--json", url=fresh_redis.url)).stdout)
    assert [d["queue"] for d in docs] == ["fresh"]
    # readers read: nothing was pruned by them
    assert await client.zscore(QUEUES, "old") is not None and await client.zcard(QUEUES) == 8

    # a registration prunes what is older than the window
    await rig.producer("fresh")
    assert await client.zscore(QUEUES, "old") is None
    assert await client.zscore(QUEUES, "fresh") >= now
    assert await known_queues(client) == ["fresh"]


async def test_default_is_listed_when_it_holds_data_or_nothing_is_known(rig):
    client = rig.client()
    assert await queues_in_use(client) == ["default"]  # nothing known: the default queue, empty
    await client.zadd(QUEUES, {"a": time.time()})
    assert await queues_in_use(client) == ["a"]  # default empty: not listed
    await client.hincrby(QueueKeys("default").stats, "submitted", 1)  # used before the registry existed
    assert await queues_in_use(client) == ["a", "default"]


# ----------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------
async def test_producer_registers_once_per_connect_not_per_submit(rig):
    client = rig.client()
    p = await rig.producer("a")
    assert await client.zscore(QUEUES, "a") is not None
    assert await _calls(client, "zadd") == 1
    await p.submit_many([JOB] * 50)
    await p.submit(**JOB)
    assert await _calls(client, "zadd") == 1  # the submit path costs no registry command
    await p.close()
    await rig.producer("a")
    assert await _calls(client, "zadd") == 2


async def test_consumer_registers_at_start_and_refreshes_on_its_heartbeat(rig):
    client = rig.client()
    rig.start(rig.consumer("b", consumer_id="rb", heartbeat_interval=0.1))
    await until(lambda: client.zscore(QUEUES, "b"), 10, "the consumer to register its queue")
    first = await client.zscore(QUEUES, "b")
    await until(lambda: _later(client, "b", first), 5, "a heartbeat to refresh the registration")
    # pruning happens at start only, not at every heartbeat
    assert await _calls(client, "zremrangebyscore") == 1


async def _later(client, queue: str, than: float) -> bool:
    return (await client.zscore(QUEUES, queue) or 0) > than


async def test_a_user_without_the_registry_key_still_submits_and_consumes(fresh_redis, rig):
    """An ACL user allowed only its queue's keys: registration is refused and skipped (the
    queue is just not listed); nothing else fails."""
    client = rig.client()
    await client.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~rollq:{a}:*", "&*", "+@all")
    url = fresh_redis.url.replace("redis://", "redis://limited:pw@")
    p = await rig.producer("a", url=url)
    handles = await p.submit_many([JOB] * 3)
    await rig.burst(rig.consumer("a", url=url))
    assert all(r.ok for r in await p.gather(handles, timeout=10))
    assert await client.zcard(QUEUES) == 0


# ----------------------------------------------------------------------------------------
# the dashboard and rollq top
# ----------------------------------------------------------------------------------------
async def test_dashboard_without_queues_lists_every_queue_in_use(fresh_redis, rig):
    p = await rig.producer("a")
    await p.submit_many([JOB] * 2)
    rig.start(rig.consumer("b", consumer_id="rb"))
    client = rig.client()
    await until(lambda: client.zscore(QUEUES, "b"), 10, "the consumer of b to register")

    d = await rig.dashboard(None)
    r = await d.http.get("/api/queues")
    assert r.status_code == 200
    assert [q["name"] for q in r.json()["queues"]] == ["a", "b"]
    await d.until_doc("a", lambda doc: doc["queue"]["waiting"] == 2, "queue a's jobs")
    await d.until_doc("b", lambda doc: [x["id"] for x in doc["replicas"]] == ["rb"], "queue b's replica")

    # a queue used after the dashboard started shows up at its next sample
    await rig.producer("c")

    async def listed() -> bool:
        return [q["name"] for q in (await d.http.get("/api/queues")).json()["queues"]] == ["a", "b", "c"]

    await until(listed, 10, "queue c to be listed")
    await d.until_doc("c", lambda doc: doc["queue"]["waiting"] == 0, "queue c's document")
    assert (await d.http.get("/api/queues/never-used")).status_code == 404
    # reading wrote nothing: the registry holds what producers and consumers put there
    assert sorted(n.decode() for n in await client.zrange(QUEUES, 0, -1)) == ["a", "b", "c"]


async def test_dashboard_with_queues_watches_only_those(fresh_redis, rig):
    await rig.producer("a")
    await rig.producer("b")
    d = await rig.dashboard(["b"])
    assert [q["name"] for q in (await d.http.get("/api/queues")).json()["queues"]] == ["b"]
    assert (await d.http.get("/api/queues/a")).status_code == 404


async def test_top_json_without_queue_prints_every_queue(fresh_redis, rig, capsys):
    await rig.producer("a")
    await rig.producer("b")
    rc = await asyncio.to_thread(dashboard_cli.main, ["top", "--json", "--url", fresh_redis.url])
    docs = _json_lines(capsys.readouterr().out)
    assert rc == 0 and [d["name"] for d in docs] == ["a", "b"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to parse the page's script")
async def test_page_script_parses():
    r = subprocess.run(["node", "--check", str(ROOT / "rollq" / "dashboard" / "static" / "app.js")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------------------
# Redis Cluster: the registry is one key on one node, queues live on every node
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
async def test_registry_on_a_cluster(redis_cluster):
    import redis as redis_sync

    queues = redis_cluster.queues_on_every_node(prefix="reg")
    r = Rig(redis_cluster.url)
    try:
        for q in queues[:-1]:
            await r.producer(q)
        await r.burst(r.consumer(queues[-1], consumer_id="rc"))  # start, heartbeat, drain, stop
        docs = _json_lines((await _cli("status", "--json", url=redis_cluster.url)).stdout)
        listed = [d["queue"] for d in docs]
        assert listed == sorted(queues), listed  # this module's own cluster: nothing else registered
    finally:
        await r.close()
    holders = []  # nodes holding the registry (a test-only SCAN on each node)
    for i in range(len(redis_cluster.nodes)):
        with redis_sync.Redis.from_url(redis_cluster.node_url(i)) as c:
            holders += [i] if list(c.scan_iter(match=QUEUES, count=1000)) else []
    assert len(holders) == 1, holders


@pytest.mark.browser
async def test_page_lists_every_queue_in_use_and_follows_new_ones(fresh_redis, rig):
    """The page in headless Chromium (skipped without it, as tests/dashboard/test_browser.py)."""
    from tests.dashboard.test_browser import ARGS, CHROMIUM

    try:
        from playwright.async_api import async_playwright, expect
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install -y chromium, or set ROLLQ_CHROMIUM)")
    p = await rig.producer("a")
    await p.submit_many([JOB] * 2)
    rig.start(rig.consumer("b", consumer_id="rb"))
    client = rig.client()
    await until(lambda: client.zscore(QUEUES, "b"), 10, "the consumer of b to register")
    d = await rig.dashboard(None, interval=0.5)

    errors: list[str] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page()
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            await page.goto(f"{d.url}/")
            buttons = page.locator("#queues button")
            await expect(buttons).to_have_text(["a", "b"])
            await expect(page.locator("#queues button.active")).to_have_text("a")  # the first queue
            await expect(page.locator("[data-k='waiting']")).to_have_text("2")
            await page.locator("#queues button", has_text="b").click()
            await expect(page.locator("tr[data-replica='rb']")).to_have_count(1)
            await rig.producer("c")  # a queue used later gets its button; the selection stays
            await expect(buttons).to_have_text(["a", "b", "c"], timeout=20_000)
            await expect(page.locator("#queues button.active")).to_have_text("b")
        finally:
            await browser.close()
    assert not errors, errors
