"""The producer's result readers keep reading whatever goes wrong in one read."""

from __future__ import annotations

import pytest

from rollq.producer import results as results_mod
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
