"""How an ``abort`` update ends the requests a replica is running (the follower's part of
:mod:`rollq.consumer._resume`).

Without ``WeightSyncSettings.abort_resume``, or on an engine that does not report the requests
its pause ends (``Engine.reports_aborted``), the requests are aborted and their jobs rerun from
scratch after the swap. With it, the engine's ``pause("abort")`` ends them and reports each
one's samples so far; the jobs continue from those tokens after the swap.
"""

from __future__ import annotations

from typing import Any

from ...settings import WeightSyncSettings
from ..base import ReplicaSide


async def end_running(consumer: ReplicaSide, engine: Any, settings: WeightSyncSettings) -> tuple[list[Any], bool]:
    """End ``consumer``'s running requests for an ``abort`` update: the jobs to restart after
    the swap, and whether the engine is paused already (the swap then does not pause it). If
    collecting the partial samples fails, the engine resumes, the jobs in hand restart from
    scratch, and the error propagates."""
    if not (settings.abort_resume and getattr(engine, "reports_aborted", False)):
        return consumer.abort_running(), False
    consumer.collect_partials()
    await engine.pause("abort")
    try:
        return await consumer.partials(settings.abort_resume_timeout), True
    except BaseException:
        parked = consumer.parked_jobs()
        await engine.resume()
        consumer.restart(parked)
        raise
