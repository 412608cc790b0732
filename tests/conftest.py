"""Shared fixtures: a real redis-server per session (free loopback port), unique queues."""

from __future__ import annotations

import os
import uuid

import pytest

from rollq.server import RedisServer

# The vLLM session fixtures live here, defined once: a fixture imported into several test
# modules is a fixture of each of them, and each would start an engine of its own (~4 GB).
from tests.vllm_fixtures import (  # noqa: E402,F401
    check_engines_left_as_found,
    tiny_model_path,
    vllm_engine,
    vllm_engine_processed,
)
# Factory and cluster fixtures, available to every test module (importing a fixture into a
# module that takes it as an argument reads as a redefinition: ruff F811).
from tests.cluster_fixtures import redis_cluster, valkey_binary, valkey_server  # noqa: E402,F401
from tests.helpers import make_consumer, make_producer, spawn  # noqa: E402,F401
# A test that hits its timeout dumps every asyncio task (where a hung test waits).
from tests.helpers.hang_dump import pytest_timeout_set_timer  # noqa: E402,F401


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test that used a session vLLM engine (its own fixtures torn down): the engine
    serves its checkpoint again, or the test fails (:func:`check_engines_left_as_found`)."""
    if nextitem is not None and {"vllm_engine", "vllm_engine_processed"} & set(getattr(item, "fixturenames", ())):
        check_engines_left_as_found(item.nodeid)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (AOF on, appendfsync always)."""
    srv = RedisServer(appendfsync="always")
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture
def fresh_redis():
    """A redis-server of the test's own, for tests that kill or restart it."""
    srv = RedisServer(appendfsync="always")
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def queue():
    """A queue name no other test uses (tests can share the server, even in parallel)."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def redis_client(redis_server):
    from rollq.connection import connect

    c = connect(redis_server.url)
    yield c
    await c.aclose()


os.environ.setdefault("ROLLQ_LOG_LEVEL", "INFO")
