"""Reading streamed jobs' progress (``Job.stream``): :meth:`JobHandle.stream` iterates it.

The replica running a streamed job appends :class:`~rollq.protocol.ProgressEntry` messages
to the job's progress stream (:mod:`rollq.consumer._progress`). A producer reads the progress
streams of all the jobs being iterated with one task, :class:`ProgressReader`: one ``XREAD``
over every such stream (one per shard's slot on a cluster), blocking at most
:data:`PROGRESS_BLOCK` seconds, on the producer's shared connection pool; so a thousand
streaming requests cost one connection, not a thousand. Each iterator reads its job's stream
from the start and ends when the job's result is in (the handle wakes it); the result is the
record and may hold more tokens than the entries read (a flush still buffered, entries
trimmed, a resume's continuation).

Redelivery: a job whose replica died mid-job runs again elsewhere, as delivery ``d + 1``
(``ProgressEntry.delivery``; ``run`` counts restarts within one delivery). Entries of an
attempt older than the newest one seen are dropped: an iterator yields the newest attempt's
tokens only, and a caller sees the switch as an entry whose ``attempt`` changed (its offsets
start again at 0).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any, AsyncIterator, Callable

from .._tasks import stop_task
from ..errors import ProtocolError
from ..keys import FIELD, tag_of
from ..protocol import ProgressEntry, decode_progress

log = logging.getLogger(__name__)

#: Seconds one XREAD of the progress streams blocks at most (a stream added meanwhile waits
#: for the next one).
PROGRESS_BLOCK = 0.02
#: Entries one XREAD returns at most per stream.
PROGRESS_COUNT = 512
_FIELD = FIELD.encode()


class _Sub:
    """One iterator's stream: where it has read to, and the entries read for it."""

    __slots__ = ("key", "last", "attempt", "items", "wake", "closed")

    def __init__(self, key: str) -> None:
        self.key = key
        self.closed = False
        self.last: bytes | str = b"0-0"
        self.attempt = (0, 0)
        self.items: list[ProgressEntry] = []
        self.wake = asyncio.Event()

    def take(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for eid, fields in entries:
            self.last = eid
            raw = fields.get(_FIELD) if isinstance(fields, dict) else None
            if raw is None:
                continue
            try:
                entry = decode_progress(raw)
            except ProtocolError as e:
                log.warning("skipping a progress entry of %s: %s", self.key, e)
                continue
            if entry.attempt < self.attempt:
                continue  # an abandoned delivery's tokens
            self.attempt = entry.attempt
            self.items.append(entry)
        if entries:
            self.wake.set()


class ProgressReader:
    """The one task that reads a producer's progress streams (``producer``: a weak
    reference to the producer, whose connected client it uses)."""

    def __init__(self, producer: Callable[[], Any], *, block: float = PROGRESS_BLOCK, count: int = PROGRESS_COUNT):
        self._producer = producer
        self._block = block
        self._count = count
        self._subs: dict[str, list[_Sub]] = {}
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, key: str) -> _Sub:
        sub = _Sub(key)
        self._subs.setdefault(key, []).append(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rollq-progress-reader")
        return sub

    def unsubscribe(self, sub: _Sub) -> None:
        subs = self._subs.get(sub.key)
        if subs is not None and sub in subs:
            subs.remove(sub)
            if not subs:
                del self._subs[sub.key]

    async def _run(self) -> None:
        backoff = 0.1
        while self._subs:
            producer = self._producer()
            client = producer._client if producer is not None else None
            if client is None:  # the producer closed
                self._end()
                break
            by_slot: dict[str, dict[str, Any]] = defaultdict(dict)
            for key, subs in self._subs.items():
                by_slot[tag_of(key)][key] = min((s.last for s in subs), key=_order)
            try:
                block = max(1, int(self._block * 1000))
                if len(by_slot) == 1:  # one server, or one slot: one call
                    replies = [await client.xread(next(iter(by_slot.values())), count=self._count, block=block)]
                else:  # a cluster: one call per slot, at once
                    calls = [asyncio.ensure_future(client.xread(st, count=self._count, block=block)) for st in by_slot.values()]
                    replies = await asyncio.gather(*calls)
                backoff = 0.1
            except Exception as e:  # noqa: BLE001 - progress is a preview: read again later
                log.warning("reading progress streams failed (%s: %s); retrying in %.1fs", type(e).__name__, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for resp in replies:
                for key, entries in resp or ():
                    k = key.decode() if isinstance(key, bytes) else key
                    for sub in self._subs.get(k, ()):
                        fresh = [(eid, f) for eid, f in entries if _order(eid) > _order(sub.last)]
                        sub.take(fresh)
        self._task = None

    def _end(self) -> None:
        """Every iterator ends (the producer closes)."""
        for subs in self._subs.values():
            for s in subs:
                s.closed = True
                s.wake.set()
        self._subs.clear()

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        self._end()


def _order(eid: bytes | str) -> tuple[int, int]:
    """A stream entry id as a sortable pair."""
    s = eid.decode() if isinstance(eid, bytes) else eid
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


async def read_progress(reader: ProgressReader, key: str, result: asyncio.Future[Any]) -> AsyncIterator[ProgressEntry]:
    """The entries of progress stream ``key`` (newest attempt only) until ``result`` (a
    future the job's result resolves) is done."""
    sub = reader.subscribe(key)
    result.add_done_callback(lambda _: sub.wake.set())
    try:
        while True:
            if not sub.items and not result.done() and not sub.closed:
                await sub.wake.wait()
            sub.wake.clear()
            items, sub.items = sub.items, []
            for entry in items:
                yield entry
            if result.done() or sub.closed:
                return
    finally:
        reader.unsubscribe(sub)
