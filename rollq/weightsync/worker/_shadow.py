"""A second copy of a model's parameters that new versions are loaded into while it serves.

vLLM's ``model.load_weights`` turns checkpoint tensors into the engine's layout (fused
``qkv_proj`` and ``gate_up_proj``, tensor-parallel shards, padded vocabularies). Running it
against the live parameters means running it while generation is stopped. Instead, the
shadow is a shallow copy of the model's module tree whose parameters are separate tensors of
the same shapes (with the same ``weight_loader`` and other attributes): ``load_weights`` runs
on it in a background thread and on a side stream while the engine keeps serving, and the
swap is a single ``torch._foreach_copy_`` of shadow into live parameters, enqueued on the
engine's stream between two steps. Parameter addresses never change, so captured CUDA graphs
stay valid.

It costs one more copy of the weights in device memory; :func:`shadow_supported` says when it
can be used (unquantized models, one device, enough free memory).

**Load plan.** A traced load (``load(..., trace=True)``) records, for every checkpoint tensor,
where ``load_weights`` wrote it. When each tensor was written by one plain ``copy_`` of the
whole tensor into one contiguous byte range of a shadow parameter (true for an unsharded
dense model: ``q_proj``/``k_proj``/``v_proj`` are consecutive row blocks of ``qkv_proj``), the
next versions with the same manifest skip ``load_weights`` altogether: :meth:`direct_views`
gives those byte ranges, and transports write into them directly (an NCCL broadcast, a copy
from a page-locked memmap file). Anything else (a transform, a shard of a tensor, two writes,
a loader that defers its copies) keeps ``load_weights`` for the whole version.

>>> shadow = ShadowWeights(model)                          # doctest: +SKIP
>>> shadow.load(staged_items, version=1, trace=True)       # while the engine serves  # doctest: +SKIP
>>> shadow.swap()                                          # inside the swap RPC  # doctest: +SKIP
>>> views = shadow.begin_direct(manifest)                  # version 2: no load_weights  # doctest: +SKIP
>>> # ... receive each tensor's bytes into views[i] ...
>>> shadow.end_direct(2); shadow.swap()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterable

import torch

from ._direct_copy import DeviceCopies, timing_event
from ._load_trace import Plan, Signature, bytes_from, live_bytes, plan_from, signature_of, traced_load
from ._swap_kernel import swap_bytes_, warm_swap_kernel

log = logging.getLogger(__name__)


def shadow_supported(model: torch.nn.Module, *, margin_bytes: int = 1 << 30) -> str | None:
    """None when a shadow of ``model`` can be built, else why not."""
    if not callable(getattr(model, "load_weights", None)):
        return "the model has no load_weights"
    params = {id(p): p for p in model.parameters()}
    if not params:
        return "the model has no parameters"
    if getattr(model, "quant_config", None) is not None:
        return "quantized models need post-load processing; they are not shadowed"
    devs = {p.device for p in params.values()}
    if len(devs) != 1:
        return f"parameters on several devices {sorted(map(str, devs))}"
    dev = next(iter(devs))
    need = sum(p.numel() * p.element_size() for p in params.values())
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if free < need + margin_bytes:
            return f"{free / 2**30:.1f} GiB free on {dev}, a shadow needs {need / 2**30:.1f} GiB + margin"
    return None


def room_for(nbytes: int, device: torch.device, *, margin_bytes: int = 256 << 20) -> bool:
    """Whether ``nbytes`` more fit on ``device`` now: free device memory and the blocks
    PyTorch's allocator holds unused, less a margin (always True off a GPU)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached >= nbytes + margin_bytes


def give_back_cached(device: torch.device) -> None:
    """Return the blocks this process's allocator holds unused on ``device`` to the device
    (nothing to do off a GPU). The storages a flat relayout replaces (a copy of the weights)
    would otherwise stay cached by the worker, out of reach of other processes such as a
    trainer on the same GPU, for as long as the engine runs."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _allocate(nbytes: int, device: torch.device) -> torch.Tensor | None:
    """``nbytes`` of ``uint8`` on ``device``, or None when the device is out of memory."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return None


