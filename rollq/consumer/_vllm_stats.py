"""Load signals of a vLLM replica, from vLLM's own per-step statistics.

:func:`stat_logger_factory` makes the stat logger passed to
``AsyncLLM.from_engine_args(stat_loggers=[...])``; vLLM's output handler calls it on the event
loop after each engine step, and it copies the figures into a :class:`StatsSink`, which
:meth:`StatsSink.engine_stats` reads for :meth:`~rollq.consumer.vllm_engine.VllmEngine.stats`.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from .engine import EngineStats


class StatsSink:
    """Latest scheduler gauges per engine core plus cumulative counters.

    Filled on the event loop by vLLM's output handler after each engine step (the fields of
    ``SchedulerStats`` and ``IterationStats``; older names are tried where they changed).
    """

    def __init__(self) -> None:
        self.gauges: dict[int, tuple[int, int, float | None]] = {}  # engine -> running, waiting, kv
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.preemptions = 0
        self.finished_requests = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.updated = 0.0  # time.monotonic() of the last scheduler update
        #: time.monotonic() of recent engine steps (outputs reaching this process): the gaps
        #: show how long generation stood still, e.g. during a weight swap.
        self.step_times: collections.deque[float] = collections.deque(maxlen=8192)

    def record(self, engine_idx: int, sched: Any, it: Any) -> None:
        if sched is not None:
            kv = getattr(sched, "kv_cache_usage", None)
            if kv is None:
                kv = getattr(sched, "gpu_cache_usage", None)  # vLLM < 0.10
            waiting = getattr(sched, "num_waiting_reqs", 0) + getattr(sched, "num_skipped_waiting_reqs", 0)
            self.gauges[engine_idx] = (getattr(sched, "num_running_reqs", 0), waiting, kv)
            pcs = getattr(sched, "prefix_cache_stats", None)
            if pcs is not None:
                self.prefix_queries += getattr(pcs, "queries", 0)
                self.prefix_hits += getattr(pcs, "hits", 0)
            self.updated = time.monotonic()
        if it is not None:
            self.step_times.append(time.monotonic())
            self.generated_tokens += getattr(it, "num_generation_tokens", 0)
            self.prompt_tokens += getattr(it, "num_prompt_tokens", 0)
            self.preemptions += getattr(it, "num_preempted_reqs", 0)
            self.finished_requests += len(getattr(it, "finished_requests", ()))

    def engine_stats(self, inflight_jobs: int, unfinished_requests: int | None) -> EngineStats:
        """The gauges summed over engine cores (KV usage: the highest) and the counters; see
        :meth:`~rollq.consumer.vllm_engine.VllmEngine.stats` for the fields."""
        running = waiting = 0
        kv: float | None = None
        for r, w, k in self.gauges.values():
            running += r
            waiting += w
            if k is not None:
                kv = k if kv is None else max(kv, k)
        return EngineStats(
            running=running,
            waiting=waiting,
            kv_usage=kv,
            preemptions=self.preemptions,
            generated_tokens=self.generated_tokens,
            extra={
                "prompt_tokens": self.prompt_tokens,
                "finished_requests": self.finished_requests,
                "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits,
                "inflight_jobs": inflight_jobs,
                "unfinished_requests": unfinished_requests,
                "stats_age_s": (time.monotonic() - self.updated) if self.updated else None,
            },
        )

    def steps_seen(self, since: float, until: float | None = None) -> list[float]:
        """When engine steps were seen in ``[since, until]`` (``time.monotonic``), in order."""
        return [t for t in self.step_times if t >= since and (until is None or t <= until)]

    def step_gaps(self, since: float, until: float | None = None) -> list[float]:
        """Seconds between consecutive engine steps seen in ``[since, until]``."""
        ts = self.steps_seen(since, until)
        return [b - a for a, b in zip(ts, ts[1:])]


def stat_logger_factory(sink: StatsSink) -> Any:
    """A per-engine ``StatLoggerBase`` class (vLLM calls ``factory(vllm_config, engine_idx)``)
    that forwards each step's stats to ``sink``. It holds no reference to the VllmEngine."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class RollqStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *args: Any, **kwargs: Any) -> None:
            sink.record(kwargs.get("engine_idx", self.engine_index), scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return RollqStatLogger
