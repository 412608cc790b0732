"""The dashboard's sampler and ``rollq top`` over queues that hold stray values: each bad
queue is shown as unreadable, naming its key, without a traceback; the others as usual."""

from __future__ import annotations

import logging

from rich.console import Console

from rollq.connection import connect
from rollq.dashboard.sampler import DashboardSettings, Sampler
from rollq.dashboard.top import render_top
from tests.helpers.stray import plant


async def test_sampler_and_top_name_the_stray_value_and_show_the_other_queues(fresh_redis, caplog):
    caplog.set_level(logging.INFO, logger="rollq")
    client = connect(fresh_redis.url)
    try:
        good, bad = await plant(client, "sv")
    finally:
        await client.aclose()
    async with Sampler(fresh_redis.url, None, DashboardSettings(interval=0.1)) as s:
        await s.sample_all()
        assert set(s.queues) >= {good, *bad}
        assert s.sampler_info(good)["ok"] and s.document(good)["queue"]["submitted"] == 7
        for name, (key, _) in bad.items():
            info = s.sampler_info(name)
            assert not info["ok"] and key in info["error"] and "unreadable" in info["error"], (name, info)
        docs = [s.document(q, history=False) for q in s.queues]
    console = Console(width=400, record=True)
    console.print(render_top(docs))
    frame = console.export_text()
    assert good in frame and all(key in frame for key, _ in bad.values()), frame
    assert not [r.getMessage() for r in caplog.records if r.exc_info], "a stray value is a line, not a traceback"
    assert "Traceback" not in caplog.text
