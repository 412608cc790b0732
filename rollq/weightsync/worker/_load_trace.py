"""Tracing ``load_weights``: where it writes each checkpoint tensor into the shadow weights.

Runs inside each vLLM worker process, under :meth:`rollq.weightsync.worker._shadow.ShadowWeights.load`
with ``trace=True``: a ``TorchDispatchMode`` sees every write ``load_weights`` makes while it
consumes one checkpoint tensor after the other, and records the byte range when the write
is one plain copy of the whole tensor (the load plan is built from those ranges).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Region:
    """Where one checkpoint tensor lands: a byte range of a shadow parameter's storage."""

    param: int  # index into ShadowWeights.shadow; -1: scratch bytes (load_weights ignores it)
    offset: int  # bytes from the parameter's first element
    nbytes: int


Signature = tuple  # ((name, dtype, shape), ...) of a version's tensors, in order


def signature_of(metas: Iterable[Any]) -> Signature:
    """The manifest signature of ``TensorMeta``-like entries (name, dtype, shape)."""
    return tuple((m.name, str(m.dtype).replace("torch.", ""), tuple(m.shape)) for m in metas)


class LoadTrace(TorchDispatchMode):
    """Records the writes ``load_weights`` makes into shadow storage, per checkpoint tensor."""

    def __init__(self, params: list[torch.Tensor], live: set[int]):
        super().__init__()
        # (first byte, end, index) of every shadow parameter, by address: after a relayout
        # they share one storage, so a write is matched to the parameter holding its bytes
        spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i) for i, p in enumerate(params))
        self.starts = [a for a, _, _ in spans]
        self.spans = spans
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.live = live  # storage addresses of live parameters and shared buffers
        #: The tensor load_weights is at; ("<start>"|"<end>", None) before the first and after
        #: the last: a write then cannot be attributed, and refuses the plan.
        self.current: tuple[str, torch.Tensor | None] = ("<start>", None)
        self.regions: dict[str, list[Region]] = {}
        self.other: dict[str, str] = {}  # name -> why it is not a plain copy

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._note(func, args, kwargs)
        return func(*args, **kwargs)

    def _note(self, func: Any, args: tuple, kwargs: dict) -> None:
        name, inp = self.current
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            for x in t if isinstance(t, (list, tuple)) else (t,):
                if not isinstance(x, torch.Tensor) or x.numel() == 0:
                    continue
                base = x.untyped_storage().data_ptr()
                owner = self._owner(x) if base in self.storages else None
                if owner is None:
                    if base in self.live:
                        self.other[name] = f"{func} writes a live tensor"
                    elif base in self.storages:
                        self.other[name] = f"{func} writes shadow bytes outside the parameters"
                    continue
                index, first = owner
                if inp is None:
                    self.other[name] = f"{func} writes a weight outside any tensor's turn"
                    continue
                src = args[1] if len(args) > 1 else None
                if (
                    func is torch.ops.aten.copy_.default and i == 0 and isinstance(src, torch.Tensor)
                    and src.data_ptr() == inp.data_ptr() and src.numel() == inp.numel() and src.dtype == inp.dtype == x.dtype
                    and src.is_contiguous() and inp.is_contiguous() and x.is_contiguous()
                ):
                    self.regions.setdefault(name, []).append(Region(index, x.data_ptr() - first, x.numel() * x.element_size()))
                else:
                    self.other[name] = f"{func} is not a whole-tensor copy"

    def _owner(self, x: torch.Tensor) -> tuple[int, int] | None:
        """(index, first byte) of the shadow parameter holding all of ``x``'s bytes."""
        a = x.data_ptr()
        k = bisect.bisect_right(self.starts, a) - 1
        if k < 0:
            return None
        first, end, index = self.spans[k]
        if a + x.numel() * x.element_size() > end:
            return None
        return index, first
