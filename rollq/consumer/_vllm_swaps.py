"""Which requests a weight swap's progress report concerns, as the vLLM adapter tracks them.

At a swap every vLLM worker reports how many tokens each request had
(:meth:`rollq.weightsync.worker._progress.RequestTracker.report`): the requests it holds and
those it let go of lately, whose outputs may still be on their way. :class:`SwapLedger` keeps,
for :class:`~rollq.consumer.vllm_engine.VllmEngine`, when each request still waiting for its
output was submitted (so the report may leave out what ended before: :meth:`SwapLedger.since`)
and which requests reported lately, and maps a report to the adapter's request ids
(:meth:`SwapLedger.progress`).

>>> ledger = SwapLedger()
>>> ledger.started("a"); ledger.started("b"); ledger.reported("a")
>>> sorted(ledger.submitted), list(ledger.recent)
(['b'], ['a'])
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

from . import _vllm_api
from .engine import SwapProgress

if TYPE_CHECKING:
    from ..weightsync.wire import Progress

__all__ = ["PROGRESS_SLACK_S", "RECENT_KEEP", "SwapLedger"]

#: Request ids that reported, remembered for :meth:`SwapLedger.progress` (the newest).
RECENT_KEEP = 4096
#: Seconds :meth:`SwapLedger.since` reaches back before the oldest request in flight: room for
#: the clocks of workers on other hosts (tensor parallel over nodes) and for steps of the wall
#: clock.
PROGRESS_SLACK_S = 5.0


class SwapLedger:
    """The requests of one adapter as its swaps' progress reports concern them."""

    def __init__(self) -> None:
        #: When each request still waiting for its output was submitted (``time.time()``), oldest first.
        self.submitted: dict[str, float] = {}
        #: Request ids that reported lately (a swap's report may still name them).
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    def started(self, rid: str) -> None:
        """``rid`` was submitted now."""
        self.submitted[rid] = time.time()

    def dropped(self, rid: str) -> None:
        """``rid`` was aborted: nobody waits for its output."""
        self.submitted.pop(rid, None)

    def reported(self, rid: str) -> None:
        """``rid``'s output came back."""
        self.submitted.pop(rid, None)
        self.recent[rid] = None
        if len(self.recent) > RECENT_KEEP:
            self.recent.popitem(last=False)

    def since(self) -> float:
        """A wall-clock time before which vLLM let go of no request whose output the adapter
        still waits for: the oldest such request's submission, less :data:`PROGRESS_SLACK_S`.
        A swap's report then covers the requests in flight, not every request of the last 30 s
        (:attr:`rollq.weightsync.worker._progress.RequestTracker.since`).

        >>> ledger = SwapLedger(); ledger.submitted = {"a": 100.0, "b": 101.5}
        >>> ledger.since()
        95.0
        """
        oldest = next(iter(self.submitted.values()), None)
        return (time.time() if oldest is None else oldest) - PROGRESS_SLACK_S

    def progress(self, report: Progress, complete: bool) -> SwapProgress:
        """A worker's swap progress (tokens per engine request id) mapped to the adapter's
        request ids (vLLM's own ids are read by :func:`rollq.consumer._vllm_api.request_of`);
        ``complete`` also needs the adapter's say (its workers track the requests)."""
        running = set(self.submitted).union(self.recent)  # a request may have reported since the swap
        out: dict[str, dict[int, int]] = {}
        for eid, n in report.tokens.items():
            rid, j = _vllm_api.request_of(eid, running)
            if rid is not None:
                out.setdefault(rid, {})[j] = n
        return SwapProgress(tokens=out, complete=report.complete and complete)
