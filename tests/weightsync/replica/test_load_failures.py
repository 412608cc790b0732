"""A version the replica failed to load: recorded in Redis, retried, and logged for operators."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from rollq.keys import QueueKeys
from rollq.weightsync.ipc_wire import IpcUnavailable
from rollq.weightsync.replica._load_failures import LoadFailures
from rollq.weightsync.versions import read_load_errors


@pytest.mark.parametrize("error,traceback", [
    (IpcUnavailable("trainer process 7 exited or released version 3 before this worker opened it"), False),
    (RuntimeError("a bug in a loader"), True),
])
async def test_a_refused_ipc_version_is_logged_without_a_traceback_and_an_unexpected_error_with_one(
        redis_url, queue, caplog, error, traceback):
    """A trainer that released or left its version is a condition the message says all of (the
    end of every RL run meets it): no traceback beside it. An unexpected error keeps its
    traceback. Both are recorded in Redis and retried alike."""
    consumer = SimpleNamespace(id="r0", version=2, keys=QueueKeys(queue), version_failed=lambda v, why: None)
    failures = LoadFailures(consumer, retries=3)
    client = aioredis.from_url(redis_url)
    try:
        with caplog.at_level(logging.WARNING, logger="rollq.weightsync.replica._load_failures"):
            await failures.record(client, 3, error)
        (rec,) = [r for r in caplog.records if "could not load policy version 3" in r.getMessage()]
        assert (rec.exc_info is not None) is traceback, rec.exc_info
        assert str(error) in rec.getMessage()
        got = (await read_load_errors(client, consumer.keys))["r0"]
        assert (got.version, got.error, got.attempts, got.final) == (3, type(error).__name__, 1, False)
        assert failures.waiting(3)
    finally:
        await client.aclose()
