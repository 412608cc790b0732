"""The dashboard over a sharded queue: the JSON API, ``/metrics`` and ``rollq top`` show the
figures summed over the shards with each shard's depth beside them, the requeue endpoint takes
dead letters by their shard-qualified name, and a sample's Redis cost grows by a fixed number
of commands per shard. Jobs are placed as in tests/test_cli_shards.py (SUBMIT per shard)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from rollq.dashboard.sampler import DashboardSettings, Sampler
from rollq.dashboard.top import render_top
from rollq.keys import QueueKeys
from rollq.shards import declare_shards
from tests.dashboard.test_dashboard import LOOP, _commands, rig  # noqa: F401
from tests.test_cli_shards import K, PLACED, TAKEN, WAITING, dead_letter, place, sharded, take

pytestmark = pytest.mark.asyncio(loop_scope=LOOP)


async def test_api_metrics_and_top_show_sums_and_each_shard(queue, rig):  # noqa: F811
    client = rig.client()
    keys = await sharded(client, queue)
    d = await rig.dashboard([queue], token="tok")
    doc = await d.until_doc(queue, lambda x: x["queue"]["shards"] == K, "the shard count")
    q = doc["queue"]
    assert q["shard_waiting"] == WAITING and q["waiting"] == sum(WAITING)
    assert q["shard_in_flight"] == TAKEN and q["in_flight"] == sum(TAKEN)
    assert q["submitted"] == sum(PLACED) and q["dlq_length"] == 2
    assert doc["history"]["waiting"][-1] == sum(WAITING)
    latest = doc["dead_letters"]["latest"]
    assert sorted(x["shard"] for x in latest) == [1, 3]
    assert all(x["ref"] == f"{x['shard']}/{x['entry_id']}" for x in latest)

    (line,) = (await d.http.get("/api/queues")).json()["queues"]
    assert line["shards"] == K and line["waiting"] == sum(WAITING)

    text = (await d.http.get("/metrics")).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("rollq_queue_shards", (("queue", queue),))] == K
    assert samples[("rollq_queue_waiting", (("queue", queue),))] == sum(WAITING)
    for i in range(K):
        assert samples[("rollq_queue_shard_waiting", (("queue", queue), ("shard", str(i))))] == WAITING[i]
        assert samples[("rollq_queue_shard_in_flight", (("queue", queue), ("shard", str(i))))] == TAKEN[i]

    console = Console(record=True, width=200)
    console.print(render_top([d.sampler.document(queue, history=False)]))
    out = console.export_text()
    assert "shards (queues of more than one)" in out
    rows = [line.split() for line in out.splitlines()]
    assert [queue, "0", str(WAITING[0]), "0"] in rows and ["2", str(WAITING[2]), str(TAKEN[2])] in rows

    # requeue by the name the page shows: back onto that shard only
    shard3 = next(x for x in latest if x["shard"] == 3)
    r = await d.http.post(f"/api/queues/{queue}/dlq/requeue", json={"entry_ids": [shard3["ref"]]},
                          headers={"Authorization": "Bearer tok"})
    assert r.status_code == 200 and r.json() == {"requeued": 1, "skipped": 0}, r.text
    assert await client.xlen(keys.shard(3).dlq) == 0 and await client.xlen(keys.shard(1).dlq) == 1
    doc = await d.until_doc(queue, lambda x: x["queue"]["dlq_length"] == 1, "the requeue to show")
    assert doc["queue"]["shard_waiting"][3] == WAITING[3] + 1
    r = await d.http.post(f"/api/queues/{queue}/dlq/requeue", json={"entry_ids": ["7/1-0"]},
                          headers={"Authorization": "Bearer tok"})
    assert r.status_code == 400 and "shards 0-3" in r.json()["error"], r.text


async def test_unsharded_document_has_one_shard(queue, rig):  # noqa: F811
    client = rig.client()
    await place(client, QueueKeys(queue), 2)
    d = await rig.dashboard([queue])
    doc = await d.until_doc(queue, lambda x: x["queue"]["waiting"] == 2, "two waiting jobs")
    assert (doc["queue"]["shards"], doc["queue"]["shard_waiting"], doc["queue"]["shard_in_flight"]) == (1, [2], [0])
    console = Console(record=True, width=200)
    console.print(render_top([d.sampler.document(queue, history=False)]))
    assert "shards (queues" not in console.export_text()


async def test_commands_per_sample_grow_by_four_per_extra_shard(fresh_redis, rig):  # noqa: F811
    """On a Redis of its own: each shard beyond the first adds its counters, dead letters,
    stream length and group (4 commands), one more while its jobs wait; the shard count is
    read at the first sample and with the lists, not every sample."""
    url, queue = fresh_redis.url, "cost-sharded"
    keys = QueueKeys(queue)
    client = rig.client(url)
    await declare_shards(client, keys, K)
    for part in keys.shards(K):
        await take(client, part, 0)  # the groups exist, as once a replica has started
    sampler = Sampler(url, [queue], DashboardSettings(refresh_lists=3600))
    async with sampler:
        await sampler.sample(queue)  # reads the shard count, the versions log and dead letters once

        async def cost() -> int:
            before = await _commands(client)
            await sampler.sample(queue)
            return await _commands(client) - before

        idle = await cost()
        await place(client, keys.shard(1), 2)
        await place(client, keys.shard(3), 1)
        waiting = await cost()
        assert sampler.document(queue, history=False)["queue"]["shard_waiting"] == [0, 2, 0, 1]
    assert idle == 9 + 4 * (K - 1), idle  # the unsharded sample's 9, no replica registered
    assert waiting == idle + 2  # the oldest waiting entry of each shard with jobs (XRANGE COUNT 1)


async def test_dead_letters_of_every_shard_newest_first(queue, rig):  # noqa: F811
    client = rig.client()
    keys = QueueKeys(queue)
    await declare_shards(client, keys, K)
    await dead_letter(client, keys.shard(2), entry_id="1000-0")
    await dead_letter(client, keys.shard(0), entry_id="3000-0")
    await dead_letter(client, keys.shard(3), entry_id="2000-0")
    d = await rig.dashboard([queue], dead_letters=2)
    doc = await d.until_doc(queue, lambda x: x["dead_letters"]["length"] == 3, "three dead letters")
    assert [x["ref"] for x in doc["dead_letters"]["latest"]] == ["0/3000-0", "3/2000-0"]
