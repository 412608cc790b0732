"""A blocking facade over :class:`~rollq.producer.client.Producer` for synchronous code.

The async producer runs on a private event loop in a daemon thread; every method here
submits a coroutine to it and waits.

>>> with SyncProducer("redis://127.0.0.1:6379/0", queue="grpo") as p:       # doctest: +SKIP
...     h = p.submit("The capital of France is", sampling={"max_tokens": 8})
...     print(h.result(timeout=30).samples[0].text)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterable, Iterator

from ..protocol import Job, ProgressEntry, Result
from .client import JobHandle, JobSpec, Producer


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollq-sync-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def iterate(self, agen: Any) -> Iterator[Any]:
        """The items of the async generator ``agen`` (run on this loop), one call each."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(agen.aclose())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class SyncJobHandle:
    """Blocking view of a :class:`~rollq.producer.client.JobHandle`."""

    def __init__(self, handle: JobHandle, lt: _LoopThread):
        self._h, self._lt = handle, lt
        self.id = handle.id
        self.duplicate = handle.duplicate

    def done(self) -> bool:
        return self._h.done()

    def result(self, timeout: float | None = None, *, raise_error: bool = True) -> Result:
        return self._lt.run(self._h.result(timeout, raise_error=raise_error))

    def cancel(self) -> bool:
        return self._lt.run(self._h.cancel())

    def stream(self) -> Iterator[ProgressEntry]:
        """The job's tokens while it runs (submitted with ``stream=True``), as
        :meth:`JobHandle.stream <rollq.producer.client.JobHandle.stream>` yields them; then
        :meth:`result`.

        >>> h = p.submit("Once upon a time", sampling={"max_tokens": 64}, stream=True)  # doctest: +SKIP
        >>> for piece in h.stream():                                                   # doctest: +SKIP
        ...     print(piece.sample, piece.offset, piece.text)
        """
        return self._lt.iterate(self._h.stream())


class SyncProducer:
    """Same arguments as :class:`~rollq.producer.client.Producer`."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._lt = _LoopThread()

        async def make() -> Producer:
            return await Producer(*args, **kwargs).connect()

        try:
            self._p: Producer = self._lt.run(make())
        except BaseException:
            self._lt.close()
            raise

    @property
    def producer(self) -> Producer:
        """The async producer underneath; its coroutines run through :meth:`call`."""
        return self._p

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on this producer's event loop thread and return its result (the
        way to use async APIs beside it, e.g. ``sp.call(sp.producer.set_staleness_bound(1, 16))``;
        ``timeout`` in seconds, None: no limit)."""
        return self._lt.run(coro, timeout)

    @property
    def outstanding(self) -> int:
        return self._p.outstanding

    def submit(self, prompt: str | None = None, /, **kw: Any) -> SyncJobHandle:
        return SyncJobHandle(self._lt.run(self._p.submit(prompt, **kw)), self._lt)

    def submit_many(self, specs: Iterable[JobSpec | Job]) -> list[SyncJobHandle]:
        return [SyncJobHandle(h, self._lt) for h in self._lt.run(self._p.submit_many(list(specs)))]

    def cancel(self, job_id: str) -> bool:
        return self._lt.run(self._p.cancel(job_id))

    def results(self, timeout: float | None = None) -> Iterator[Result]:
        """Results as they complete; stops after ``timeout`` s without one."""
        return self._lt.iterate(self._p.results(timeout=timeout))

    def gather(self, handles: list[SyncJobHandle], timeout: float | None = None) -> list[Result]:
        return self._lt.run(self._p.gather([h._h for h in handles], timeout))

    def close(self) -> None:
        try:
            self._lt.run(self._p.close(), timeout=10)
        finally:
            self._lt.close()

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
