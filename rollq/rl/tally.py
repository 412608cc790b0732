"""A trainer step's figures, computed on the device and read back to the host in one copy.

Each ``float(t)``, ``int(t)``, ``bool(t)`` or boolean-mask index of a GPU tensor waits for
every kernel queued before it, and so does a plain ``.to("cuda")`` of a host tensor (pageable
memory is copied synchronously). A step that reads its figures one by one stalls the GPU's
queue at each read, and, in a thread beside a busy event loop (the RL loop trains in a
thread while the replicas' results arrive), waits for the interpreter lock again after each:
up to ``sys.getswitchinterval()`` (5 ms) per read. :class:`Tally` keeps the figures as device
tensors and reads them all with one copy once the step's kernels are queued;
:func:`masked_summary` gives a masked ``[sum, max, count]`` without leaving the device, and
:func:`to_device` moves host tensors without waiting for the queue.

>>> t = Tally()
>>> x = torch.tensor([0.5, 2.0, 1.0])
>>> t.add("all", masked_summary(x, torch.tensor([True, True, False])))
>>> t.add("none", masked_summary(x, torch.zeros(3, dtype=torch.bool)))
>>> t.add("n", torch.tensor(7))
>>> t.read()
{'all': [2.5, 2.0, 2.0], 'none': [0.0, 0.0, 0.0], 'n': [7.0]}
"""

from __future__ import annotations

import time

import torch

__all__ = ["Tally", "masked_summary", "to_device"]


def masked_summary(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``[sum, max, count]`` of ``values`` where ``sel`` (a bool tensor of their shape) is set,
    as one float64 tensor on their device, with no read back to the host. ``values`` must be
    >= 0 (differences' magnitudes, ratios): the max of nothing selected is 0.

    >>> masked_summary(torch.tensor([[1.0, 3.0], [2.0, 9.0]]), torch.tensor([[True, True], [True, False]])).tolist()
    [6.0, 3.0, 3.0]
    """
    if values.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=values.device)
    v = values.detach()
    picked = torch.where(sel, v, torch.zeros((), dtype=v.dtype, device=v.device))
    return torch.stack([picked.sum().double(), picked.amax().double(), sel.sum().double()])


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. A host tensor bound for a GPU goes through pinned memory with a
    non-blocking copy, queued behind the kernels before it instead of waiting for them (the
    caching host allocator keeps the pinned block until the copy has run).

    >>> to_device(torch.tensor([1, 2]), "cpu").tolist()
    [1, 2]
    """
    dev = torch.device(device)
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


class Tally:
    """Named device tensors read back together (:meth:`read`), and spans of device time
    between marks (:meth:`mark`, :meth:`seconds`): CUDA events on a GPU, the host clock
    elsewhere, so a span measures the kernels it covers and not only their launch."""

    def __init__(self) -> None:
        self._parts: list[tuple[str, torch.Tensor]] = []
        self._marks: dict[str, torch.cuda.Event | float] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        """Keep ``value`` (any shape, on any device) to read as ``name``: a list of floats."""
        self._parts.append((name, value.detach().reshape(-1).double()))

    def mark(self, name: str, device: torch.device) -> None:
        """A point in ``device``'s queue (the host clock's now for a CPU)."""
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(device))
            self._marks[name] = ev
        else:
            self._marks[name] = time.perf_counter()

    def read(self) -> dict[str, list[float]]:
        """Every added tensor's values, by name, after one copy to the host (which waits for
        the kernels that compute them)."""
        if not self._parts:
            return {}
        dev = self._parts[0][1].device
        flat = torch.cat([t.to(dev) for _, t in self._parts]).tolist()
        out, at = {}, 0
        for name, t in self._parts:
            out[name] = flat[at : at + t.numel()]
            at += t.numel()
        return out

    def seconds(self, start: str, end: str) -> float:
        """Seconds from mark ``start`` to mark ``end`` (call after :meth:`read`, or once the
        device has run past ``end``)."""
        a, b = self._marks[start], self._marks[end]
        if isinstance(a, float) and isinstance(b, float):
            return b - a
        if isinstance(a, float) or isinstance(b, float):
            raise ValueError(f"marks {start!r} and {end!r} were taken on different kinds of device")
        b.synchronize()
        return a.elapsed_time(b) / 1000.0
