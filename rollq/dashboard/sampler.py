"""The dashboard's only reader of Redis: one sampler per process, shared by every viewer.

Every ``interval`` seconds the sampler takes one snapshot of each queue it watches and keeps
the last ``history`` seconds of them in a ring buffer. The web page, the JSON API, ``/metrics``
and ``rollq top`` all read that memory, never Redis, so ten browsers and a Prometheus scrape
cost Redis what one sample costs:

- :func:`rollq.status.queue_status`: 7 + 3·R commands (R: replicas in the registry), one more
  (``XRANGE COUNT 1``, the oldest waiting job) while jobs wait; no scan over job keys;
- ``HGETALL`` of the latency and of the policy-lag histograms: 2;
- the versions log and the dead letters (``XREVRANGE COUNT``, one each) only when the policy
  version or the dead-letter figures changed, and every ``refresh_lists`` seconds.

So 9 + 3·R commands (10 + 3·R while jobs wait) in 4 + R round trips, however many jobs there are
(tests/dashboard/test_dashboard.py counts them with ``INFO commandstats``). A queue of K shards
(rollq/shards.py) adds 4 commands per shard beyond the first (its counters, its dead letters,
its stream's length and group; one more while its jobs wait) in the same round trips, and its
dead letters are read from every shard. The queue's shard count is read (``HGET``, one round
trip) at the first sample and with the lists, every ``refresh_lists`` seconds. Watching every queue in use
(no ``--queue``) adds, once per round, the read of the registry of queue names
(:func:`rollq.registry.queues_in_use`: 2 commands, 1 once ``default`` is registered).

Rates come from deltas of the queue's counters between samples, latency quantiles from deltas
of the latency histogram, so nothing is counted twice and a dashboard restart loses nothing
but its chart history.

>>> async def main():                                               # doctest: +SKIP
...     async with Sampler("redis://127.0.0.1:6379/0", ["grpo"]) as s:
...         await s.sample_all()
...         print(s.document("grpo")["queue"]["waiting"])
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.exceptions import RedisError, ResponseError

from ..connection import Client, connect
from ..errors import BadQueueData
from ..keys import QueueKeys
from ..protocol import SCHEMA_VERSION
from ..registry import queues_in_use
from ..settings import DEFAULT_QUEUE, RedisSettings
from ..status import QueueStatus, dlq_list, queue_status, read_shard_count
from .figures import Point, history_series, make_point, queue_document

log = logging.getLogger(__name__)

#: Seconds :meth:`Sampler.close` waits on the loop before cancelling it again.
_CANCEL_RETRY_S = 0.5

#: Seconds one Redis command of a sample may take before the sample counts as failed.
SAMPLE_TIMEOUT = 5.0


@dataclass(frozen=True)
class DashboardSettings:
    """How often and how much the dashboard samples. Times in seconds."""

    #: Time between two samples of every queue.
    interval: float = 1.0
    #: History kept per queue (charts; the window of the "recent" policy lag).
    history: float = 600.0
    #: Rates are averaged over this window.
    rate_window: float = 5.0
    #: Latency quantiles are those of results recorded within this window.
    latency_window: float = 60.0
    #: A replica whose registry entry is older than this is stale, even with a live lease.
    stale_after: float = 10.0
    #: A replica without a lease whose last heartbeat is older than this is dead.
    dead_after: float = 60.0
    #: Versions read from the versions log.
    versions: int = 50
    #: Dead letters read from the dead-letter stream.
    dead_letters: int = 20
    #: The versions log and the dead letters are re-read at least this often.
    refresh_lists: float = 30.0


def _ints(h: dict[Any, Any]) -> dict[int, int]:
    out = {}
    for k, v in h.items():
        try:
            out[int(k)] = int(v)
        except ValueError:
            continue
    return out


def _decode_version(data: bytes) -> dict[str, Any] | None:
    """A versions-log record as a dict, without importing the weight-sync transports (torch).

    A :class:`~rollq.weightsync.versions.VersionRecord` is a msgpack map, so a plain decode
    gives its fields; records of another schema are skipped.
    """
    try:
        r = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(r, dict) or r.get("v") != SCHEMA_VERSION or "version" not in r:
        return None
    return {
        "version": r["version"], "published_at": r.get("published_at"), "transport": r.get("transport"),
        "nbytes": r.get("nbytes"), "num_tensors": r.get("num_tensors"), "checksum": r.get("checksum"),
        "trainer": r.get("trainer", ""), "timings": r.get("timings") or {},
    }


class _Queue:
    """Everything the sampler knows about one queue."""

    def __init__(self, name: str, maxlen: int):
        self.keys = QueueKeys(name)
        self.points: deque[Point] = deque(maxlen=maxlen)
        self.doc: dict[str, Any] | None = None  # latest document, without history
        self.error: str | None = None
        self.errors = 0
        self.samples = 0
        self.duration_s = 0.0
        self.versions: list[dict[str, Any]] = []
        self.versions_key: Any = None
        self.dead: list[dict[str, Any]] = []
        self.dead_key: Any = None
        self.lists_at = 0.0
        self.shards: int | None = None  # the queue's recorded shard count, re-read with the lists


class Sampler:
    """Samples queues every ``settings.interval`` seconds; serves the latest data from memory.

    Args:
        url: Redis URL (``$ROLLQ_REDIS_URL`` if None).
        queues: names of the queues to watch (the dashboard shows only these); None: every
            queue in use (:func:`rollq.registry.queues_in_use`), re-read every round, so a
            queue used later joins (one seen once stays while the sampler runs).
        settings: :class:`DashboardSettings`.
    """

    def __init__(self, url: str | RedisSettings | None, queues: list[str] | None = None,
                 settings: DashboardSettings | None = None):
        if queues is not None and not queues:
            raise ValueError("the dashboard needs at least one queue (--queue), or None: every queue in use")
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.settings = s = settings or DashboardSettings()
        #: True when the sampler watches every queue in use (no queues given).
        self.discovering = queues is None
        self._maxlen = max(2, int(math.ceil(s.history / s.interval)) + 1)
        self._queues = {q: _Queue(q, self._maxlen) for q in dict.fromkeys(queues or [])}
        self._discover_error: str | None = None
        self._client: Client | None = None
        self._task: asyncio.Task | None = None
        self._closing = False

    @property
    def queues(self) -> list[str]:
        return list(self._queues)

    def __contains__(self, queue: str) -> bool:
        return queue in self._queues

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> Sampler:
        if self._client is None:
            # a short command timeout: a hung Redis shows as an error within seconds
            self._client = connect(self.redis_settings, max_connections=8, socket_timeout=SAMPLE_TIMEOUT)
        return self

    async def client(self) -> Client:
        """The sampler's Redis client (the requeue endpoint borrows it)."""
        await self.open()
        return self._client

    def start(self) -> None:
        """Run the sampling loop as a task (until :meth:`close`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="rollq-dashboard-sampler")

    async def close(self) -> None:
        """Stop the sampling loop and close the client.

        The loop also checks a closing flag between rounds: a cancellation can be lost inside a
        Redis call whose own timeout fires at the same moment (Python 3.11's ``wait_for``), so
        the cancel is repeated until the task has ended.
        """
        task, self._task = self._task, None
        if task is not None:
            self._closing = True
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=_CANCEL_RETRY_S)
            if not task.cancelled() and task.exception() is not None:
                log.warning("dashboard sampler ended with %s", type(task.exception()).__name__)
            self._closing = False
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> Sampler:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _loop(self) -> None:
        await self.open()
        interval = self.settings.interval
        next_at = time.monotonic()
        while not self._closing:
            await self.sample_all()
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow round: skip the missed ticks instead of bursting
                next_at = time.monotonic()
                delay = 0
            await asyncio.sleep(delay)

    # -- sampling ------------------------------------------------------------------------
    async def discover(self) -> None:
        """Watch the queues in use that are not watched yet (only without a queue list).

        Reads the registry, writes nothing. Unreadable: the queues stay as they are (the
        ``default`` queue if none yet, whose samples then report the error); never raises.
        """
        if not self.discovering:
            return
        await self.open()
        try:
            names = await queues_in_use(self._client)
        except (RedisError, OSError) as e:
            if self._discover_error is None:
                log.warning("dashboard: cannot read the registry of queues: %s: %s", type(e).__name__, e)
            self._discover_error = f"{type(e).__name__}: {e}"
            names = [] if self._queues else [DEFAULT_QUEUE]
        else:
            self._discover_error = None
        new = [n for n in names if n not in self._queues]
        if new:  # a new dict, in name order: readers iterating the old one are not disturbed
            self._queues = dict(sorted({**self._queues, **{n: _Queue(n, self._maxlen) for n in new}}.items()))

    async def sample_all(self) -> None:
        """One sample of every queue, concurrently (first, without a queue list, the registry)."""
        await self.discover()
        await asyncio.gather(*(self.sample(q) for q in self._queues))

    async def sample(self, queue: str) -> None:
        """One sample of ``queue``; a failure is recorded (shown as ``error``), not raised."""
        q = self._queues[queue]
        await self.open()
        t0 = time.monotonic()
        try:
            st, lat, lag = await self._read(q)
        except BadQueueData as e:  # a stray value at one of its keys: named, the queue shown as bad
            self._failed(q, f"unreadable: {e}")
            return
        except ResponseError as e:
            self._failed(q, f"redis refused a read: {e}")
            return
        except (RedisError, OSError) as e:
            self._failed(q, f"redis unreachable: {type(e).__name__}: {e}")
            return
        except Exception as e:  # a viewer must outlive odd data: say what went wrong, keep going
            self._failed(q, f"{type(e).__name__}: {e}", traceback=True)
            return
        if q.error is not None:
            log.info("dashboard: queue %r readable again", queue)
        q.error = None
        q.samples += 1
        q.duration_s = time.monotonic() - t0
        point = make_point(q.points, st, lat, lag, self.settings, m=time.monotonic())
        q.points.append(point)
        q.doc = queue_document(st, point, q.points, q.versions, q.dead, self.settings)

    def _failed(self, q: _Queue, message: str, traceback: bool = False) -> None:
        if q.error is None:  # log the first failure of a run, not one line per interval
            log.warning("dashboard: cannot sample queue %r: %s", q.keys.queue, message, exc_info=traceback)
        q.error = message
        q.errors += 1

    async def _read(self, q: _Queue) -> tuple[QueueStatus, dict[int, int], dict[int, int]]:
        client = self._client
        keys = q.keys
        now = time.monotonic()
        refresh = now - q.lists_at >= self.settings.refresh_lists
        if refresh or q.shards is None:  # recorded once per queue: no need to read it every sample
            q.shards = await read_shard_count(client, keys)
        st = await queue_status(client, keys, q.shards)
        read_versions = refresh or st.version != q.versions_key
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(keys.latency)  # queue_status keeps only two quantiles; rates need the buckets
        pipe.hgetall(keys.lag)
        if read_versions:
            pipe.xrevrange(keys.versions_log, count=self.settings.versions)
        res = await pipe.execute()
        lat, lag = _ints(res[0]), _ints(res[1])
        if read_versions:
            q.versions = [v for _, f in res[2] if (v := _decode_version(f.get(b"d", b""))) is not None]
            q.versions_key = st.version
        dead_key = (st.dlq_length, st.dead_lettered)
        if refresh or dead_key != q.dead_key:
            q.dead = [d.to_dict() for d in await dlq_list(client, keys, self.settings.dead_letters, q.shards)]
            q.dead_key = dead_key
        if refresh:
            q.lists_at = now
        return st, lat, lag

    # -- reading (no Redis) ----------------------------------------------------------------
    def latest(self, queue: str) -> Point | None:
        pts = self._queues[queue].points
        return pts[-1] if pts else None

    def sampler_info(self, queue: str) -> dict[str, Any]:
        q = self._queues[queue]
        last = q.points[-1].t if q.points else None
        return {
            "ok": q.error is None and last is not None, "error": q.error, "samples": q.samples,
            "errors": q.errors, "interval_s": self.settings.interval, "history_s": self.settings.history,
            "last_sample_at": last, "last_duration_ms": round(q.duration_s * 1000, 2),
        }

    def history(self, queue: str, since: float | None = None) -> dict[str, list[Any]]:
        """Chart series of the points newer than ``since`` (all kept points if None)."""
        return history_series(self._queues[queue].points, since)

    def document(self, queue: str, *, since: float | None = None, history: bool = True) -> dict[str, Any]:
        """Everything the page shows about ``queue``, from the latest sample (one JSON object)."""
        q = self._queues[queue]
        doc: dict[str, Any] = {"name": queue, "at": q.points[-1].t if q.points else None}
        doc.update(q.doc or {})
        doc["sampler"] = self.sampler_info(queue)
        if history:
            doc["history"] = self.history(queue, since)
        return doc

    def summary(self, queue: str) -> dict[str, Any]:
        """A line of the queue list: the headline figures only."""
        d = self._queues[queue].doc or {}
        qd, rates, lat = d.get("queue", {}), d.get("rates", {}), d.get("latency", {})
        return {
            "name": queue, "ok": self.sampler_info(queue)["ok"], "waiting": qd.get("waiting"),
            "in_flight": qd.get("in_flight"), "dlq_length": qd.get("dlq_length"),
            "completed_per_s": rates.get("completed_per_s"), "p99_ms": lat.get("p99_ms"),
            "replicas": len(d.get("replicas", [])), "version": d.get("versions", {}).get("current"),
            "shards": qd.get("shards"),
        }
