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

>>> shadow = ShadowWeights(model)                          # doctest: +SKIP
>>> shadow.load(staged_items, stream=side_stream)          # while the engine serves
>>> shadow.swap()                                          # inside the swap RPC
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Iterable

import torch

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


def shadow_parameter(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A parameter of the same class and attributes as ``p`` over new storage.

    vLLM's linear layers use ``Parameter`` subclasses whose loaders are methods writing
    ``self.data`` (``ModelWeightParameter.load_qkv_weight``) and whose state lives in the
    instance dict (``_output_dim``, ``_weight_loader``, ``tp_rank``); plain parameters carry
    ``weight_loader``/``output_dim`` attributes. Both are copied, the data is not.
    """
    data = torch.empty_like(p.data)
    cls = type(p)
    if cls is torch.nn.Parameter:
        sp = torch.nn.Parameter(data, requires_grad=False)
    else:
        sp = cls.__new__(cls, data)  # no __init__: its state is copied below
        sp.requires_grad_(False)
    sp.__dict__.update(vars(p))
    if sp.shape != p.shape or sp.dtype != p.dtype or sp.data_ptr() == p.data_ptr():
        raise TypeError(f"cannot shadow a parameter of type {cls.__name__}")
    return sp


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

    def _copy(self, module: torch.nn.Module) -> torch.nn.Module:
        done = self._modules.get(id(module))
        if done is not None:
            return done
        m = copy.copy(module)  # new __dict__, shared attribute values
        self._modules[id(module)] = m
        params = {}
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

    def load(self, items: Iterable[tuple[str, torch.Tensor]], version: int, stream: torch.cuda.Stream | None = None) -> None:
        """Load checkpoint-format ``items`` into the shadow (on ``stream``; waits for it).

        The shadow holds the live values first (it does right after a swap; otherwise they are
        copied), so a partial update leaves the other weights as they are.
        """
        self.version = None
        cuda = self.live[0].device.type == "cuda"
        ctx = torch.cuda.stream(stream) if (cuda and stream is not None) else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if not self.synced:
                torch._foreach_copy_(self.shadow, self.live)
            self.synced = False  # until the swap makes them equal again
            self.root.load_weights(iter(items))
            if cuda:
                torch.cuda.current_stream(self.live[0].device).synchronize()
        self.version = version

    def swap(self) -> None:
        """Copy the shadow into the live parameters (on the current stream: stream-ordered
        after the engine step in flight and before the next one)."""
        with torch.no_grad():
            torch._foreach_copy_(self.live, self.shadow)
        self.synced = True

