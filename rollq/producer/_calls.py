"""SUBMIT calls (``lua/submit.lua``) on the wire: their numbers, and the stream that writes
them on one connection and writes them again when it fails.

Every SUBMIT call carries a per-producer call number, and Redis keeps the reply of each call
whose reply the producer has not read yet (``QueueKeys.submit_calls``), so a call resent
after a cut connection replays its reply instead of enqueuing its jobs again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import Any

import msgpack

from ..connection import RETRYABLE, SUBMIT
from ..protocol import Job
from ._handles import JobHandle

log = logging.getLogger(__name__)

#: Milliseconds a producer's SUBMIT call records live after its last call (a dead producer
#: leaves nothing; a live one deletes them on close).
CALL_RECORD_TTL_MS = 3600 * 1000
#: Backoff between resends while Redis is unreachable: first delay and cap, in seconds.
RESEND_BACKOFF = (0.005, 0.5)

#: One SUBMIT call: (keys, args, positions of its jobs in the batch). Args are the packed
#: payloads, producer, incarnation, call number, lowest unread call number, TTL of the records.
Call = tuple[list[str], list[Any], Any]

#: The one argument of a SUBMIT call's jobs (Redis' Lua cmsgpack reads str, not bin).
pack_args = msgpack.Packer(use_bin_type=False).pack


class CallNumbers:
    """A producer's SUBMIT call numbers. ``unread``: numbers sent (or about to be) whose
    reply was not read, in order; ``pinned``: those of calls in doubt, held for
    :meth:`SubmitInterrupted.resume` (their records stay in Redis until then)."""

    __slots__ = ("incarnation", "last", "unread", "pinned")

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex[:12]  # a restart under the same id numbers anew
        self.last = 0
        self.unread: dict[int, None] = {}
        self.pinned: set[int] = set()

    def number(self, args: list[Any]) -> None:
        """Give a SUBMIT call (its ``args``) the next call number and the lowest unread one."""
        self.last += 1
        self.unread[self.last] = None
        args[3] = self.last
        args[4] = next(iter(self.unread))  # numbers are inserted in order: the first is the lowest

    def read(self, n: int) -> None:
        """The reply of call ``n`` was read."""
        self.unread.pop(n, None)
        self.pinned.discard(n)

    def drop(self, n: int) -> None:
        """Call ``n`` was not sent, and will not be."""
        self.unread.pop(n, None)

    def forget(self, n: int) -> None:
        """Whether call ``n`` ran is not known; unless it is pinned, nobody resends it."""
        if n not in self.pinned:
            self.unread.pop(n, None)

    def pin(self, numbers: list[int]) -> None:
        self.pinned.update(numbers)

    def unpin(self, numbers: list[int]) -> None:
        """Nobody can resend these calls any more: their records may go."""
        for n in numbers:
            if n in self.pinned:
                self.pinned.discard(n)
                self.unread.pop(n, None)

    def idle(self) -> bool:
        """Calls were made and none is in flight (the records in Redis can be deleted)."""
        return bool(self.last) and self.pinned.issuperset(self.unread)


class CallStream:
    """SUBMIT calls written on one pooled connection, their replies read in order.

    The calls whose replies were not read are held (``inflight``) with their packed bytes:
    when the connection fails, which of them ran is not known, so all are written again, in
    order, on a new connection (a call that ran replays its reply), until Redis has been
    unreachable for ``RedisSettings.command_timeout`` (GaveUp).
    """

    def __init__(self, submission: Any, conn: Any):
        self.submission = submission
        self.conn = conn
        self.inflight: deque[tuple[list[Job], list[Call], Any]] = deque()
        #: Set when a call met NOSCRIPT and ran again: read every reply in flight first.
        self.reran: list[bool] = []
        self.handles: list[JobHandle] = []
        self.outage = Outage(submission.redis_settings.command_timeout)

    def pack(self, calls: list[Call]) -> Any:
        return self.conn.pack_commands([("EVALSHA", SUBMIT.sha, len(keys), *keys, *args) for keys, args, _ in calls])

    async def write(self, jobs: list[Job], calls: list[Call], packed: Any) -> None:
        self.inflight.append((jobs, calls, packed))
        try:
            await self.conn.send_packed_command(packed, check_health=False)
        except RETRYABLE as e:
            await self._resend(e)
        await asyncio.sleep(0)  # the loop flushes what the socket did not take at once

    async def _resend(self, error: BaseException) -> None:
        while True:
            await self.conn.disconnect()
            await self.outage.wait(error, f"submitting {sum(len(j) for j, _, _ in self.inflight)} jobs")
            self.submission.counters["resends"] += 1
            try:
                for _, _, packed in self.inflight:
                    await self.conn.send_packed_command(packed, check_health=False)
                return
            except RETRYABLE as e:
                error = e

    async def take(self) -> None:
        """Read the replies of the oldest call in flight and make its handles."""
        jobs, calls, _ = self.inflight[0]
        while True:
            try:
                results = await self.submission._read_replies(self.conn, calls, self.reran)
                break
            except RETRYABLE as e:
                await self._resend(e)
        self.outage.reset()
        self.inflight.popleft()
        self.handles.extend(await self.submission._finish_chunk(jobs, calls, results))

    async def take_window(self) -> None:
        """The window is full: take the oldest call (and, after NOSCRIPT, every one)."""
        await self.take()
        while self.reran and self.inflight:  # NOSCRIPT: the reruns go before anything new
            await self.take()
        self.reran.clear()

    async def take_all(self) -> None:
        while self.inflight:
            await self.take()

    def in_doubt(self) -> list[tuple[list[Job], list[Call]]]:
        return [(jobs, calls) for jobs, calls, _ in self.inflight]

    async def close(self, pool: Any) -> None:
        if self.inflight:
            numbers = self.submission.numbers
            for jobs, calls, _ in self.inflight:  # no reply read: whether Redis ran them is not known
                self.submission.ledger.release(len(jobs))
                for _, args, _ in calls:
                    numbers.forget(args[3])
            await self.conn.disconnect()  # replies may be left unread: start clean
        await pool.release(self.conn)


class GaveUp(Exception):
    """Redis stayed unreachable past the retry budget (turned into SubmitInterrupted)."""


class Outage:
    """Backoff between resends, and the limit: ``limit`` seconds since the first failure."""

    __slots__ = ("limit", "since", "delay")

    def __init__(self, limit: float | None):
        self.limit = limit
        self.since: float | None = None
        self.delay = RESEND_BACKOFF[0]

    def reset(self) -> None:
        if self.since is not None:
            self.since = None
            self.delay = RESEND_BACKOFF[0]

    async def wait(self, error: BaseException, what: str) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif self.limit is not None and now - self.since >= self.limit:
            raise GaveUp(
                f"{what}: Redis unreachable for {now - self.since:.1f}s, longer than "
                f"RedisSettings.command_timeout={self.limit}s (last error: {type(error).__name__}: {error})"
            ) from error
        log.info("%s: %s; sending again in %.3fs", what, error, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(2 * self.delay, RESEND_BACKOFF[1])
