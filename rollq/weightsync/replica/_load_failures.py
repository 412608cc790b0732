"""Replica side: a committed version this replica failed to load, and when to try it again.

Runs in the consumer's process, for :class:`~rollq.weightsync.replica.follower.WeightFollower`. A
version that cannot be loaded is recorded in ``QueueKeys.load_errors``
(:class:`~rollq.weightsync.versions.LoadError`, removed once a version loads) and is not
retried every second: a corrupt or mismatched version (:class:`~rollq.errors.CorruptWeights`,
:class:`~rollq.errors.WeightMismatch`) never again, other failures ``retries`` times with a
doubling delay from ``retry_delay``; after that the replica waits for a newer version and
tells the consumer (``version_failed``), which fails jobs waiting for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ...connection import RETRYABLE
from ...errors import CorruptWeights, WeightMismatch
from ..base import ReplicaSide
from ..ipc_wire import IpcUnavailable
from ..versions import LoadError, report_load_error

log = logging.getLogger(__name__)

#: Longest delay between two attempts at a version that failed to load.
MAX_RETRY_DELAY = 60.0


@dataclass
class Failure:
    """This replica's failure to load one committed version."""

    version: int
    attempts: int
    final: bool  # not retried until a newer version is committed
    retry_at: float  # monotonic


class LoadFailures:
    """The last version ``consumer``'s replica failed to load (:attr:`current`)."""

    def __init__(self, consumer: ReplicaSide, retries: int = 3, retry_delay: float = 2.0):
        self.consumer = consumer
        self.retries = retries
        self.retry_delay = retry_delay
        self.current: Failure | None = None

    def waiting(self, version: int) -> bool:
        """Whether ``version`` failed and its retry is not due yet (or never is)."""
        f = self.current
        return f is not None and f.version == version and (f.final or time.monotonic() < f.retry_at)

    def wake_in(self, wait: float) -> float:
        """``wait``, or less when a retry is due sooner."""
        f = self.current
        if f is not None and not f.final:
            return max(0.0, min(wait, f.retry_at - time.monotonic()))
        return wait

    async def record(self, client: Any, version: int, e: Exception) -> None:
        """Record why ``version`` did not load, here and in Redis; decide whether to retry it."""
        c = self.consumer
        f = self.current
        attempts = f.attempts + 1 if f is not None and f.version == version else 1
        final = isinstance(e, (CorruptWeights, WeightMismatch)) or attempts > self.retries
        delay = min(MAX_RETRY_DELAY, self.retry_delay * 2 ** (attempts - 1))
        self.current = Failure(version, attempts, final, time.monotonic() + delay)
        msg = str(e)[:2000]
        if final:
            log.error(
                "replica %s cannot load policy version %d (%s: %s); it keeps serving version %d and waits for a newer one",
                c.id, version, type(e).__name__, msg[:500], c.version,
            )
        else:
            # A refused IPC version (its trainer released it or exited) is a condition its
            # message tells whole, met at the end of every run: no traceback beside it.
            log.warning(
                "replica %s could not load policy version %d (%s: %s); retry %d of %d in %.1fs (WeightFollower load_retries)",
                c.id, version, type(e).__name__, msg[:500], attempts, self.retries, delay,
                exc_info=None if isinstance(e, IpcUnavailable) else e,
            )
        try:
            await report_load_error(client, c.keys, c.id, LoadError(
                version=version, error=type(e).__name__, message=msg, attempts=attempts, final=final,
            ))
        except RETRYABLE as re:
            log.warning("could not record the load error of version %d in Redis (%s)", version, re)
        if final:
            c.version_failed(version, f"{type(e).__name__}: {msg[:500]}")

    async def clear(self, client: Any) -> None:
        """A version loaded: forget the failure, here and in Redis."""
        self.current = None
        try:
            await client.hdel(self.consumer.keys.load_errors, self.consumer.id)
        except RETRYABLE as e:
            log.debug("could not remove this replica's load error (%s)", e)
