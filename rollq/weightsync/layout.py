"""Where a version's bytes go in a broadcast: the flat layout, its buckets, tensor groups.

Both sides compute the same layout from the offer alone (the manifest, or the offsets a
``layout`` offer carries), so no per-tensor message is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .versions import TensorMeta

ALIGN = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _buckets(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    out, start = [], 0
    while start < total:
        end = min(total, start + bucket_bytes)
        out.append((start, end))
        start = end
    return out


@dataclass
class Layout:
    """Where each tensor lives in the flat buffer, and the bucket boundaries."""

    offsets: list[int]  # byte offset of each tensor in the flat buffer
    total: int  # flat buffer size
    buckets: list[tuple[int, int]]  # (start, end) byte ranges, each broadcast once

    @classmethod
    def of(cls, manifest: list[TensorMeta], bucket_bytes: int) -> Layout:
        """The manifest's tensors one after the other, each aligned to :data:`ALIGN` bytes."""
        offsets, pos = [], 0
        for m in manifest:
            pos = _align(pos)
            offsets.append(pos)
            pos += m.nbytes
        total = _align(pos)
        return cls(offsets, total, _buckets(total, bucket_bytes))

    @classmethod
    def explicit(cls, offsets: list[int], total: int, bucket_bytes: int) -> Layout:
        """Given offsets (a receiver's :class:`~rollq.weightsync.wire.FlatLayout`), cut into buckets."""
        return cls(list(offsets), total, _buckets(total, bucket_bytes))

    def views(self, flat: torch.Tensor, manifest: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        return typed_views(manifest, [flat[off : off + m.nbytes] for m, off in zip(manifest, self.offsets)])


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as one flat ``uint8`` tensor: a view where ``t`` is contiguous, else of a
    contiguous copy."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def typed_views(manifest: list[TensorMeta], raw: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` per manifest entry, viewing its raw ``uint8`` bytes in ``raw``."""
    return [(m.name, r.view(getattr(torch, m.dtype)).view(m.shape)) for m, r in zip(manifest, raw)]


def groups_of(manifest: list[TensorMeta], group_bytes: int) -> list[tuple[int, int]]:
    """Index ranges of consecutive tensors up to ``group_bytes`` each (0: one per tensor)."""
    out, start, size = [], 0, 0
    for i, m in enumerate(manifest):
        size += m.nbytes
        if group_bytes <= 0 or size >= group_bytes:
            out.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(manifest):
        out.append((start, len(manifest)))
    return out