def shadow_parameter(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A parameter of the same class and attributes as ``p`` over new storage.

    vLLM's linear layers use ``Parameter`` subclasses whose loaders are methods writing
    ``self.data`` (``ModelWeightParameter.load_qkv_weight``) and whose state lives in the
    instance dict (``_output_dim``, ``_weight_loader``, ``tp_rank``); plain parameters carry
    ``weight_loader``/``output_dim`` attributes. Both are copied, the data is not.
    """
    data = torch.empty_like(p.data)
    cls = type(p)
    sp: Any
    if cls is torch.nn.Parameter:
        sp = torch.nn.Parameter(data, requires_grad=False)
    else:
        sp = cls.__new__(cls, data)  # no __init__: its state is copied below
        sp.requires_grad_(False)
    sp.__dict__.update(vars(p))
    if sp.shape != p.shape or sp.dtype != p.dtype or sp.data_ptr() == p.data_ptr():
        raise TypeError(f"cannot shadow a parameter of type {cls.__name__}")
    return sp


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, one copy per tensor (faster on a GPU than
    ``torch._foreach_copy_``: benchmarks/README.md)."""
    for d, s in zip(dst, src):
        d.copy_(s)


class ShadowWeights:
    """Shadow parameters of ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._params: dict[int, torch.nn.Parameter] = {}  # id(live) -> shadow (tied stay tied)
        self._modules: dict[int, torch.nn.Module] = {}
        with torch.no_grad():
            self.root = self._copy(model)
        self.live = [p for p in {id(p): p for p in model.parameters()}.values()]
        self.shadow = [self._params[id(p)] for p in self.live]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.live)
        #: Version currently loaded in the shadow (None: nothing to swap in).
        self.version: int | None = None
        #: Whether shadow == live (true right after a swap); if not, a load starts by copying
        #: live into the shadow so that a partial update keeps the other weights.
        self.synced = False
        #: The load plan: manifest signature and where each tensor lands (see the module doc).
        self.plan: Plan | None = None
        #: Why the last traced load gave no plan (None: it gave one, or none was traced).
        self.plan_refused: str | None = None
        self._no_plan: set[Signature] = set()
        self._bytes: list[torch.Tensor | None] = [None] * len(self.shadow)
        #: :meth:`direct_views` of the plan's manifest (the same bytes every version), and
        #: :meth:`live_views` (the live parameters' bytes by the same plan).
        self._views: list[torch.Tensor] | None = None
        self._live_views: list[torch.Tensor | None] | None = None
        #: Where tensors that load_weights ignores are received (see plan_from).
        self._scratch: torch.Tensor | None = None
        #: The plan's parameters in one buffer (see :meth:`_relayout`): its signature, each
        #: tensor's byte offset in :attr:`flat`, and its size.
        self.flat: torch.Tensor | None = None
        self.flat_layout: tuple[Signature, list[int], int] | None = None
        #: CUDA event after the last swap's copies: nothing rewrites the shadow before it.
        self.swap_event: torch.cuda.Event | None = None
        #: When not :attr:`synced`: the signature of the plan whose bytes are the only ones
        #: where shadow and live may differ (a write of that plan then needs no sync first).
        self._clean_except: Signature | None = None
        self._xtmp: torch.Tensor | None = None  # bounce buffer of :meth:`exchange`
        #: How the last :meth:`exchange` swapped bytes: ``triton`` (one pass) or ``copies``.
        self.exchange_kernel = ""
        if self.live[0].device.type == "cuda":
            warm_swap_kernel(self.live[0].device)  # compiled now, not inside a swap

    def _after_swap(self) -> None:
        """Order the current stream after the last swap (which still reads the shadow)."""
        if self.swap_event is not None:
            torch.cuda.current_stream(self.live[0].device).wait_event(self.swap_event)

    def _copy(self, module: torch.nn.Module) -> torch.nn.Module:
        done = self._modules.get(id(module))
        if done is not None:
            return done
        m = copy.copy(module)  # new __dict__, shared attribute values
        self._modules[id(module)] = m
        params: dict[str, Any] = {}
        for name, p in module._parameters.items():
            if p is None:
                params[name] = None
                continue
            sp = self._params.get(id(p))
            if sp is None:
                sp = self._params[id(p)] = shadow_parameter(p)
            params[name] = sp
        m._parameters = params
        m._buffers = dict(module._buffers)  # shared: buffers are not loaded from checkpoints
        m._modules = {k: (self._copy(c) if c is not None else None) for k, c in module._modules.items()}
        return m

    def wants_trace(self, metas: Iterable[Any]) -> bool:
        """Whether a load of this manifest should be traced (no plan for it yet, none refused)."""
        sig = signature_of(metas)
        return sig not in self._no_plan and (self.plan is None or self.plan.sig != sig)

    def load(
        self, items: Iterable[tuple[str, torch.Tensor]], version: int, stream: torch.cuda.Stream | None = None,
        *, trace: bool = False,
    ) -> None:
        """Load checkpoint-format ``items`` into the shadow (on ``stream``; waits for it).

        The shadow holds the live values first (it does right after a swap; otherwise they are
        copied), so a partial update leaves the other weights as they are. ``trace``: record
        the load plan of this manifest (see the module docstring).
        """
        with self._on(stream), torch.no_grad():
            self._begin_write()
            if trace:
                self._traced_load(items)
            else:
                self.root.load_weights(iter(items))
            if self.live[0].device.type == "cuda":
                torch.cuda.current_stream(self.live[0].device).synchronize()
        self.version = version

    def _on(self, stream: torch.cuda.Stream | None) -> Any:
        """Work on ``stream`` (GPU shadows given one), else where it is."""
        if stream is not None and self.live[0].device.type == "cuda":
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def _begin_write(self, sig: Signature | None = None) -> None:
        """Before a new version is written into the shadow (on the current stream): nothing
        to swap in until it is complete, after the last swap's copies (which read the
        shadow), starting from live's values (a partial update keeps the other weights).

        ``sig``: the write covers exactly the bytes of that plan; when shadow and live differ
        nowhere else (:meth:`exchange` leaves them so), no sync is needed first."""
        self.version = None
        self._after_swap()
        if not self.synced and not (sig is not None and self._clean_except == sig):
            copy_all(self.shadow, self.live)
        self.synced = False  # until the swap makes them equal again
        self._clean_except = sig

    def _traced_load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        live = {p.untyped_storage().data_ptr() for p in self.live}
        live |= {b.untyped_storage().data_ptr() for b in self.model.buffers() if b is not None}
        trace, sig = traced_load(self.root.load_weights, self.shadow, live, items)
        plan = plan_from(trace, sig)
        if isinstance(plan, Plan):
            self._scratch = self.flat_layout = self._views = self._live_views = None
            self.plan, self.plan_refused = plan, None
            self._relayout()
            log.info("load plan recorded: %d tensors written straight into the shadow from now on (%s)", len(sig),
                     "one flat buffer" if self.flat_layout else "parameters apart")
        else:
            self.plan_refused = plan
            self._no_plan.add(sig)
            log.info("no load plan for this manifest (%s): versions keep loading through load_weights", plan)

    def _relayout(self, align: int = 256) -> None:
        """Move the parameters the plan fills completely into one flat buffer, in the order
        the manifest first reaches them, the scratch bytes after them. A version then lands
        in a few large contiguous ranges (:meth:`flat_offsets`): a transport can move it in
        a few calls instead of one per tensor. Skipped when the plan fills a parameter only
        in part (bytes in between would be overwritten) or a parameter is not contiguous."""
        assert self.plan is not None
        sig, regions = self.plan.sig, self.plan.regions
        order: list[int] = []
        filled: dict[int, int] = {}
        for name, _, _ in sig:
            r = regions[name]
            if r.param >= 0:
                if r.param not in filled:
                    order.append(r.param)
                    filled[r.param] = 0
                filled[r.param] += r.nbytes  # regions never overlap (plan_from)
        size = {i: self.shadow[i].numel() * self.shadow[i].element_size() for i in order}
        if any(filled[i] != size[i] or not self.shadow[i].is_contiguous() for i in order):
            return
        base, pos = {}, 0
        for i in order:
            base[i] = pos
            pos = (pos + size[i] + align - 1) // align * align
        scratch_at = pos
        total = scratch_at + self.plan.scratch_bytes
        dev = self.shadow[order[0]].device
        flat = _allocate(total, dev) if room_for(total, dev) else None
        self._bytes = [None] * len(self.shadow)  # views of the storages being replaced
        with torch.no_grad():
            if flat is None:
                # The buffer does not fit beside the parameters it replaces (a second copy of
                # the weights, beside the shadow and a staged version): their bytes wait in
                # host memory while their device memory is freed, then go into the buffer.
                srcs = [self.shadow[i].data.cpu() for i in order]
                for i in order:
                    self.shadow[i].data = torch.empty(0, dtype=self.shadow[i].dtype, device=dev)
                flat = torch.empty(total, dtype=torch.uint8, device=dev)
                log.info("the shadow's flat buffer (%.2f GB) did not fit beside the parameters it replaces: "
                         "their bytes moved through host memory", total / 1e9)
            else:
                srcs = [self.shadow[i].data for i in order]
            for i, src in zip(order, srcs):
                p = self.shadow[i]
                dst = flat[base[i] : base[i] + size[i]]
                dst.copy_(src.reshape(-1).view(torch.uint8))
                p.data = dst.view(src.dtype).view(src.shape)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        # Kept until the copies out of them are done (their blocks may be reused); the loop's
        # last ``src`` is one of them too, and a storage still referenced is not given back.
        del srcs, src
        give_back_cached(dev)
        self._views = None
        self.flat = flat
        self._scratch = flat[scratch_at:] if self.plan.scratch_bytes else None
        offsets = [base[r.param] + r.offset if r.param >= 0 else scratch_at + r.offset for r in (regions[n] for n, _, _ in sig)]
        self.flat_layout = (sig, offsets, total)

    def flat_offsets(self, metas: Iterable[Any]) -> tuple[list[int], int] | None:
        """Each tensor's byte offset in :attr:`flat` and the buffer's size, for exactly this
        manifest; None without a flat layout for it."""
        if self.flat_layout is None or self.flat_layout[0] != signature_of(metas):
            return None
        return list(self.flat_layout[1]), self.flat_layout[2]

    def _param_bytes(self, i: int) -> torch.Tensor:
        """The bytes of shadow parameter ``i`` from its first element on (``uint8``)."""
        b = self._bytes[i]
        if b is None:
            b = self._bytes[i] = bytes_from(self.shadow[i])
        return b

    def direct_views(self, metas: Iterable[Any]) -> list[torch.Tensor] | None:
        """Per tensor of the manifest, the shadow bytes it lands in (``uint8``, contiguous);
        None unless the recorded plan is for exactly this manifest. Built once per plan (the
        receiving thread shares the GIL with the engine: hundreds of tensor calls per version
        would each wait for it)."""
        metas = list(metas)
        if self.plan is None or self.plan.sig != signature_of(metas):
            return None
        if self._views is None:
            regions = self.plan.regions
            if self._scratch is None and self.plan.scratch_bytes:
                self._scratch = torch.empty(self.plan.scratch_bytes, dtype=torch.uint8, device=self.shadow[0].device)
            scratch: Any = self._scratch  # set whenever a region lies in it (r.param < 0)
            self._views = [
                (self._param_bytes(r.param) if r.param >= 0 else scratch)[r.offset : r.offset + r.nbytes]
                for r in (regions[m.name] for m in metas)
            ]
        return list(self._views)

    def live_views(self, metas: Iterable[Any]) -> list[torch.Tensor | None] | None:
        """Per tensor of the manifest, the live parameter bytes the plan puts it in (``uint8``,
        contiguous; None for a tensor ``load_weights`` ignores): where a version copied straight
        into the live weights goes (:meth:`wrote_live` after). None unless the recorded plan is
        for exactly this manifest. Live parameters never move: built once per plan."""
        metas = list(metas)
        if self.plan is None or self.plan.sig != signature_of(metas):
            return None
        if self._live_views is None:
            self._live_views = live_bytes(self.live, self.plan.regions, [m.name for m in metas])
        return list(self._live_views)

    def wrote_live(self, sig: Signature) -> None:
        """A version of manifest ``sig`` went into the live weights (enqueued on the current
        stream; by :meth:`live_views`, or by a plan traced on the live weights): the shadow
        holds nothing to swap in, and differs from live in that plan's bytes (and wherever it
        differed before); its next write starts after these writes."""
        self.version = None
        mine = self.plan is not None and self.plan.sig == sig
        self._clean_except = sig if mine and (self.synced or self._clean_except == sig) else None
        self.synced = False
        self._mark_swap()

    def begin_direct(self, metas: Iterable[Any], stream: torch.cuda.Stream | None = None) -> list[torch.Tensor] | None:
        """Start a version written straight into the shadow: the views to write (see
        :meth:`direct_views`), after syncing the shadow with live if needed (on ``stream``).
        Call :meth:`end_direct` once the bytes are in, or :meth:`invalidate` on failure."""
        views = self.direct_views(metas)
        if views is None:
            return None
        assert self.plan is not None  # direct_views needs it
        with self._on(stream), torch.no_grad():
            self._begin_write(self.plan.sig)  # the writes into ``views`` go on this stream, after it
        return views

    def params_by_part(self, metas: Iterable[Any], part_of: list[int]) -> list[list[int]] | None:
        """Group the shadow parameters the plan writes by the part of a transfer that
        completes them: ``part_of[j]`` is the part (bucket, group) holding the last bytes of
        manifest tensor ``j``; a parameter written by several tensors (a fused ``qkv_proj``)
        is complete with the last of them. None without a plan for this manifest."""
        metas = list(metas)
        if self.plan is None or self.plan.sig != signature_of(metas):
            return None
        regions = self.plan.regions
        last: dict[int, int] = {}
        for m, k in zip(metas, part_of):
            r = regions[m.name]
            if r.param >= 0:
                last[r.param] = max(last.get(r.param, k), k)
        out: list[list[int]] = [[] for _ in range(max(part_of, default=-1) + 1)]
        for i, k in last.items():
            out[k].append(i)
        return out

    def exchange(self, indices: Iterable[int], chunk_bytes: int = 256 << 20, programs: int = 0) -> None:
        """Swap the values of live and shadow parameters ``indices`` (enqueued on the current
        stream). Unlike :meth:`swap` it can be undone (exchange again): an update swapped in
        part by part while it still arrives (:mod:`rollq.weightsync.worker._swap`) goes back to the old
        weights if it fails or is never committed. On CUDA with Triton one kernel per
        parameter reads and writes each byte once per side (twice :meth:`swap`'s traffic);
        otherwise three copies through a bounce buffer of ``chunk_bytes`` (three times).
        ``programs``: cap on the kernel's concurrent blocks (see :func:`swap_bytes_`)."""
        with torch.no_grad():
            for i in indices:
                a, b = self.live[i], self.shadow[i]
                if swap_bytes_(a, b, programs):
                    self.exchange_kernel = "triton"
                    continue
                self.exchange_kernel = "copies"
                if not (a.is_contiguous() and b.is_contiguous()):
                    t = a.clone()
                    a.copy_(b)
                    b.copy_(t)
                    continue
                ab, bb = a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)
                n = ab.numel()
                if self._xtmp is None or self._xtmp.device != a.device:
                    biggest = max(p.numel() * p.element_size() for p in self.live)
                    self._xtmp = torch.empty(min(chunk_bytes, biggest), dtype=torch.uint8, device=a.device)
                step = self._xtmp.numel()
                for s in range(0, n, step):
                    e = min(n, s + step)
                    t = self._xtmp[: e - s]
                    t.copy_(ab[s:e])
                    ab[s:e].copy_(bb[s:e])
                    bb[s:e].copy_(t)
            self._mark_swap()

    def exchanged(self, version: int) -> torch.cuda.Event | None:
        """``version`` went live by :meth:`exchange` (the shadow now holds the old values of
        the plan's bytes): nothing left to swap; returns the event after the exchanges."""
        self.version = None
        self.synced = False
        return self.swap_event

    def end_direct(self, version: int) -> None:
        """The bytes of ``version`` are all in (the caller waited for its copies)."""
        self.version = version

    def invalidate(self) -> None:
        """Nothing valid to swap in (a load or a direct write failed part way)."""
        self.version = None
        self.synced = False

    def swap(self) -> DeviceCopies | None:
        """Copy the shadow into the live parameters (on the current stream: stream-ordered
        after the engine step in flight and before the next one). On a GPU this only
        enqueues the copies; the returned :class:`DeviceCopies` marks their end (the shadow is
        not rewritten before it) and times them. None off a GPU (the copies are done)."""
        dev = self.live[0].device
        start = timing_event(dev) if dev.type == "cuda" else None
        with torch.no_grad():
            copy_all(self.live, self.shadow)
        self.synced = True
        self._mark_swap()
        if start is None or self.swap_event is None:
            return None
        return DeviceCopies(start, self.swap_event)

    def _mark_swap(self) -> None:
        """Record :attr:`swap_event` after the work just enqueued on the current stream (that
        reads or writes the shadow): the next write into the shadow waits for it."""
        if self.live[0].device.type == "cuda":
            self.swap_event = timing_event(self.live[0].device)

