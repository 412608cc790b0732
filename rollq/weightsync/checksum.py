"""A fast content checksum of tensors, identical on CPU and GPU.

Each tensor's bytes are read as little-endian int64 words (zero-padded), word ``i`` folded
into lane ``i % 4096``, the lanes weighted by position and reduced modulo 2**64 (int64
arithmetic wraps the same way on every device). The lanes of byte ranges that start at
multiples of :data:`LANE_BYTES` add up to the lanes of the whole (a worker can verify its part).
Native int64 words are read at memory bandwidth: on an H200 the 15.2 GB of a 7B version take
about 5-8 ms (``benchmarks/checksum_layout.py``); int32 words widened to int64, this
checksum's first form, took 24 ms. Together with the dtype and shape it catches torn writes, truncation,
zero-filled pages and swapped tensors, at memory bandwidth on a GPU. It is not a
cryptographic hash: it protects against accidents, not adversaries.

>>> import torch
>>> a = tensor_checksum(torch.ones(3, 5))
>>> a == tensor_checksum(torch.ones(3, 5)), a == tensor_checksum(torch.ones(5, 3))
(True, False)
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np
import torch

log = logging.getLogger(__name__)

_LANES = 4096
#: Bytes per row of lanes: byte ranges starting at multiples of it checksum independently.
LANE_BYTES = 8 * _LANES
_MASK = (1 << 64) - 1
_weights: dict[torch.device, torch.Tensor] = {}


def _lane_weights(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = _weights[device] = torch.arange(1, _LANES + 1, dtype=torch.int64, device=device) * 0x9E3779B1
    return w


def _aligned(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (bytes) where int64 words can be read: a view at an address that is not a
    multiple of 8 (a tensor inside a flat buffer) is copied first."""
    return raw if raw.device.type == "cpu" or raw.data_ptr() % 8 == 0 else raw.clone()


