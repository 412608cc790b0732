"""Shadow weights: versions load into a copy while the live parameters stay untouched."""

from __future__ import annotations

import pytest
import torch

from rollq.weightsync.worker._shadow import ShadowWeights, shadow_supported


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


# -- load plan: later versions skip load_weights ---------------------------------------------
class Meta:
    def __init__(self, name: str, t: torch.Tensor):
        self.name, self.dtype, self.shape = name, str(t.dtype).removeprefix("torch."), list(t.shape)


def ckpt(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(8, 4, generator=g))] + [
        (f"qkv.{s}_proj", torch.randn(4, 4, generator=g)) for s in "qkv"
    ]


def test_traced_load_gives_a_plan_and_direct_writes_equal_load_weights():
    live, ref = Tiny(), Tiny()
    sh = ShadowWeights(live)
    v1 = ckpt(1)
    assert sh.wants_trace([Meta(n, t) for n, t in v1])
    sh.load(v1, version=1, trace=True)
    assert sh.plan is not None and sh.plan_refused is None
    sh.swap()
    v2 = ckpt(2)
    metas = [Meta(n, t) for n, t in v2]
    assert not sh.wants_trace(metas)
    views = sh.begin_direct(metas)
    assert views is not None and [v.numel() for v in views] == [t.numel() * 4 for _, t in v2]
    for v, (_, t) in zip(views, v2):  # what a transport does: raw bytes into the views
        v.copy_(t.reshape(-1).view(torch.uint8))
    sh.end_direct(2)
    assert sh.version == 2
    sh.swap()
    ref.load_weights(v2)
    for k, v in ref.state_dict().items():
        assert torch.equal(live.state_dict()[k], v), k
    # another manifest (a tensor more, a shape changed) has no plan: load_weights again
    assert sh.direct_views(metas[:2]) is None and sh.wants_trace(metas[:2])


