"""rollq.rl.cores: the trainer's and the replicas' cores on a CPU run."""

from __future__ import annotations

import os
import threading

import pytest

from rollq.rl.cores import CorePlan, available_cores, pin_process, plan_cores


def test_each_replica_gets_one_of_the_last_cores_and_the_trainer_the_rest():
    assert plan_cores(1, cores=[0, 1]) == CorePlan(trainer=(0,), replicas=("1",))
    assert plan_cores(3, cores=[7, 2, 5, 3]) == CorePlan(trainer=(2,), replicas=("3", "5", "7"))
    assert plan_cores(1, cores=[4, 4, 9]) == CorePlan(trainer=(4,), replicas=("9",))  # duplicates count once


def test_too_few_cores_means_no_plan_and_bad_counts_are_refused():
    assert plan_cores(2, cores=[0, 1]) is None
    assert plan_cores(1, cores=[3]) is None
    with pytest.raises(ValueError):
        plan_cores(0, cores=[0, 1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_pinning_moves_the_threads_the_process_already_has():
    """Linux keeps an affinity per thread: a helper thread started before the pin (a torch or
    executor pool thread, say) must end up on the trainer's cores too."""
    before = available_cores()
    started, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def idle() -> None:
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    t = threading.Thread(target=idle, daemon=True)
    t.start()
    assert started.wait(5)
    try:
        assert pin_process(before[:1])
        assert os.sched_getaffinity(0) == {before[0]}
        assert os.sched_getaffinity(tid[0]) == {before[0]}
    finally:
        stop.set()
        t.join(5)
        pin_process(before)
    assert available_cores() == before
