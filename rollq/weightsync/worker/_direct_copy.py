"""A direct swap's copy by the load plan: enqueued inside the swap call, ended on the device.

Runs inside each vLLM worker process. A direct swap (``WeightSyncSettings.ipc_direct``) copies
the trainer's leased tensors into the live weights' bytes, one copy per tensor. On a GPU the
copies are enqueued on the engine's stream between two steps and the swap call returns at
once: the next step runs after them on the device, so generation stands only while the bytes
move, not while the host waits for them. The replica's claim of the version (which keeps the
trainer from changing the tensors) then ends once the copies have ended:
:meth:`~rollq.weightsync.worker._state.WorkerState.watch_swap` notes when, and whether the
trainer still guaranteed the tensors until then (``SwapTimes.torn``), for the follower to read
(``rollq_swap_done``, and from Redis where the worker watches for IPC versions).

>>> import torch
>>> live, trainer = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
>>> end = copy_by_plan([live[:4], live[4:]], [trainer[:4], trainer[4:]], torch.device("cpu"))
>>> end.query(), live.tolist(), end.seconds() >= 0
(True, [0, 1, 2, 3, 4, 5, 6, 7], True)
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


class Ended:
    """The end of copies the host made itself (already over), where a GPU's copies give
    :class:`DeviceCopies`. ``host_s``: how long the host took for them."""

    def __init__(self, host_s: float | None = None):
        self.host_s = host_s

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def seconds(self) -> float | None:
        return self.host_s


class DeviceCopies:
    """Copies enqueued on a CUDA stream between two timing events, ``start`` and ``end``.

    ``synchronize``/``query`` are the end's (so it stands where a CUDA event does);
    :meth:`wait_started` waits until the device reached the copies (the work enqueued before
    them, such as the engine step in flight, is done); :meth:`seconds` is how long the copies
    ran on the device, once ended."""

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event):
        self.start, self.end = start, end

    def synchronize(self) -> None:
        self.end.synchronize()

    def query(self) -> bool:
        return bool(self.end.query())

    def wait_started(self) -> None:
        self.start.synchronize()

    def seconds(self) -> float | None:
        return float(self.start.elapsed_time(self.end)) / 1000


def timing_event(device: torch.device) -> torch.cuda.Event:
    """A CUDA event that can time, recorded now on ``device``'s current stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(torch.cuda.current_stream(device))
    return ev


def copy_by_plan(dsts: list[torch.Tensor], srcs: list[torch.Tensor], device: torch.device) -> Ended | DeviceCopies:
    """Copy each of ``srcs`` into the bytes ``dsts`` (same sizes, both raw bytes) and return
    what says when the copies ended and how long they took: on a GPU :class:`DeviceCopies`
    around them on the current stream (one device-to-device memcpy per tensor, none waited
    for), else :class:`Ended`."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        torch._foreach_copy_(dsts, srcs)
        return Ended(time.perf_counter() - t0)
    start = timing_event(device)
    # One memcpy per tensor: a byte-wise kernel over hundreds of tensors (the foreach copy)
    # moves far fewer bytes per launch than the copy engine's memcpy does.
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)
    return DeviceCopies(start, timing_event(device))


class PendingCopy:
    """A direct swap's copies still running on the device: ``end`` (an event or
    :class:`Ended`) says when they end, ``torn()`` then says whether the trainer stopped
    guaranteeing its tensors meanwhile (a message) or not (None). Holds the trainer's tensors
    (``keep``) until then: they stay mapped while the device reads them."""

    def __init__(self, end: Any, torn: Callable[[], str | None], keep: Any):
        self.end, self._torn, self._keep = end, torn, keep

    def finish(self) -> str | None:
        """Wait for the copies (without the GIL on a GPU), let go of the trainer's tensors,
        and return :meth:`torn`'s verdict."""
        try:
            self.end.synchronize()
            return self._torn()
        finally:
            self._keep = None
