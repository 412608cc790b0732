"""A load plan traced on the live weights, for replicas that keep no shadow weights.

Runs inside each vLLM worker process. A direct swap (``WeightSyncSettings.ipc_direct``) copies a
leased version from the trainer's tensors straight into the live weights, by a load plan: where
``load_weights`` writes each checkpoint tensor (:mod:`rollq.weightsync.worker._load_trace`). The
shadow weights trace one when a version loads into them; without a shadow (a direct replica
builds none unless ``ROLLQ_SHADOW_WEIGHTS=1``, saving a copy of the weights) the first version
of a manifest loads through ``load_weights`` into the live weights at its swap, traced, and the
next ones are copied by the plan: one device copy per tensor, no ``load_weights``.

>>> import torch
>>> class Model(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = torch.nn.Parameter(torch.zeros(4))
...     def load_weights(self, weights):
...         for name, t in weights:
...             self.w.data[:2 if name == "a" else 4][-2:].copy_(t)
>>> live = LivePlan(Model())
>>> version = [("a", torch.ones(2)), ("b", torch.full((2,), 2.0))]
>>> live.load(version)          # at the first version's swap: through load_weights, traced
>>> from rollq.weightsync.memmap import manifest_of
>>> views = live.views(manifest_of(version))   # version 2 is copied into these bytes
>>> [v.view(torch.float32).tolist() for v in views]
[[1.0, 1.0], [2.0, 2.0]]
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from ._load_trace import Plan, Signature, live_bytes, plan_from, signature_of, traced_load

log = logging.getLogger(__name__)


class LivePlan:
    """The load plan of ``model``'s live parameters, one manifest at a time."""

    def __init__(self, model: Any):
        self.model = model
        self.live = [p for p in {id(p): p for p in model.parameters()}.values()]
        #: The plan (None: none traced yet, or the last traced manifest gave none).
        self.plan: Plan | None = None
        #: Manifests whose trace gave no plan, and why (they keep loading through load_weights).
        self.refused: dict[Signature, str] = {}
        self._views: list[torch.Tensor | None] | None = None

    def wants_trace(self, sig: Signature) -> bool:
        """Whether a load of manifest ``sig`` should be traced (no plan for it, none refused)."""
        return sig not in self.refused and (self.plan is None or self.plan.sig != sig)

    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format ``items`` into the live weights through ``load_weights``
        (generation stopped), recording the plan of their manifest when it gives one."""
        guarded = {b.untyped_storage().data_ptr() for b in self.model.buffers() if b is not None}
        with torch.no_grad():
            trace, sig = traced_load(self.model.load_weights, self.live, guarded, items)
        plan = plan_from(trace, sig)
        if isinstance(plan, str):
            self.refused[sig] = plan
            log.info("no load plan on the live weights for this manifest (%s): direct swaps load through load_weights",
                     plan)
            return
        self.plan, self._views = plan, None
        log.info("load plan recorded on the live weights: %d tensors copied straight into them from now on", len(sig))

    def views(self, metas: Iterable[Any]) -> list[torch.Tensor | None] | None:
        """Per tensor of the manifest (``TensorMeta``-like entries), the live bytes the plan
        puts it in (``uint8``, contiguous; None for a tensor ``load_weights`` ignores); None
        unless the plan is for exactly this manifest. Live parameters never move: built once
        per plan."""
        metas = list(metas)
        if self.plan is None or self.plan.sig != signature_of(metas):
            return None
        if self._views is None:
            self._views = live_bytes(self.live, self.plan.regions, [m.name for m in metas])
        return list(self._views)
