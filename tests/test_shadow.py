"""Shadow weights: versions load into a copy while the live parameters stay untouched."""

from __future__ import annotations

import torch

from rollq.weightsync.shadow import ShadowWeights, shadow_supported


class FusedQKV(torch.nn.Module):
    """Like vLLM's QKVParallelLinear: one fused parameter, a loader bound to the layer."""

    def __init__(self, d: int):
        super().__init__()
        self.d = d
        self.weight = torch.nn.Parameter(torch.zeros(3 * d, d), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.output_dim = 0

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        i = "qkv".index(shard)
        param.data.narrow(param.output_dim, i * self.d, self.d).copy_(loaded)


class Tiny(torch.nn.Module):
    def __init__(self, d: int = 4, vocab: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = FusedQKV(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        for p in self.parameters():
            p.requires_grad_(False)

    def load_weights(self, weights):  # checkpoint names -> fused layout, as vLLM models do
        params = dict(self.named_parameters())
        loaded = set()
        for name, t in weights:
            if name.startswith("qkv."):
                shard = name.split(".")[1][0]
                p = params["qkv.weight"]
                p.weight_loader(p, t, shard)
                loaded.add("qkv.weight")
            else:
                params[name].data.copy_(t)
                loaded.add(name)
        return loaded


def test_shadow_loads_off_line_and_swap_matches_a_direct_load():
    live, ref = Tiny(), Tiny()
    ckpt = [("embed.weight", torch.randn(8, 4)), ("qkv.q_proj", torch.randn(4, 4)),
            ("qkv.k_proj", torch.randn(4, 4)), ("qkv.v_proj", torch.randn(4, 4))]
    ref.load_state_dict(live.state_dict())
    addrs = [p.data_ptr() for p in live.parameters()]
    before = {k: v.clone() for k, v in live.state_dict().items()}
    assert shadow_supported(live) is None
    sh = ShadowWeights(live)
    assert len(sh.live) == 2  # the tied head shares the embedding's shadow
    sh.load(ckpt, version=3)
    assert sh.version == 3
    assert all(torch.equal(v, live.state_dict()[k]) for k, v in before.items())  # live untouched
    sh.swap()
    ref.load_weights(ckpt)
    for k, v in ref.state_dict().items():
        assert torch.equal(live.state_dict()[k], v), k
    assert live.head.weight is live.embed.weight
    assert [p.data_ptr() for p in live.parameters()] == addrs  # same storage: graphs stay valid


def test_partial_update_keeps_the_rest_and_later_live_changes():
    live = Tiny()
    sh = ShadowWeights(live)
    sh.load([("qkv.q_proj", torch.ones(4, 4))], version=1)
    sh.swap()
    assert sh.synced  # right after a swap the shadow equals live: the next load skips the copy
    live.embed.weight.data.fill_(5.0)  # changed by another path (a direct load)...
    sh.synced = False  # ...which says so, as the worker extension's other load paths do
    sh.load([("qkv.k_proj", torch.full((4, 4), 2.0))], version=2)
    sh.swap()
    w = live.qkv.weight
    assert torch.equal(w[:4], torch.ones(4, 4)) and torch.equal(w[4:8], torch.full((4, 4), 2.0))
    assert torch.equal(live.embed.weight, torch.full((8, 4), 5.0))  # not reverted by the swap


class QKVParam(torch.nn.Parameter):
    """Like vLLM's ModelWeightParameter: the loader is a method writing ``self.data``, its
    state lives in the instance dict, and __init__ takes arguments."""

    def __new__(cls, data, **kwargs):
        return super().__new__(cls, data=data, requires_grad=False)

    def __init__(self, data, d: int):
        self._d = d

    def load_qkv_weight(self, loaded: torch.Tensor, shard: str) -> None:
        i = "qkv".index(shard)
        self.data.narrow(0, i * self._d, self._d).copy_(loaded)


def test_parameter_subclasses_with_method_loaders_are_shadowed():
    live = Tiny()
    live.qkv.weight = QKVParam(torch.zeros(12, 4), d=4)
    live.qkv.weight_loader = lambda param, t, shard: param.load_qkv_weight(t, shard)
    live.qkv.weight.weight_loader = live.qkv.weight_loader
    sh = ShadowWeights(live)
    shadow_qkv = sh.root.qkv.weight
    assert type(shadow_qkv) is QKVParam and shadow_qkv._d == 4 and shadow_qkv.data_ptr() != live.qkv.weight.data_ptr()
    sh.load([("qkv.v_proj", torch.full((4, 4), 3.0))], version=1)
    assert live.qkv.weight.abs().sum() == 0
    sh.swap()
    assert torch.equal(live.qkv.weight[8:], torch.full((4, 4), 3.0)) and live.qkv.weight[:8].abs().sum() == 0


def test_unsupported_models_are_reported():
    m = Tiny()
    m.quant_config = object()
    assert "quantized" in shadow_supported(m)
    assert "load_weights" in shadow_supported(torch.nn.Linear(2, 2))
