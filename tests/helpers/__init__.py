"""Helpers shared by the queue tests: polling with a deadline, factory fixtures.

Fixtures are factories (``create(...)``) that clean up after the test, so a failing test
never leaves a consumer task or a consumer process behind.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import pytest_asyncio

from rollq.connection import connect
from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer
from rollq.keys import GROUP, QueueKeys
from rollq.producer.client import Producer
from rollq.settings import ConsumerSettings, ProducerSettings

ROOT = Path(__file__).resolve().parents[2]

#: In-process consumer settings that keep tests fast: short blocking reads and leases.
FAST = dict(
    block=0.1,
    heartbeat_interval=0.2,
    lease_ttl=1.0,
    reclaim_interval=0.3,
    drain_timeout=3.0,
    backoff_initial=0.05,
    backoff_max=0.5,
)


async def until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll ``pred`` (sync or async) until it is truthy; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def until_sync(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.005) -> Any:
    """:func:`until` for a test that is not a coroutine: poll ``pred`` from this thread (sleeping
    between tries) until it is truthy; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return v


async def bounded(aw: Awaitable[Any], timeout: float, what: str) -> Any:
    """``await aw`` but fail (not hang) after ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


async def collect(producer: Producer, n: int, timeout: float, settle: float = 0.3) -> dict[str, list]:
    """Results of ``n`` distinct jobs via ``results()``, grouped by job id.

    Waits ``settle`` seconds more after the n-th to catch late duplicates.
    """
    got: dict[str, list] = {}
    deadline = time.monotonic() + timeout

    async def take() -> None:
        async for r in producer.results():
            got.setdefault(r.id, []).append(r)
            if len(got) >= n:
                return

    try:
        await asyncio.wait_for(take(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise AssertionError(f"only {len(got)} of {n} results arrived within {timeout}s") from None
    async for r in producer.results(timeout=settle):
        got.setdefault(r.id, []).append(r)
    return got


async def pending_of(client: Any, stream: str, consumer: str) -> list[dict]:
    """Pending entries of ``consumer`` on ``stream`` (empty if the group does not exist)."""
    try:
        return await client.xpending_range(stream, GROUP, min="-", max="+", count=100_000, consumername=consumer)
    except Exception as e:  # NOGROUP / no key
        if "NOGROUP" in str(e) or "no such key" in str(e).lower():
            return []
        raise


async def register_replica(client: Any, keys: QueueKeys, rid: str, host: str = "h", version: int = 0,
                           alive: bool = True, follows: bool = False) -> None:
    """A replica ``rid`` on ``host`` serving ``version`` as a publisher releasing an IPC
    version sees it: its info, its heartbeat when ``alive``, its follower's record of
    ``version`` copied (``QueueKeys.weights_ipc_copied``) when ``follows``."""
    import msgspec

    from rollq.protocol import ReplicaInfo

    info = ReplicaInfo(id=rid, host=host, pid=1, engine="echo", model="m", device="cpu", version=version, inflight=0,
                       cap=1, kv_usage=None, tokens_per_s=0.0, completed=0, failed=0, started_at=0.0, heartbeat_at=0.0,
                       state="serving")
    await client.hset(keys.consumers, rid, msgspec.msgpack.encode(info))
    if alive:
        await client.set(keys.heartbeat(rid), 1, ex=60)
    if follows:
        await client.hset(keys.weights_ipc_copied, rid, version)


@pytest_asyncio.fixture
async def make_producer(redis_url):
    """``create(url=None, queue=..., **ProducerSettings)`` -> connected Producer; closed after."""
    made: list[Producer] = []

    async def create(queue: str, url: str | None = None, producer_id: str | None = None, **settings: Any) -> Producer:
        p = Producer(url or redis_url, queue, producer_id=producer_id, settings=ProducerSettings(**settings))
        made.append(p)
        return await p.connect()

    yield create
    for p in made:
        await asyncio.wait_for(p.close(), 10)


@pytest_asyncio.fixture
async def make_consumer(redis_url):
    """``create(queue, engine=None, consumer_id=None, url=None, **ConsumerSettings)`` -> Consumer.

    ``start(consumer)`` runs it as a task (until ``stop``); ``burst(consumer)`` runs it to
    completion with a bound. Every consumer still running is stopped after the test.
    """
    tasks: dict[Consumer, asyncio.Task] = {}

    class Factory:
        def __call__(
            self, queue: str, engine: Any = None, consumer_id: str | None = None, url: str | None = None, **settings: Any
        ) -> Consumer:
            return Consumer(
                engine or EchoEngine(), url or redis_url, queue, consumer_id=consumer_id,
                settings=ConsumerSettings(**{**FAST, **settings}),
            )

        def start(self, c: Consumer) -> asyncio.Task:
            t = asyncio.create_task(c.run(), name=f"test-consumer-{c.id}")
            tasks[c] = t
            return t

        async def stop(self, c: Consumer, timeout: float = 15) -> int:
            c.stop()
            return await bounded(tasks.pop(c), timeout, f"consumer {c.id} to stop")

        async def burst(self, c: Consumer, timeout: float = 20) -> int:
            return await run_burst(c, timeout)

    yield Factory()
    for c, t in tasks.items():
        c.stop()
    for c, t in tasks.items():
        try:
            await asyncio.wait_for(t, 15)
        except BaseException:
            t.cancel()


def describe(c: Consumer) -> str:
    """What a consumer is doing, for failure messages."""
    stuck = [t.get_name() for t in getattr(c, "_tasks", []) if not t.done()]
    return (
        f"state={c.state!r} running={len(c.jobs.running)} held={len(c.jobs.held)} waiting={len(c.versions.waiting)} "
        f"unflushed={len(c.finisher.rows)} "
        f"counters={c.counters} background tasks not finished={stuck}"
    )


async def run_burst(c: Consumer, timeout: float = 20) -> int:
    """``c.run(burst=True)`` with a bound; on timeout, say where the consumer is stuck."""
    task = asyncio.ensure_future(c.run(burst=True))
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if done:
        return task.result()
    info = describe(c)
    for t in [*getattr(c, "_tasks", []), task]:  # do not leave it running (a second cancel)
        t.cancel()
    await asyncio.wait({task, *getattr(c, "_tasks", [])}, timeout=5)
    raise AssertionError(f"consumer {c.id} did not return from run(burst=True) within {timeout}s: {info}")


class Proc:
    """A consumer process (tests/helpers/consumer_proc.py)."""

    def __init__(self, url: str, queue: str, consumer_id: str, delay_ms: float, **opts: Any):
        args = [sys.executable, "-m", "tests.helpers.consumer_proc", url, queue, consumer_id, str(delay_ms)]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.id = consumer_id
        self.queue = queue
        self.url = url
        # stderr to a file: a pipe nobody reads would block a chatty process
        self.log = tempfile.NamedTemporaryFile(prefix=f"rollq-{consumer_id}-", suffix=".log", delete=False)
        self.popen = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ})

    async def ready(self, timeout: float = 15) -> Proc:
        c = connect(self.url)
        try:
            await until(
                lambda: self._check_alive() or c.exists(QueueKeys(self.queue).heartbeat(self.id)), timeout,
                f"consumer process {self.id} to register its lease",
            )
        finally:
            await c.aclose()
        return self

    def _check_alive(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"consumer process {self.id} exited with {self.popen.returncode}: {self.stderr()}")
        return False

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self) -> None:
        self.popen.send_signal(signal.SIGTERM)

    async def wait(self, timeout: float) -> int:
        await until(lambda: self.popen.poll() is not None, timeout, f"consumer process {self.id} to exit")
        return self.popen.returncode

    def stderr(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def cleanup(self) -> None:
        self.kill()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


@pytest.fixture
def spawn():
    """``spawn(url, queue, id, delay_ms, **opts)`` -> Proc; every process is killed after."""
    procs: list[Proc] = []

    def create(url: str, queue: str, consumer_id: str, delay_ms: float, **opts: Any) -> Proc:
        p = Proc(url, queue, consumer_id, delay_ms, **opts)
        procs.append(p)
        return p

    yield create
    for p in procs:
        p.cleanup()