def tensor_checksum(t: torch.Tensor) -> int:
    """Checksum of one tensor's bytes, dtype and shape (an unsigned 64-bit integer)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = _aligned(t.reshape(-1).view(torch.uint8))
    n = raw.numel()
    pad = (-n) % LANE_BYTES
    if raw.device.type == "cpu":
        return buffer_checksum(raw.numpy(), t.dtype, tuple(t.shape))
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    lanes = raw.view(torch.int64).view(-1, _LANES).sum(0)  # wraps mod 2**64
    s = int((lanes * _lane_weights(raw.device)).sum().item()) & _MASK
    meta = _name_hash(f"{t.dtype}|{tuple(t.shape)}|{n}")
    return (s * 1099511628211 + meta) & _MASK


def buffer_checksum(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """:func:`tensor_checksum` of a tensor of ``dtype`` and ``shape`` held in ``raw`` (its
    bytes as ``uint8``: a read-only file mapping will do).

    >>> t = torch.arange(6.0)
    >>> buffer_checksum(t.numpy().view("uint8"), t.dtype, tuple(t.shape)) == tensor_checksum(t)
    True
    """
    n = raw.size
    s = _cpu_sum(raw, (-n) % LANE_BYTES)
    return (s * 1099511628211 + _name_hash(f"{dtype}|{tuple(shape)}|{n}")) & _MASK


def _cpu_sum(raw: np.ndarray, pad: int) -> int:
    """The same reduction as the torch path, without materialising int64 copies."""
    full = (raw.size // LANE_BYTES) * LANE_BYTES
    lanes = np.zeros(_LANES, dtype=np.int64)
    with np.errstate(over="ignore"):
        if full:
            lanes += raw[:full].view("<i8").reshape(-1, _LANES).sum(axis=0, dtype=np.int64)
        if pad:
            tail = np.zeros(LANE_BYTES, dtype=np.uint8)
            tail[: raw.size - full] = raw[full:]
            lanes += tail.view("<i8")
        w = np.arange(1, _LANES + 1, dtype=np.int64) * 0x9E3779B1
        return int((lanes * w).sum(dtype=np.int64)) & _MASK


def state_checksum(named: Iterable[tuple[str, torch.Tensor]], sync_bytes: int = 0, *, graph: bool = False) -> str:
    """Order-independent checksum of named tensors, as 16 hex digits.

    Tensors on one CUDA device are reduced entirely on the device with a single host sync at
    the end (a per-tensor sync costs seconds when a busy engine holds the GIL). With
    ``graph``, by a CUDA graph captured the first time these very tensors are checksummed
    and replayed after (weights updated in place keep their addresses: one launch per
    version); the IPC transport's two sides use it, where it was measured on a GPU. With
    ``sync_bytes`` the current stream is also waited for after every ``sync_bytes`` read, so
    that an engine sharing the GPU runs its steps between the parts instead of behind one
    burst that reads the whole version.
    """
    items = list(named)
    if items and all(t.device.type == "cuda" for _, t in items) and len({t.device for _, t in items}) == 1:
        return f"{_state_checksum_device(items, sync_bytes, graph):016x}"
    return combine_checksums((name, tensor_checksum(t)) for name, t in items)


def combine_checksums(named: Iterable[tuple[str, int]]) -> str:
    """:func:`state_checksum` from each tensor's :func:`tensor_checksum`, computed anywhere
    (the ranks of a trainer with parameter shards each checksum some of the tensors).

    >>> import torch
    >>> t = torch.arange(6.0)
    >>> combine_checksums([("w", tensor_checksum(t))]) == state_checksum([("w", t)])
    True
    """
    acc = 0
    for name, h in named:
        acc = (acc + ((h ^ _name_hash(name)) * 0x100000001B3)) & _MASK
    return f"{acc:016x}"


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


def _state_checksum_device(items: list[tuple[str, torch.Tensor]], sync_bytes: int = 0, graph: bool = False) -> int:
    """The same arithmetic as the host path, in int64 (two's complement wraps like mod 2**64).

    With ``graph`` and without ``sync_bytes``, CUDA tensors are reduced by a captured CUDA
    graph, replayed for every later call on the same tensors (:class:`_GraphedChecksum`)."""
    if graph and sync_bytes <= 0 and items[0][1].device.type == "cuda":
        graphed = _graphed(items)
        if graphed is not None:
            return graphed.run()
    return int(_device_sum(items, _consts(items), sync_bytes).item()) & _MASK


def _consts(items: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Each tensor's meta hash and name hash, on the tensors' device."""
    return torch.tensor(
        [[_signed(_name_hash(f"{t.dtype}|{tuple(t.shape)}|{t.numel() * t.element_size()}")), _signed(_name_hash(n))] for n, t in items],
        dtype=torch.int64, device=items[0][1].device,
    )


def _device_sum(items: list[tuple[str, torch.Tensor]], consts: torch.Tensor, sync_bytes: int = 0) -> torch.Tensor:
    """The checksum as a device scalar (int64), enqueued on the current stream: one reduction
    kernel per tensor (two more where its size is not a multiple of :data:`LANE_BYTES`), then
    three for the whole state."""
    dev = items[0][1].device
    rows = []
    read = 0
    for _, t in items:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        raw = _aligned(t.reshape(-1).view(torch.uint8))
        n = raw.numel()
        full = (n // LANE_BYTES) * LANE_BYTES
        lanes = raw[:full].view(torch.int64).view(-1, _LANES).sum(0) if full else None
        if n > full:
            tail = torch.nn.functional.pad(raw[full:], (0, LANE_BYTES - (n - full))).view(torch.int64)
            lanes = tail if lanes is None else lanes + tail
        rows.append(lanes if lanes is not None else torch.zeros(_LANES, dtype=torch.int64, device=dev))
        read += n
        if sync_bytes > 0 and read >= sync_bytes and dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
            read = 0
    s = (torch.stack(rows) * _lane_weights(dev)).sum(1)
    h = s * 1099511628211 + consts[:, 0]
    return ((h ^ consts[:, 1]) * 0x100000001B3).sum()


#: Captured checksums kept (each holds its intermediates, about 64 KiB per tensor, on the GPU).
GRAPHS_KEPT = 2
_graphs: OrderedDict[tuple[Any, ...], _GraphedChecksum | None] = OrderedDict()
_graphs_lock = threading.Lock()


class _GraphedChecksum:
    """:func:`_device_sum` of fixed tensors captured once as a CUDA graph: each later call is
    one graph launch and one host sync instead of ~8 kernel launches and as many Python
    calls per tensor (a weight-sync thread that shares the GIL with a busy engine waits for
    the GIL at each of them). The graph reads the tensors' addresses; a call with tensors of
    the same names, addresses, dtypes and shapes (:func:`_graph_key`) replays it, which reads
    exactly those tensors' current bytes."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]):
        dev = items[0][1].device
        _lane_weights(dev)  # created outside the capture
        self.consts = _consts(items)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            # thread_local: other threads (an engine serving meanwhile) keep their CUDA calls
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.out = _device_sum(items, self.consts)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.runs = 0
        self._lock = threading.Lock()  # one replay at a time: they share ``out``

    def run(self) -> int:
        with self._lock:
            self.graph.replay()  # on the current stream: after whatever wrote the tensors
            self.runs += 1
            return int(self.out.item()) & _MASK


def _graph_key(items: list[tuple[str, torch.Tensor]]) -> tuple[Any, ...] | None:
    """What a captured checksum is valid for; None where the capture would hold copies of the
    tensors themselves (non-contiguous ones, or unaligned views that are cloned first)."""
    key = []
    for n, t in items:
        if not t.is_contiguous() or t.data_ptr() % 8:
            return None
        key.append((n, t.device.index, t.data_ptr(), t.dtype, tuple(t.shape)))
    return tuple(key)


def _graphed(items: list[tuple[str, torch.Tensor]]) -> _GraphedChecksum | None:
    """The captured checksum of ``items`` (captured on first use), or None where graphs are
    off (``ROLLQ_CHECKSUM_GRAPHS=0``), not applicable, or failed to capture (then the eager
    path is used for these tensors from then on)."""
    if os.environ.get("ROLLQ_CHECKSUM_GRAPHS", "1") == "0" or torch.cuda.is_current_stream_capturing():
        return None
    key = _graph_key(items)
    if key is None:
        return None
    with _graphs_lock:
        if key in _graphs:
            _graphs.move_to_end(key)
            return _graphs[key]
        try:
            g: _GraphedChecksum | None = _GraphedChecksum(items)
        except RuntimeError as e:  # capture refused (e.g. another capture in this thread)
            log.warning("checksum: CUDA graph capture failed (%s); checksumming these tensors eagerly", e)
            g = None
        _graphs[key] = g
        while len(_graphs) > GRAPHS_KEPT:
            _graphs.popitem(last=False)
        return g


def _name_hash(name: str) -> int:
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h
