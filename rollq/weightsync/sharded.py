"""Bucketed gathering of a sharded (DTensor / FSDP2) state dict, one bucket at a time.

Every rank of the trainer group walks the same list of parameters, cut into buckets of at
most ``bucket_bytes`` (by global size). For each bucket the ranks all-gather just that
bucket's tensors (``DTensor.full_tensor()``) and hand the full tensors to ``sink``; the
bucket is released before the next one is gathered. Peak extra memory per rank is therefore
about one bucket (the full tensors of the bucket being gathered), never the whole model.
A single tensor larger than ``bucket_bytes`` forms a bucket of its own.

>>> for bucket in iter_full_buckets(model.state_dict(), bucket_bytes=1 << 30):  # doctest: +SKIP
...     if dist.get_rank() == 0:
...         send(bucket)
"""

from __future__ import annotations

import logging
from typing import Iterator, Mapping

import torch

log = logging.getLogger(__name__)


def _global_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor reports its global shape


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Cut the names of ``state`` (in order) into buckets of at most ``bucket_bytes`` each.

    >>> plan_buckets({"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(8)}, 32)
    [['a', 'b'], ['c']]
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    buckets: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for name, t in state.items():
        n = _global_nbytes(t)
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        buckets.append(cur)
    return buckets


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``: a collective for a DTensor (every rank must call it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t.detach()


def iter_full_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` one bucket at a time; every rank must iterate fully.

    The caller must drop its references to a bucket before asking for the next one, so that
    only one bucket of gathered tensors is alive per rank.

    >>> [[n for n, _ in b] for b in iter_full_buckets({"a": torch.ones(2)}, 64)]
    [['a']]
    """
    for names in plan_buckets(state, bucket_bytes):
        bucket = [(n, full_tensor(state[n])) for n in names]
        log.debug("gathered bucket of %d tensors (%d bytes)", len(bucket), sum(_global_nbytes(t) for _, t in bucket))
        yield bucket
        del bucket
