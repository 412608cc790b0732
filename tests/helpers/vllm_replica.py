"""A vLLM replica as a process (``rollq consume --engine vllm`` on the tiny model), for tests
that kill it or its engine core, and the process tree it grows.

vLLM starts its ``EngineCore`` as a child of the replica and the ``Worker`` as a child of
the engine core (plus multiprocessing's resource trackers); :meth:`VllmReplica.tree`
remembers every descendant it has seen, as :class:`psutil.Process` objects, which tell a
process from a later one that reuses its pid. Cleanup kills what is left of that tree, by
pid, and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from rollq.connection import connect
from rollq.keys import QueueKeys
from rollq.testing.tiny_model import ensure_tiny_model
from tests.helpers import ROOT, until

try:
    from rollq.weightsync.worker.ext import RollqWorkerExtension as _Extension
except ImportError:  # torch missing: the vLLM tests skip anyway
    _Extension = object  # type: ignore[assignment,misc]

#: How long :class:`SlowSwapExtension` holds a swap (longer than any test waits).
SLOW_SWAP_S = 150.0


class SlowSwapExtension(_Extension):  # type: ignore[misc,valid-type]
    """rollq's worker extension with a swap that takes :data:`SLOW_SWAP_S` seconds: a weight
    update stays in progress (the replica paused, its intake closed, the follower waiting on
    the engine) for as long as a test needs."""

    def rollq_apply_staged(self, version: int, progress_since: float = 0.0) -> dict[str, Any]:
        time.sleep(SLOW_SWAP_S)
        return super().rollq_apply_staged(version, progress_since)


def gone(p: psutil.Process) -> bool:
    """``p`` has exited (a zombie nobody reaped counts as exited: it holds no memory)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.name()!r} ppid={p.ppid()} rss={p.memory_info().rss >> 20}MiB")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


class VllmReplica:
    """``rollq consume --engine vllm`` with a 2 s lease, importing this checkout's rollq."""

    def __init__(self, url: str, queue: str, replica_id: str, *extra: str) -> None:
        self.id, self.url, self.queue = replica_id, url, queue
        args = [
            sys.executable, "-m", "rollq.cli", "consume", "--engine", "vllm", "--url", url, "--queue", queue,
            "--id", replica_id, "--model", str(ensure_tiny_model()), "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(64 << 20), "--lease-ttl", "2", "--enforce-eager", *extra,
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.log = tempfile.NamedTemporaryFile(prefix=f"rollq-{replica_id}-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        self.proc = psutil.Process(self.popen.pid)
        self._tree: dict[int, psutil.Process] = {}

    async def ready(self, timeout: float = 300) -> VllmReplica:
        """Wait until the replica holds its lease (its engine is up)."""
        c = connect(self.url)
        try:
            await until(lambda: self._check_alive() or c.exists(QueueKeys(self.queue).heartbeat(self.id)),
                        timeout, f"vLLM replica {self.id} to take its lease", interval=0.2)
        finally:
            await c.aclose()
        return self

    def _check_alive(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"replica {self.id} exited with {self.popen.returncode}: {self.stderr()}")
        return False

    def tree(self) -> list[psutil.Process]:
        """Every descendant seen so far (children are looked up now, while the replica lives)."""
        try:
            for p in self.proc.children(recursive=True):
                self._tree.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return list(self._tree.values())

    def engine_core(self) -> psutil.Process:
        """The replica's vLLM engine-core process (its direct child that vLLM named so, or that
        multiprocessing spawned)."""
        kids = self.proc.children()
        for p in kids:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                return p
        for p in kids:
            if "spawn_main" in " ".join(p.cmdline()):
                return p
        raise AssertionError(f"replica {self.id} has no engine-core child: {describe(kids)}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    async def wait(self, timeout: float) -> int:
        await until(lambda: self.popen.poll() is not None, timeout, f"replica {self.id} to exit", interval=0.1)
        return self.popen.returncode

    def stderr(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def cleanup(self) -> None:
        """Kill the replica and whatever is left of its tree (only processes it started)."""
        self.tree()
        self.kill()
        for p in self._tree.values():
            try:
                if not gone(p):
                    p.kill()  # psutil checks that the pid is still this process first
            except psutil.Error:
                pass
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
