"""A swap's copies, timed where they run: the worker's watcher notes when the device reached
them and how long they ran (``SwapTimes.started_at``, ``device_s``), for a benchmark to split
the engine's stop into the wait behind the step in flight and the copies themselves."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from rollq.weightsync.worker._direct_copy import DeviceCopies, Ended, PendingCopy, copy_by_plan
from rollq.weightsync.worker._state import WorkerState
from tests.helpers import until_sync


class HeldEvent:
    """A CUDA event's shape, ended when the test says so; 12.5 ms after another."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def synchronize(self) -> None:
        assert self.ended.wait(10)

    def query(self) -> bool:
        return self.ended.is_set()

    def elapsed_time(self, end: "HeldEvent") -> float:
        assert self.ended.is_set() and end.ended.is_set()
        return 12.5


def test_the_watcher_notes_when_the_device_reached_the_copies_and_how_long_they_ran():
    st = WorkerState(types.SimpleNamespace(device=torch.device("cpu")))
    start, end = HeldEvent(), HeldEvent()
    st.watch_swap(3, DeviceCopies(start, end))
    rec = st.last_swap
    time.sleep(0.05)
    assert rec.started_at is None and rec.done_at is None  # the step before them still runs
    start.ended.set()
    until_sync(lambda: rec.started_at is not None, 5, "the copies reached")
    assert rec.done_at is None and rec.started_at >= rec.enqueued_at + 0.04
    end.ended.set()
    until_sync(lambda: rec.done_at is not None, 5, "the copies ended")
    assert rec.device_s == 0.0125 and rec.torn is None and rec.done_at >= rec.started_at


def test_a_direct_swaps_timed_copies_are_watched_through_its_finish():
    st = WorkerState(types.SimpleNamespace(device=torch.device("cpu")))
    start, end = HeldEvent(), HeldEvent()
    copies = DeviceCopies(start, end)
    pending = PendingCopy(copies, lambda: "released meanwhile", keep=object())
    st.watch_swap(4, copies, finish=pending.finish)
    start.ended.set()
    end.ended.set()
    rec = st.last_swap
    until_sync(lambda: rec.done_at is not None, 5, "the copies ended")
    assert rec.torn == "released meanwhile" and rec.device_s == 0.0125 and rec.started_at is not None


def test_copies_the_host_made_are_timed_on_the_host_and_not_watched_for_a_device():
    live, src = torch.zeros(1 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.uint8)
    end = copy_by_plan([live], [src], torch.device("cpu"))
    assert isinstance(end, Ended) and end.query() and end.seconds() is not None and end.seconds() >= 0
    assert bool((live == 1).all())
    st = WorkerState(types.SimpleNamespace(device=torch.device("cpu")))
    st.watch_swap(5, end)
    until_sync(lambda: st.last_swap.done_at is not None, 5, "the watcher")
    assert st.last_swap.started_at is None and st.last_swap.device_s is None


@pytest.mark.gpu
def test_copies_by_the_plan_on_a_gpu_are_timed_between_two_events():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = torch.device("cuda")
    live = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    src = torch.ones(64 << 20, dtype=torch.uint8, device=dev)
    copies = copy_by_plan([live[: 32 << 20], live[32 << 20 :]], [src[: 32 << 20], src[32 << 20 :]], dev)
    assert isinstance(copies, DeviceCopies)
    st = WorkerState(types.SimpleNamespace(device=dev))
    st.watch_swap(6, copies)
    until_sync(lambda: st.last_swap.done_at is not None, 10, "the copies")
    rec = st.last_swap
    assert rec.started_at is not None and 0 < rec.device_s < 1 and bool((live == 1).all())
