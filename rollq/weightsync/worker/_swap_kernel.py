"""Swapping the bytes of two GPU tensors in one pass (a Triton kernel).

Runs inside each vLLM worker process: the overlapped swap exchanges live and shadow
parameters with it (:meth:`rollq.weightsync.worker._shadow.ShadowWeights.exchange`), reading and
writing each byte once per side, where three copies through a buffer would move it three
times. Without Triton (or a compiler for it) :func:`swap_bytes_` says so and the caller
copies instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_SWAP_KERNEL: Any = None  # Triton kernel of swap_bytes_ (False: Triton unusable here)


def _swap_kernel() -> Any:
    global _SWAP_KERNEL
    if _SWAP_KERNEL is None:
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def swap(a_ptr, b_ptr, n, BLOCK: tl.constexpr):  # noqa: N803 (Triton's constexpr style)
                # grid-stride: fewer programs than blocks leave SMs (and memory bandwidth) to
                # whatever runs beside it (the NCCL receive of the rest of the version)
                step = tl.num_programs(0).to(tl.int64) * BLOCK
                for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
                    offs = start + tl.arange(0, BLOCK)
                    m = offs < n
                    x = tl.load(a_ptr + offs, mask=m)
                    y = tl.load(b_ptr + offs, mask=m)
                    tl.store(a_ptr + offs, y, mask=m)
                    tl.store(b_ptr + offs, x, mask=m)

            _SWAP_KERNEL = swap
        except Exception as e:  # no Triton (or no compiler for it): three copies per byte instead
            log.info("Triton swap kernel unavailable (%s: %s); exchanges go through a bounce buffer", type(e).__name__, e)
            _SWAP_KERNEL = False
    return _SWAP_KERNEL


def swap_bytes_(a: torch.Tensor, b: torch.Tensor, programs: int = 0) -> bool:
    """Swap the contents of two contiguous CUDA tensors of the same size in place, in one
    pass (each byte read and written once on each side), on the current stream. False when
    it cannot (no Triton, not CUDA, not contiguous): use three copies through a buffer.
    ``programs``: at most this many concurrent blocks (0: one per 4096 elements)."""
    if a.device.type != "cuda" or not (a.is_contiguous() and b.is_contiguous()) or not _swap_kernel():
        return False
    ab, bb = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    n = ab.numel()
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if n % w == 0 and ab.data_ptr() % w == 0 and bb.data_ptr() % w == 0:
            ab, bb = ab.view(dt), bb.view(dt)
            break
    _launch_swap(ab, bb, programs)
    return True


def _launch_swap(a: torch.Tensor, b: torch.Tensor, programs: int = 0, block: int = 4096) -> None:
    n = a.numel()
    if n:
        grid = (n + block - 1) // block
        if programs > 0:
            grid = min(grid, programs)
        # Triton launches on the current device's current stream: make that the tensors'
        # device (a thread whose current device is another GPU would run it there, over
        # peer access and unordered with this device's stream).
        with torch.cuda.device(a.device):
            _swap_kernel()[(grid,)](a, b, n, BLOCK=block, num_warps=8)


def warm_swap_kernel(device: torch.device) -> None:
    """Compile :func:`swap_bytes_`'s kernel now for each element width and for lengths with
    and without a multiple of 16 (Triton specializes on both), not inside a swap."""
    if not _swap_kernel():
        return
    for dt in (torch.int64, torch.int32, torch.int16, torch.uint8):
        for n in (4096, 4097):
            _launch_swap(torch.zeros(n, dtype=dt, device=device), torch.ones(n, dtype=dt, device=device))
    torch.cuda.synchronize(device)
