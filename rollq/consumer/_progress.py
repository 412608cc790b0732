"""Progress of streamed jobs (``Job.stream``) to Redis, in batches, best effort.

The engine reports each sample's new tokens through the progress callback
(:data:`~rollq.consumer.engine.ProgressCallback`) that :meth:`ProgressWriter.callback` makes for
a running job. They are buffered, merged per (job, attempt, sample) while contiguous, and sent
at most every ``ConsumerSettings.progress_interval`` seconds in one pipeline: an ``XADD``
(``MAXLEN progress_maxlen``) per entry to the job's progress stream
(``QueueKeys.progress``, in the job's shard) and a ``PEXPIRE`` (``progress_ttl``) per stream,
so nothing is left behind.

Progress is a preview, the result is the record: the flush runs in a task of its own, never
in the consumer's loop; a Redis error drops that flush's entries (logged), never the job; at
``progress_buffer_tokens`` buffered tokens new progress is dropped until the next flush (the
reader sees a gap in the offsets and waits for the result). A job resumed after a weight swap
(:mod:`rollq.consumer._resume`) publishes no progress for its continuations: its stream
pauses there and the result carries the rest. During a weight swap progress is held back
until the swap is marked, and a job the swap restarts (no token before it) has what it
buffered meanwhile dropped, so no client sees tokens of a run that was thrown away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .._tasks import stop_task
from ..keys import FIELD
from ..protocol import MAX_PROGRESS_TEXT, MAX_PROGRESS_TOKENS, ProgressEntry, encode_progress
from .engine import ProgressCallback

if TYPE_CHECKING:
    from ._context import ReplicaContext
    from ._in_hand import JobInHand

log = logging.getLogger(__name__)

#: Seconds between two warnings about failed flushes.
_WARN_EVERY = 30.0


class _Pending:
    """Entries of one sample of one attempt waiting to be sent, merged while contiguous."""

    __slots__ = ("delivery", "run", "sample", "offset", "tokens", "logprobs", "text", "chars", "version")

    def __init__(self, delivery: int, run: int, sample: int, offset: int, version: int) -> None:
        self.delivery, self.run, self.sample, self.offset, self.version = delivery, run, sample, offset, version
        self.tokens = bytearray()
        self.logprobs: bytearray | None = None
        self.text: list[str] | None = None
        self.chars = 0

    def fits(self, offset: int, n: int, chars: int) -> bool:
        return (
            offset == self.offset + len(self.tokens) // 4
            and len(self.tokens) // 4 + n <= MAX_PROGRESS_TOKENS
            and self.chars + chars <= MAX_PROGRESS_TEXT
        )

    def entry(self) -> ProgressEntry:
        text = "".join(self.text) if self.text is not None else None
        if text is not None and len(text) > MAX_PROGRESS_TEXT:  # one report over the bound: the reader waits
            text = None  # for the result (a piece without text in an attempt with text: a gap)
        return ProgressEntry(
            delivery=self.delivery,
            run=self.run,
            sample=self.sample,
            offset=self.offset,
            tokens=bytes(self.tokens),
            logprobs=bytes(self.logprobs) if self.logprobs is not None else None,
            text=text,
            version=self.version,
        )


class ProgressWriter:
    """Buffers the progress of a replica's streamed jobs and flushes it to Redis."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self._ctx = ctx
        self._buf: dict[str, list[_Pending]] = {}  # progress key -> entries, in order
        self._last: dict[tuple[str, int], _Pending] = {}  # (key, sample) -> its last entry in _buf
        self._tokens = 0
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._warned = 0.0
        self._held = False  # a weight swap is under way (hold .. release)
        #: Counters (tests and status): entries sent, tokens dropped, flushes that failed.
        self.sent = 0
        self.dropped = 0
        self.failed = 0

    def callback(self, held: JobInHand, run: int) -> ProgressCallback | None:
        """The progress callback of ``held``'s engine request (``run``: its restarts in this
        delivery), or None when its stream is in no shard this replica knows."""
        key = self.key_of(held)
        if key is None:
            return None
        delivery = held.deliveries

        def progress(sample: int, offset: int, tokens: bytes, logprobs: bytes | None, text: str | None) -> None:
            self.add(key, delivery, run, sample, offset, tokens, logprobs, text)

        return progress

    def key_of(self, held: JobInHand) -> str | None:
        """The progress stream of ``held``'s job (None: its stream is in no shard known here)."""
        try:
            return self._ctx.shards.of_key(held.stream).progress(held.job.reply, held.job.id)
        except KeyError:
            return None

    def hold(self) -> None:
        """A weight swap starts: keep what comes buffered (:meth:`drop` may take it back)."""
        self._held = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def drop(self, held: JobInHand) -> None:
        """Forget what is buffered of ``held``'s current delivery: the swap restarts it, and
        its tokens since the swap began are not the ones its restarted run will make."""
        key = self.key_of(held)
        entries = self._buf.get(key) if key is not None else None
        if key is None or not entries:
            return
        keep = [e for e in entries if e.delivery != held.deliveries]
        for e in entries:
            if e.delivery == held.deliveries:
                self._tokens -= len(e.tokens) // 4
                if self._last.get((key, e.sample)) is e:
                    del self._last[key, e.sample]
        if keep:
            self._buf[key] = keep
        else:
            del self._buf[key]

    def release(self) -> None:
        """The swap is over: flush again."""
        self._held = False
        if self._buf and self._timer is None and self._task is None:
            self._timer = asyncio.get_running_loop().call_later(self._ctx.settings.progress_interval, self._start)

    def add(
        self, key: str, delivery: int, run: int, sample: int, offset: int, tokens: bytes, logprobs: bytes | None, text: str | None
    ) -> None:
        """Buffer one report and make sure a flush is scheduled."""
        n = len(tokens) // 4
        if self._tokens + n > self._ctx.settings.progress_buffer_tokens:
            self.dropped += n
            return
        self._tokens += n
        entries = self._buf.setdefault(key, [])
        last = self._last.get((key, sample))
        if (
            last is None
            or (last.delivery, last.run) != (delivery, run)
            or not last.fits(offset, n, len(text) if text is not None else 0)
            or (last.logprobs is None) != (logprobs is None)
            or (last.text is None) != (text is None)
        ):
            last = _Pending(delivery, run, sample, offset, self._ctx.version)
            if logprobs is not None:
                last.logprobs = bytearray()
            if text is not None:
                last.text = []
            entries.append(last)
            self._last[key, sample] = last
        last.tokens += tokens
        if logprobs is not None and last.logprobs is not None:
            last.logprobs += logprobs
        if text is not None and last.text is not None:
            last.text.append(text)
            last.chars += len(text)
        if self._timer is None and self._task is None and not self._held:
            self._timer = asyncio.get_running_loop().call_later(self._ctx.settings.progress_interval, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._flush(), name="rollq-progress")

    async def _flush(self) -> None:
        s = self._ctx.settings
        buf, self._buf, self._tokens = self._buf, {}, 0
        self._last = {}
        redis = self._ctx.redis
        try:
            if not buf or redis is None:
                return
            pipe = redis.pipeline(transaction=False)
            count = 0
            for key, entries in buf.items():
                for e in entries:  # exact trimming: a job's stream is small, and trimming it cheap
                    pipe.xadd(key, {FIELD: encode_progress(e.entry())}, maxlen=s.progress_maxlen, approximate=False)
                    count += 1
                pipe.pexpire(key, int(s.progress_ttl * 1000))
            async with asyncio.timeout(max(1.0, s.progress_interval * 40)):
                await pipe.execute()
            self.sent += count
        except Exception as e:  # noqa: BLE001 - whatever Redis says, progress never fails a job
            self.failed += 1
            now = time.monotonic()
            if now - self._warned > _WARN_EVERY:
                self._warned = now
                log.warning(
                    "progress of %d streamed job(s) not written (%s: %s); their results are unaffected",
                    len(buf),
                    type(e).__name__,
                    e,
                )
        finally:
            self._task = None
            if self._buf and self._timer is None and not self._ctx.closed and not self._held:
                self._timer = asyncio.get_running_loop().call_later(s.progress_interval, self._start)

    async def close(self) -> None:
        """Stop flushing (shutdown): what is buffered is dropped, a flush under way ends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await stop_task(self._task)
        self._buf.clear()
        self._last.clear()
