"""The load plan traced on the live weights (no shadow weights): the first version of a manifest
loads through ``load_weights`` and records where each tensor lands; the next are copied there."""

from __future__ import annotations

import torch

from rollq.weightsync.memmap import manifest_of
from rollq.weightsync.worker._live_plan import LivePlan
from tests.weightsync.test_shadow import Tiny, ckpt


def _copy_by(views: list[torch.Tensor | None], items: list[tuple[str, torch.Tensor]]) -> None:
    """What a direct swap does: each tensor's bytes into its view."""
    for v, (_, t) in zip(views, items):
        if v is not None:
            v.copy_(t.reshape(-1).view(torch.uint8))


def test_versions_copied_by_the_traced_plan_equal_load_weights():
    live, ref = Tiny(), Tiny()
    plan = LivePlan(live)
    v1 = ckpt(1)
    assert plan.wants_trace(tuple((m.name, m.dtype, tuple(m.shape)) for m in manifest_of(v1)))
    plan.load(v1)
    ref.load_weights(v1)
    assert all(torch.equal(live.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert plan.plan is not None and not plan.refused
    addrs = [p.data_ptr() for p in live.parameters()]
    for seed in (2, 3):
        v = ckpt(seed)
        views = plan.views(manifest_of(v))
        assert views is not None and len(views) == len(v)
        _copy_by(views, v)
        ref.load_weights(v)
        for k, want in ref.state_dict().items():
            assert torch.equal(live.state_dict()[k], want), (seed, k)
    assert [p.data_ptr() for p in live.parameters()] == addrs  # captured graphs stay valid
    # another manifest (a tensor fewer) has no plan: the next direct swap traces it
    fewer = manifest_of(ckpt(4)[:2])
    assert plan.views(fewer) is None


def test_a_tensor_load_weights_ignores_has_no_bytes_and_a_transforming_loader_gives_no_plan():
    class Extra(Tiny):
        def load_weights(self, weights):
            return super().load_weights((n, t) for n, t in weights if n != "rotary.inv_freq")

    live = Extra()
    plan = LivePlan(live)
    v1 = ckpt(1) + [("rotary.inv_freq", torch.ones(2))]
    plan.load(v1)
    views = plan.views(manifest_of(v1))
    assert views is not None and views[-1] is None and all(v is not None for v in views[:-1])

    class Scaled(Tiny):
        def load_weights(self, weights):
            for name, t in weights:
                super().load_weights([(name, t * 2 if name == "embed.weight" else t)])

    live = Scaled()
    plan = LivePlan(live)
    v1 = ckpt(1)
    plan.load(v1)
    assert torch.equal(live.embed.weight, v1[0][1] * 2)  # loaded all the same
    sig = tuple((m.name, m.dtype, tuple(m.shape)) for m in manifest_of(v1))
    assert plan.plan is None and sig in plan.refused and not plan.wants_trace(sig)
    assert plan.views(manifest_of(v1)) is None


def test_a_loader_that_writes_a_buffer_gives_no_plan():
    class Buffered(Tiny):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.zeros(1))

        def load_weights(self, weights):
            for name, t in weights:
                super().load_weights([(name, t)])
                self.scale.fill_(1.0)  # state beside the weights: a copy would skip it

    plan = LivePlan(Buffered())
    plan.load(ckpt(1))
    assert plan.plan is None and "writes a guarded tensor" in next(iter(plan.refused.values()))
