"""Jobs waiting for the policy version they need (``job.min_version`` above the loaded one).

They wait here, outside the in-flight cap (at most ``max_parked``; at that bound the replica
stops pulling and the rest wait in Redis, where other replicas can take them). They start
once the version loads (:meth:`VersionWait.ready`), or fail with
:class:`~rollq.errors.VersionUnavailable` when their version is beyond the newest committed
one for ``max_uncommitted_wait``, when they waited ``max_version_wait`` in all, or when this
replica cannot load the newest committed version (:meth:`VersionWait.version_failed`) and
that version would have served them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from ..errors import VersionUnavailable
from ._context import ReplicaContext, guarded
from ._in_hand import Failure, JobInHand

if TYPE_CHECKING:
    from ._finisher import Finisher

log = logging.getLogger(__name__)


class VersionWait:
    """The waiting jobs, and the task that fails those whose version cannot be reached."""

    def __init__(self, ctx: ReplicaContext, finisher: Finisher) -> None:
        self._ctx = ctx
        self._finisher = finisher
        self.waiting: list[JobInHand] = []
        self._check_now = asyncio.Event()
        self._committed = 0  # newest committed policy version, as last read
        self._load_failure: tuple[int, str] | None = None  # (version, reason) the follower gave up on

    def park(self, held: JobInHand) -> None:
        """Let ``held`` wait for its ``min_version``."""
        now = time.monotonic()
        held.started = 0.0
        held.since = now
        held.beyond_since = now if held.job.min_version > self._committed else None  # refined by the next check
        self.waiting.append(held)
        if held.beyond_since is not None or self._load_failure is not None:
            self._check_now.set()

    def loaded(self, version: int) -> None:
        """``version`` is loaded: a load failure of it or an older one no longer applies."""
        if self._load_failure is not None and version >= self._load_failure[0]:
            self._load_failure = None

    def ready(self, version: int) -> list[JobInHand]:
        """Take out the jobs that ``version`` serves, oldest first."""
        if not self.waiting:
            return []
        ready, keep = [], []
        for w in self.waiting:
            (keep if w.job.min_version > version else ready).append(w)
        self.waiting = keep
        return ready

    def keep_only(self, owned: set[bytes]) -> None:
        """Forget waiting jobs whose entries are not in ``owned``."""
        self.waiting = [w for w in self.waiting if w.eid in owned]

    def version_failed(self, version: int, reason: str) -> None:
        """See :meth:`rollq.consumer.loop.Consumer.version_failed`."""
        self._load_failure = (version, reason[:500])
        self._check_now.set()

    async def run(self) -> None:
        ctx = self._ctx
        while not ctx.closed:
            await ctx.wait_any(self._check_now.wait(), timeout=ctx.settings.heartbeat_interval)
            self._check_now.clear()
            if self.waiting:
                await guarded(log, "version check", self.check)

    async def check(self) -> None:
        """Fail waiting jobs whose version cannot be reached (see the module docstring)."""
        ctx = self._ctx
        v = await ctx.redis.hget(ctx.keys.version, "v")
        committed = self._committed = int(v) if v is not None else 0
        now = time.monotonic()
        keep: list[JobInHand] = []
        failed = 0
        last = ""
        for w in self.waiting:  # no await below: Jobs.release cannot interleave
            if w.job.min_version <= ctx.version:
                keep.append(w)  # released by the next Jobs.release
                continue
            why = self._why_not(w, committed, now)
            if why is None:
                keep.append(w)
                continue
            failed += 1
            last = why
            self._finisher.fail(w, Failure(VersionUnavailable, why))
        if failed:
            self.waiting = keep
            log.warning("consumer %s: %d job(s) failed waiting for a policy version (last: %s)", ctx.id, failed, last[:300])
            ctx.room.set()

    def _why_not(self, w: JobInHand, committed: int, now: float) -> str | None:
        """Why ``w`` can no longer wait, or None; notes when its version was first seen
        to be beyond the committed one."""
        ctx, s, lf = self._ctx, self._ctx.settings, self._load_failure
        m = w.job.min_version
        why = None
        if lf is not None and committed <= lf[0] and m <= lf[0]:
            why = (f"min_version {m}: replica {ctx.id} cannot load policy version {lf[0]}, the newest committed "
                   f"({lf[1]}); it serves version {ctx.version}")
        elif m > committed:
            if w.beyond_since is None:
                w.beyond_since = now
            elif now - w.beyond_since > s.max_uncommitted_wait:
                why = (f"min_version {m} is beyond the newest committed version {committed}: waited "
                       f"{now - w.beyond_since:.1f}s for it to be published (ConsumerSettings.max_uncommitted_wait="
                       f"{s.max_uncommitted_wait})")
        else:
            w.beyond_since = None
        if why is None and now - w.since > s.max_version_wait:
            why = (f"waiting for policy version {m} timed out after {now - w.since:.1f}s on replica {ctx.id} "
                   f"(serving {ctx.version}, newest committed {committed}; ConsumerSettings.max_version_wait="
                   f"{s.max_version_wait})")
        return why
