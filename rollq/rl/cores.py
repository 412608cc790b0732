"""Cores for a CPU run of the RL loop: the trainer and each vLLM replica on their own.

On vLLM's CPU backend an engine binds its OpenMP threads to every core it may use
(``VLLM_CPU_OMP_THREADS_BIND=auto``). A trainer on the same machine then runs its forward and
backward passes on cores the engine's threads also run on. :func:`plan_cores` gives the
replicas one core each (the last ones) and the trainer the rest; :func:`pin_process` confines
the trainer's process to its share (``rollq demo --task length --replicas 1`` on 2 cores: 0.93x
the seconds per step, ``benchmarks/demo_cores.py``).

>>> plan_cores(1, cores=[0, 1])
CorePlan(trainer=(0,), replicas=('1',))
>>> plan_cores(2, cores=range(8))
CorePlan(trainer=(0, 1, 2, 3, 4, 5), replicas=('6', '7'))
>>> plan_cores(2, cores=[0, 1]) is None        # too few cores: nothing is pinned
True
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable

log = logging.getLogger(__name__)

__all__ = ["CorePlan", "available_cores", "pin_process", "plan_cores"]


@dataclass(frozen=True)
class CorePlan:
    """Where a CPU run's parts go: the trainer's cores, and each replica's
    ``VLLM_CPU_OMP_THREADS_BIND`` value (``Replicas(cpu_binds=...)``)."""

    trainer: tuple[int, ...]
    replicas: tuple[str, ...]


def available_cores() -> list[int]:
    """The cores this process may run on (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_cores(replicas: int, cores: Iterable[int] | None = None) -> CorePlan | None:
    """One core for each of ``replicas`` replicas, the last of ``cores`` (default: this
    process's, :func:`available_cores`), and the rest for the trainer; None when there are
    fewer than ``replicas + 1`` cores (then nothing should be pinned)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ordered = sorted(set(available_cores() if cores is None else cores))
    if len(ordered) < replicas + 1:
        return None
    split = len(ordered) - replicas
    return CorePlan(trainer=tuple(ordered[:split]), replicas=tuple(str(c) for c in ordered[split:]))


def pin_process(cores: Iterable[int]) -> bool:
    """Confine this process to ``cores``: every thread it has (Linux sets affinity per thread;
    ``/proc/self/task`` lists them) and, through the calling thread, every thread it starts
    later. False, with a warning, where the platform refuses.

    >>> before = available_cores()
    >>> pin_process(before[:1]), available_cores() == before[:1]
    (True, True)
    >>> pin_process(before)
    True
    """
    want = set(cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, want)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        os.sched_setaffinity(0, want)
    except (AttributeError, OSError) as e:
        log.warning("could not pin the trainer to cores %s: %s", sorted(want), e)
        return False
    return True
