"""Local replicas for :meth:`rollq.torchrl.AsyncVLLM.from_pretrained`: ``rollq consume``
processes on one model folder, plus an embedded redis-server when no URL is given.

>>> with LocalReplicas("/models/qwen", num_replicas=2) as local:     # doctest: +SKIP
...     print(local.url, local.weights_root)

Each replica is a child process (its own vLLM engine core below it) that follows policy
versions under :attr:`weights_root` (in ``/dev/shm`` where it exists). :meth:`start` returns
once every replica is registered and serving; a replica that exits first raises
:class:`LocalReplicaFailed` with the end of its log. :meth:`stop` stops only the processes
this object started, by pid: SIGTERM (they drain), then SIGKILL after ``grace`` seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import RollqError

log = logging.getLogger(__name__)


class LocalReplicaFailed(RollqError):
    """A local replica process exited or did not come up in time."""


class LocalReplicas:
    """``num_replicas`` ``rollq consume --engine vllm`` processes serving ``queue``."""

    def __init__(
        self,
        model: str,
        *,
        num_replicas: int = 1,
        url: str | None = None,
        queue: str = "torchrl",
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        broadcast: bool = False,
        weights_root: str | None = None,
        grace: float = 30.0,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not Path(model).is_dir():
            raise FileNotFoundError(f"model {model!r} is not a local folder (rollq never downloads models)")
        self.model, self.num_replicas, self.queue = model, num_replicas, queue
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len, self.kv_cache_memory_bytes = max_model_len, kv_cache_memory_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.broadcast, self.grace = broadcast, grace
        self._given_url = url
        self.url = url or ""
        self._own_root = weights_root is None
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.weights_root = weights_root or tempfile.mkdtemp(prefix="rollq-torchrl-weights-", dir=base)
        self._logdir = tempfile.mkdtemp(prefix="rollq-torchrl-logs-")
        self._server: Any = None
        self.procs: list[subprocess.Popen] = []
        self.ids = [f"torchrl-{os.getpid()}-{i}" for i in range(num_replicas)]

    def _argv(self, replica_id: str) -> list[str]:
        argv = [sys.executable, "-m", "rollq.cli", "consume", "--engine", "vllm", "--url", self.url,
                "--queue", self.queue, "--id", replica_id, "--model", self.model,
                "--weights-root", self.weights_root, "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.kv_cache_memory_bytes:
            argv += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.gpu_memory_utilization:
            argv += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.broadcast:
            argv.append("--broadcast")
        return argv

    def start(self, timeout: float = 600.0) -> LocalReplicas:
        """Start Redis (unless a URL was given) and the replicas; wait until all serve."""
        try:
            if not self._given_url:
                from ..server import RedisServer

                self._server = RedisServer().start()
                self.url = self._server.url
            for rid in self.ids:
                out = open(os.path.join(self._logdir, f"{rid}.log"), "wb")
                self.procs.append(subprocess.Popen(self._argv(rid), stdout=out, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL))
                out.close()
            log.info("started %d local replica(s) of %s on %s (logs: %s)", self.num_replicas, self.model, self.url, self._logdir)
            self._wait_serving(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_serving(self, timeout: float) -> None:
        import msgspec
        import redis

        from ..keys import QueueKeys

        keys = QueueKeys(self.queue)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                for rid, p in zip(self.ids, self.procs):
                    if p.poll() is not None:
                        raise LocalReplicaFailed(f"replica {rid} exited with code {p.returncode}: {self.log_tail(rid)}")
                serving = 0
                for rid in self.ids:
                    raw = client.hget(keys.consumers, rid)
                    if raw and msgspec.msgpack.decode(raw).get("state") == "serving":
                        serving += 1
                if serving == self.num_replicas:
                    return
                if time.monotonic() > deadline:
                    raise LocalReplicaFailed(
                        f"{self.num_replicas - serving} of {self.num_replicas} replica(s) not serving after {timeout:.0f}s "
                        f"(from_pretrained startup_timeout=): {self.log_tail(self.ids[0])}"
                    )
                time.sleep(0.25)
        finally:
            client.close()

    def log_tail(self, replica_id: str, limit: int = 2000) -> str:
        """The end of a replica's log (stdout and stderr)."""
        try:
            data = Path(self._logdir, f"{replica_id}.log").read_bytes()[-limit:]
        except OSError:
            return "(no log)"
        return data.decode(errors="replace").strip()

    def stop(self) -> None:
        """Stop the replicas (SIGTERM, then SIGKILL after ``grace``), then Redis; remove the
        weight slots and logs this object created."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs = []
        if self._server is not None:
            server, self._server = self._server, None
            server.stop()
            server.cleanup()
        if self._own_root:
            shutil.rmtree(self.weights_root, ignore_errors=True)
        shutil.rmtree(self._logdir, ignore_errors=True)

    def __enter__(self) -> LocalReplicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