def test_loaders_that_do_more_than_copy_get_no_plan():
    class Scaled(Tiny):
        def load_weights(self, weights):
            for name, t in weights:
                if name == "embed.weight":
                    self.embed.weight.data.copy_(t * 2)  # a transform: not a plain copy
                else:
                    super().load_weights([(name, t)])

    class Twice(Tiny):
        def load_weights(self, weights):
            for name, t in weights:
                super().load_weights([(name, t)])
                if name == "qkv.q_proj":
                    self.qkv.weight.data[4:8].copy_(t)  # the same tensor lands in two places

    for cls, why in ((Scaled, "not a whole-tensor copy"), (Twice, "written 2 times")):
        live = cls()
        sh = ShadowWeights(live)
        sh.load(ckpt(1), version=1, trace=True)
        assert sh.plan is None and why in sh.plan_refused, sh.plan_refused
        metas = [Meta(n, t) for n, t in ckpt(1)]
        assert sh.direct_views(metas) is None and not sh.wants_trace(metas)  # not traced again
        sh.swap()  # the traced load itself loaded correctly
        ref = cls()
        ref.load_weights(ckpt(1))
        assert all(torch.equal(live.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_direct_write_after_live_changed_starts_from_live():
    live = Tiny()
    sh = ShadowWeights(live)
    sh.load(ckpt(1), version=1, trace=True)
    sh.swap()
    sh.invalidate()  # as a failed version leaves it
    live.qkv.weight.data.fill_(3.0)
    part = [("embed.weight", torch.ones(8, 4))]
    sh.load(part, version=2, trace=True)  # another manifest: traced, plan for it
    metas = [Meta(n, t) for n, t in part]
    live.qkv.weight.data.fill_(4.0)  # live changed behind the shadow (a direct load)
    sh.synced = False
    views = sh.begin_direct(metas)
    views[0].copy_(torch.full((8, 4), 5.0).view(-1).view(torch.uint8))
    sh.end_direct(3)
    sh.swap()
    assert torch.equal(live.embed.weight, torch.full((8, 4), 5.0)) and bool((live.qkv.weight == 4.0).all())


def test_tensors_load_weights_ignores_are_received_into_scratch():
    class TiedHead(Tiny):  # vLLM's loaders skip lm_head.weight when it is tied to the embedding
        def load_weights(self, weights):
            return super().load_weights((n, t) for n, t in weights if n != "head.weight")

    live, ref = TiedHead(), TiedHead()
    sh = ShadowWeights(live)
    v1 = ckpt(1) + [("head.weight", torch.randn(8, 4))]
    sh.load(v1, version=1, trace=True)
    assert sh.plan is not None, sh.plan_refused
    sh.swap()
    v2 = ckpt(2) + [("head.weight", torch.full((8, 4), 9.0))]
    views = sh.begin_direct([Meta(n, t) for n, t in v2])
    a = views[-1].data_ptr()
    assert all(not (p.data_ptr() <= a < p.data_ptr() + p.numel() * 4) for p in sh.shadow)  # scratch, not a weight
    for v, (_, t) in zip(views, v2):
        v.copy_(t.reshape(-1).view(torch.uint8))
    sh.end_direct(2)
    sh.swap()
    ref.load_weights(v2)
    for k, v in ref.state_dict().items():
        assert torch.equal(live.state_dict()[k], v), k  # the head is the embedding, not 9.0


def test_loaders_that_write_after_the_iterator_ends_get_no_plan():
    class Eager(Tiny):
        def load_weights(self, weights):
            return super().load_weights(list(weights))  # copies all happen after the last yield

    class Deferred(Tiny):  # q/k/v are kept and written once the iterator is exhausted
        def load_weights(self, weights):
            kept = []
            for name, t in weights:
                if name.startswith("qkv."):
                    kept.append((name, t))
                else:
                    super().load_weights([(name, t)])
            return super().load_weights(kept)

    for cls in (Eager, Deferred):
        sh = ShadowWeights(cls())
        sh.load(ckpt(1), version=1, trace=True)
        assert sh.plan is None and "outside any tensor's turn" in sh.plan_refused, sh.plan_refused


def test_the_plan_puts_the_shadow_in_one_flat_buffer_in_manifest_order():
    live, ref = Tiny(), Tiny()
    sh = ShadowWeights(live)
    v1 = ckpt(1)
    sh.load(v1, version=1, trace=True)
    metas = [Meta(n, t) for n, t in v1]
    offsets, total = sh.flat_offsets(metas)
    assert sh.flat is not None and sh.flat.numel() == total
    # embed (8x4) first, then the fused qkv (12x4) whose q/k/v blocks follow one another
    assert offsets == [0, 256, 256 + 64, 256 + 128]
    assert all(p.untyped_storage().data_ptr() == sh.flat.untyped_storage().data_ptr() for p in sh.shadow)
    sh.swap()
    ref.load_weights(v1)
    assert all(torch.equal(live.state_dict()[k], v) for k, v in ref.state_dict().items())
    # a version arriving as flat bytes at those offsets (one transfer) swaps in like load_weights
    v2 = ckpt(2)
    views = sh.begin_direct(metas)
    stream = torch.zeros(total, dtype=torch.uint8)
    for off, (_, t) in zip(offsets, v2):
        b = t.reshape(-1).view(torch.uint8)
        stream[off : off + b.numel()] = b
    sh.flat.copy_(stream)
    sh.end_direct(2)
    sh.swap()
    ref.load_weights(v2)
    for k, v in ref.state_dict().items():
        assert torch.equal(live.state_dict()[k], v), k
    assert views[1].data_ptr() == sh.flat.data_ptr() + 256


def test_a_parameter_the_plan_fills_in_part_keeps_the_shadow_apart():
    sh = ShadowWeights(Tiny())
    part = [("qkv.q_proj", torch.ones(4, 4)), ("embed.weight", torch.ones(8, 4))]  # k and v not sent
    sh.load(part, version=1, trace=True)
    assert sh.plan is not None and sh.flat is None and sh.flat_offsets([Meta(n, t) for n, t in part]) is None


@pytest.mark.parametrize("why", ["no room", "out of memory"])
def test_a_flat_buffer_without_room_beside_the_shadow_is_filled_through_host_memory(monkeypatch, why):
    """When the flat buffer would not fit beside the parameters it replaces (a second copy
    of the weights at the first version's load), their bytes wait in host memory and their
    device memory is freed before the buffer is allocated; layout and values are the same."""
    from rollq.weightsync.worker import _shadow

    live, ref = Tiny(), Tiny()
    sh = ShadowWeights(live)
    v1 = ckpt(1)
    metas = [Meta(n, t) for n, t in v1]
    if why == "no room":
        monkeypatch.setattr(_shadow, "room_for", lambda nbytes, device, **kw: False)
    else:
        monkeypatch.setattr(_shadow, "_allocate", lambda nbytes, device: None)
    real_empty = torch.empty
    held: list[tuple[int, int]] = []  # (bytes allocated, shadow elements still held) per uint8 allocation

    def empty(*size, **kw):
        if kw.get("dtype") is torch.uint8 and size and isinstance(size[0], int) and size[0] > 0:
            held.append((size[0], sum(p.data.numel() for p in sh.shadow)))
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    sh.load(v1, version=1, trace=True)
    monkeypatch.setattr(torch, "empty", real_empty)
    offsets, total = sh.flat_offsets(metas)
    assert offsets == [0, 256, 256 + 64, 256 + 128] and sh.flat is not None and sh.flat.numel() == total
    assert [h for n, h in held if n == total] == [0]  # nothing of the old shadow held beside the buffer
    assert all(p.untyped_storage().data_ptr() == sh.flat.untyped_storage().data_ptr() for p in sh.shadow)
    sh.swap()
    ref.load_weights(v1)
    assert all(torch.equal(live.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_the_relayout_lets_go_of_every_storage_it_replaced_before_giving_memory_back(monkeypatch):
    """When the flat relayout hands the allocator's unused blocks back to the device, no
    reference to a replaced storage is left (one still held, such as a loop's last variable,
    is not freed, and on a GPU its block stays cached in the worker)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from rollq.weightsync.worker import _shadow

    sh = ShadowWeights(Tiny())
    old = [StorageWeakRef(p.untyped_storage()) for p in sh.shadow]
    alive_then: list[int] = []
    monkeypatch.setattr(_shadow, "give_back_cached", lambda device: alive_then.append(sum(not r.expired() for r in old)))
    sh.load(ckpt(1), version=1, trace=True)
    assert sh.flat is not None and alive_then == [0]


class Big(torch.nn.Module):
    """Two 64 MiB float32 parameters on the GPU."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4096, 4096, device="cuda"), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(4096, 4096, device="cuda"), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for n, t in weights:
            params[n].data.copy_(t)
        return set(params)


@pytest.mark.gpu
def test_the_first_traced_load_holds_one_copy_of_the_weights_beside_the_model_when_memory_is_short(monkeypatch):
    """On a GPU with too little room for a second shadow, the relayout into the flat buffer
    peaks at one shadow's bytes beside the live weights (not two)."""
    from rollq.weightsync.worker import _shadow

    live = Big()
    ckpt_ = [(n, torch.full((4096, 4096), float(i + 1))) for i, n in enumerate("ab")]  # host tensors
    monkeypatch.setattr(_shadow, "room_for", lambda nbytes, device, **kw: False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sh = ShadowWeights(live)
    sh.load(ckpt_, version=1, trace=True)
    peak = torch.cuda.max_memory_allocated() - base
    assert sh.flat is not None
    assert peak < 1.25 * sh.nbytes, (peak, sh.nbytes)  # the copy of the weights, not two
    sh.swap()
    assert bool((live.a == 1).all()) and bool((live.b == 2).all())


@pytest.mark.gpu
def test_the_relayout_returns_the_storages_it_replaced_to_the_device():
    """The shadow's parameters moved into its flat buffer leave their old storages free; they
    go back to the device, not into the worker's allocator cache, where a shadow of a 7B model
    kept 15 GB the trainer beside it could not use."""
    live = Big()
    ckpt_ = [(n, torch.full((4096, 4096), float(i + 1), device="cuda")) for i, n in enumerate("ab")]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    sh = ShadowWeights(live)
    sh.load(ckpt_, version=1, trace=True)
    assert sh.flat is not None
    grown = torch.cuda.memory_reserved() - reserved
    assert grown < 1.5 * sh.nbytes, (grown, sh.nbytes)  # the flat shadow, not it and the old storages
    sh.swap()
    assert bool((live.a == 1).all()) and bool((live.b == 2).all())
