"""Tracing ``load_weights``: where it writes each checkpoint tensor into a model's parameters.

Runs inside each vLLM worker process, under :meth:`rollq.weightsync.worker._shadow.ShadowWeights.load`
with ``trace=True`` (into the shadow weights) and :meth:`rollq.weightsync.worker._live_plan.LivePlan.load`
(into the live weights): a ``TorchDispatchMode`` sees every write ``load_weights`` makes while it
consumes one checkpoint tensor after the other, and records the byte range when the write
is one plain copy of the whole tensor. :func:`plan_from` builds the load plan from those ranges.

>>> import torch
>>> class Model(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = torch.nn.Parameter(torch.zeros(4))
...     def load_weights(self, weights):
...         for name, t in weights:
...             self.w.data[:2 if name == "a" else 4][-2:].copy_(t)  # "a" -> w[0:2], "b" -> w[2:4]
>>> m = Model()
>>> trace, sig = traced_load(m.load_weights, list(m.parameters()), set(), [("a", torch.ones(2)), ("b", torch.ones(2))])
>>> plan_from(trace, sig).regions
{'a': Region(param=0, offset=0, nbytes=8), 'b': Region(param=0, offset=8, nbytes=8)}
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

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
    """Records the writes ``load_weights`` makes into ``params``' storage, per checkpoint
    tensor; a write into the storages ``guarded`` (addresses: the buffers, the live weights
    beside a shadow) refuses the plan."""

    def __init__(self, params: list[torch.Tensor], guarded: set[int]):
        super().__init__()
        # (first byte, end, index) of every shadow parameter, by address: after a relayout
        # they share one storage, so a write is matched to the parameter holding its bytes
        spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i) for i, p in enumerate(params))
        self.starts = [a for a, _, _ in spans]
        self.spans = spans
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.guarded = guarded
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
                    if base in self.guarded:
                        self.other[name] = f"{func} writes a guarded tensor (a buffer, or the live weights beside the shadow)"
                    elif base in self.storages:
                        self.other[name] = f"{func} writes bytes outside the parameters"
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


def traced_load(load_weights: Callable[[Iterator[tuple[str, torch.Tensor]]], Any], params: list[torch.Tensor],
                guarded: set[int], items: Iterable[tuple[str, torch.Tensor]]) -> tuple[LoadTrace, Signature]:
    """Run ``load_weights`` over ``items`` under a :class:`LoadTrace` of ``params`` (``guarded``:
    storage addresses it must not write); the trace and the manifest signature it consumed.
    Raises RuntimeError when ``load_weights`` rebound a parameter instead of writing it."""
    addrs = [p.data_ptr() for p in params]
    trace = LoadTrace(params, guarded)
    seen: list[tuple[str, str, tuple]] = []

    def follow() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in items:
            seen.append((name, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
            trace.current = (name, t)  # what load_weights does until it asks for the next
            yield name, t
        trace.current = ("<end>", None)

    with trace:
        load_weights(follow())
    if [p.data_ptr() for p in params] != addrs:
        raise RuntimeError("load_weights rebound parameters instead of writing them")
    return trace, tuple(seen)


@dataclass(frozen=True)
class Plan:
    """A load plan: where each tensor of manifest ``sig`` lands; ``scratch_bytes`` receive the
    tensors ``load_weights`` ignores (``Region.param`` -1)."""

    sig: Signature
    regions: dict[str, Region]
    scratch_bytes: int


def plan_from(trace: LoadTrace, sig: Signature) -> Plan | str:
    """The load plan a trace of manifest ``sig`` gives, or why it gives none: every tensor
    written by one whole-tensor copy into bytes no other tensor lands on, or not at all."""
    regions: dict[str, Region] = {}
    scratch = 0
    for edge in ("<start>", "<end>"):
        if edge in trace.other:
            return trace.other[edge]
    for name, dtype, shape in sig:
        if name in trace.other:
            return f"{name}: {trace.other[name]}"
        got = trace.regions.get(name, [])
        if not got:
            # load_weights wrote nothing for it (a tied lm_head, an unused buffer): it is
            # received into scratch bytes, never read (a loader that kept it to write it
            # later would have shown up as a foreign copy under another name: refused)
            n = math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
            regions[name] = Region(-1, scratch, n)
            scratch += (n + 255) // 256 * 256
            continue
        if len(got) != 1:
            return f"{name} was written {len(got)} times"
        regions[name] = got[0]
    if all(r.param < 0 for r in regions.values()):
        return "load_weights wrote none of the tensors"
    spans = sorted((r.param, r.offset, r.offset + r.nbytes) for r in regions.values() if r.param >= 0)
    for (p0, _, e0), (p1, s1, _) in zip(spans, spans[1:]):
        if p0 == p1 and s1 < e0:
            return "two tensors land on overlapping bytes"
    return Plan(sig, regions, scratch)


def bytes_from(p: torch.Tensor) -> torch.Tensor:
    """The bytes of ``p``'s storage from its first element on (``uint8``)."""
    st = p.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=p.device).set_(st)[p.data_ptr() - st.data_ptr() :]


def live_bytes(params: list[torch.Tensor], regions: dict[str, Region], names: Iterable[str]) -> list[torch.Tensor | None]:
    """Per name, the bytes of ``params`` its region covers (``uint8``, contiguous); None for a
    tensor ``load_weights`` ignores."""
    regs = [regions[n] for n in names]
    whole = {i: bytes_from(params[i]) for i in {r.param for r in regs if r.param >= 0}}
    return [whole[r.param][r.offset : r.offset + r.nbytes] if r.param >= 0 else None for r in regs]
