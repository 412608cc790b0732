"""Replica side of the overlapped swap: going live while a broadcast still arrives.

Runs in the consumer's process, beside :class:`~rollq.weightsync.replica.follower.WeightFollower`.
For the ``keep`` policy, on a one-worker replica that receives versions in place, it stops
generation shortly before an announced offer's receive is expected to end (from this
replica's own past receives, its acks) and has the worker swap each part in as it completes
(:func:`rollq.weightsync.worker._swap.swap_overlapped`), instead of swapping the whole version
after the commit. Generation then stands still for about the lead plus the commit; the
swap's copies and the wait for a step boundary leave the update's path. When it does not
happen (not received in place, the receive failed, no commit in time) the follower's usual
path applies the version once committed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..._tasks import stop_task
from ..base import ReplicaSide
from ..wire import Swap, SwapReport, decode_ack
from .worker_calls import WorkerCalls

log = logging.getLogger(__name__)


class OverlappedSwap:
    """Swaps announced versions in part by part while they arrive.

    ``lead_s`` should cover one engine step plus exchanging the weights (each byte read and
    written on both sides); benchmarks/README.md has the figures for a 7B model.
    ``commit_timeout``: how long after the last byte the worker waits for the commit;
    ``programs``: cap on the exchange kernel's concurrent blocks (0: none).
    ``lock`` is the follower's: an overlapped swap and a reconcile never run together.
    ``set_version(version, report)`` records the version live (inside the pause);
    ``applied(version, report, update_s, pause_s)`` accounts for the update after it.
    The worker waits ``RECEIVE_TIMEOUT`` seconds at most for the receive to end and
    ``START_TIMEOUT`` for it to start.
    """

    RECEIVE_TIMEOUT = 5.0
    START_TIMEOUT = 0.05

    def __init__(
        self, consumer: ReplicaSide, lock: asyncio.Lock, *, set_version: Callable[[int, SwapReport], None],
        applied: Callable[[int, SwapReport, float, float], None], enabled: bool = False, lead_s: float = 0.035,
        commit_timeout: float = 0.25, programs: int = 0, load_timeout: float = 300.0,
    ):
        self.consumer = consumer
        self.workers = WorkerCalls(consumer.engine)
        self.lock = lock
        self._set_version = set_version
        self._applied = applied
        self.enabled = enabled
        self.lead_s = lead_s
        self.commit_timeout = commit_timeout
        self.programs = programs
        self.load_timeout = load_timeout
        #: Overlapped swaps undone (the receive failed, or no commit came in time).
        self.reverts = 0
        #: This replica's in-place receive time (EWMA, seconds); None until one is seen.
        self.receive_est: float | None = None
        self._task: asyncio.Task | None = None

    def possible(self, workers: int, policy: str | None) -> bool:
        """Whether a replica of ``workers`` broadcast workers under ``policy`` swaps this way."""
        return self.enabled and workers == 1 and policy == "keep" and self.receive_est is not None

    def note_acks(self, acks: list[Any] | None) -> None:
        """Learn how long this replica's in-place receives take, from its ack."""
        ack = decode_ack(acks[0]) if acks and len(acks) == 1 and acks[0] else None
        if ack is not None and ack.ok and ack.in_place:
            self.learn(ack.receive_s)

    def learn(self, t: float) -> None:
        self.receive_est = t if self.receive_est is None else 0.7 * self.receive_est + 0.3 * t

    def offered(self, version: int, still_possible: Callable[[], bool]) -> None:
        """Offer ``version`` was announced: schedule its swap unless one is under way."""
        if version > self.consumer.version and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(version, time.monotonic(), still_possible), name="rollq-overlapped-swap")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)

    async def _run(self, version: int, t_offer: float, still_possible: Callable[[], bool]) -> None:
        """Shortly before the receive of ``version`` should end, stop and swap it in."""
        c = self.consumer
        try:
            await asyncio.sleep(max(0.0, t_offer + (self.receive_est or 0.0) - self.lead_s - time.monotonic()))
            async with self.lock:
                if c.version >= version or not still_possible():
                    return
                t0 = time.perf_counter()
                with c.paused_for_update(), c.swapping():
                    res = await asyncio.wait_for(
                        self.workers.swap_overlapped(
                            version=version, commit_timeout=self.commit_timeout, receive_timeout=self.RECEIVE_TIMEOUT,
                            start_timeout=self.START_TIMEOUT, programs=self.programs,
                        ),
                        self.load_timeout,
                    )
                    got = res[0] if res else SwapReport()
                    if got.swap is Swap.OVERLAP:
                        self._set_version(version, got)  # a fresh prefix-cache salt too
                pause_s = time.perf_counter() - t0
                if got.swap is not Swap.OVERLAP:
                    self.reverts += got.swap is Swap.REVERTED
                    log.info("version %d: no overlapped swap (%s); it is applied once committed", version, got.why)
                    return
                if got.receive_s:
                    self.learn(got.receive_s)
                self._applied(version, got, time.monotonic() - t_offer, pause_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the usual path still applies the version once committed
            log.warning("overlapped swap of version %d failed: %s: %s", version, type(e).__name__, e)
