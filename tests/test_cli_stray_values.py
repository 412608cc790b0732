"""``rollq status`` over queues that hold stray values: each bad queue is reported as such,
naming its key, and every other queue is shown (it used to fail for every queue)."""

from __future__ import annotations

import json

from rollq.connection import connect
from tests.helpers.stray import plant
from tests.test_cli import rollq


async def test_status_reports_a_queue_with_a_stray_value_and_shows_the_others(fresh_redis):
    client = connect(fresh_redis.url)
    try:
        good, bad = await plant(client, "sv")
    finally:
        await client.aclose()
    r = rollq("status", "--json", url=fresh_redis.url)
    assert "Traceback" not in r.stderr, r.stderr
    rows = {row["queue"]: row for row in map(json.loads, r.stdout.splitlines())}
    assert set(rows) >= {good, *bad}, r.stdout + r.stderr
    assert rows[good]["submitted"] == 7 and rows[good]["version"] == 2 and rows[good]["shards"] == 3
    for name, (key, field) in bad.items():
        assert rows[name]["ok"] is False and rows[name]["key"] == key and rows[name]["field"] == field, rows[name]
        assert key in rows[name]["error"]
    assert r.returncode == 1  # some queue could not be read

    human = rollq("status", url=fresh_redis.url)
    assert "Traceback" not in human.stderr, human.stderr
    assert f"queue {good}" in human.stdout
    for name, (key, _) in bad.items():
        assert f"queue {name}: unreadable" in human.stdout and key in human.stdout, human.stdout
