"""The producer's result readers keep reading whatever goes wrong in one read."""

from __future__ import annotations

import pytest

from rollq.producer import _results as results_mod
from tests.helpers import bounded


@pytest.mark.parametrize("shards", [1, 3])
async def test_a_reader_survives_an_unexpected_error_in_a_read(queue, make_producer, make_consumer, monkeypatch, caplog, shards):
    """A read that fails with an error no retry list names (here a TypeError, as a client
    library's own bug would raise) is logged with its traceback and read again; a reader that
    ended there would leave its stream's results unread for good."""
    fails = {"left": 2}
    real_once, real_pipelined = results_mod.ResultReader._read_once, results_mod.ResultReader._read_pipelined

    def flaky(real):
        async def read(self, *args, **kwargs):
            if fails["left"] > 0:
                fails["left"] -= 1
                raise TypeError("'NoneType' object is not callable")
            return await real(self, *args, **kwargs)

        return read

    monkeypatch.setattr(results_mod.ResultReader, "_read_once", flaky(real_once))
    monkeypatch.setattr(results_mod.ResultReader, "_read_pipelined", flaky(real_pipelined))
    monkeypatch.setattr(results_mod, "READ_BACKOFF", (0.01, 0.05))
    p = await make_producer(queue, shards=shards)
    hs = await p.submit_many([{"prompt": f"r{i}", "sampling": {"max_tokens": 1}} for i in range(12)])
    assert await make_consumer.burst(make_consumer(queue, shards=shards)) == 0
    rs = await bounded(p.gather(hs), 20, "every result after the failed reads")
    assert len(rs) == 12 and all(r.ok for r in rs)
    assert fails["left"] == 0
    assert "failed unexpectedly" in caplog.text and "TypeError" in caplog.text


async def test_after_a_long_run_of_cuts_the_reader_waits_no_longer_than_a_fraction_of_a_second(
        redis_server, queue, caplog):
    """Used to: each cut doubled the wait between reads up to 5 s, though Redis answered
    every reconnect, so results waited up to 5 s after the cuts ended."""
    import asyncio
    import logging
    import re

    from rollq.connection import connect, raw_replies
    from rollq.keys import QueueKeys
    from rollq.protocol import Result, encode_result
    from rollq.testing.chaos import CutProxy
    from tests.helpers import until
    from tests.helpers.blocked import addrs_of_writers, blocked_in

    caplog.set_level(logging.WARNING, logger="rollq.producer._results")
    proxy = await CutProxy(redis_server.port).start()
    client = raw_replies(connect(proxy.url, socket_timeout=None), "XREAD")
    key = QueueKeys(queue).results("p1")
    got: list[Result] = []
    reader = results_mod.ResultReader(client, [key], count=100, command_timeout=2.0, cluster=False,
                                      deliver=got.append, arrived=asyncio.Event())
    task = asyncio.create_task(reader.run())
    admin = connect(redis_server.url)

    async def xread_blocked() -> bool:  # through the proxy: its upstream end is the client
        return bool(addrs_of_writers(up for _, up in proxy._pipes) & await blocked_in(admin, "xread"))

    try:
        for i in range(10):  # each cut ends a blocking read whose connection Redis accepted
            await until(xread_blocked, 30, f"the reader's XREAD blocked again (cut {i})")
            proxy.cut()
        await until(lambda: len(re.findall(r"retrying in", caplog.text)) >= 10, 30, "the last cut's failed read")
        waits = [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", caplog.text)]
        assert max(waits) <= 0.25, waits  # a fraction of a second, not up to 5 s
        assert reader.delay <= results_mod.ANSWERED_BACKOFF
        writer = connect(redis_server.url)
        await writer.xadd(key, {"d": encode_result(Result(id="j1"))})
        await writer.aclose()
        await until(lambda: got, 10, "the result after the cuts")
        assert [r.id for r in got] == ["j1"]
    finally:
        reader.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        await admin.aclose()
        await proxy.stop()
