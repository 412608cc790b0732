"""Device-side figures read back in one copy (rollq.rl.tally)."""

from __future__ import annotations

import pytest
import torch

from rollq.rl.tally import Tally, masked_summary, to_device


def test_masked_summary_matches_picking_the_tokens_out():
    gen = torch.Generator().manual_seed(0)
    d = torch.rand(6, 5, generator=gen)
    sel = torch.rand(6, 5, generator=gen) > 0.4
    s, m, k = masked_summary(d, sel).tolist()
    assert s == pytest.approx(float(d[sel].sum()), rel=1e-6)
    assert (m, k) == (float(d[sel].max()), int(sel.sum()))
    assert masked_summary(torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0.0, 0.0, 0.0]


def test_tally_reads_every_figure_by_name_and_refuses_mixed_marks():
    t = Tally()
    t.add("a", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    t.add("b", torch.tensor(5, dtype=torch.long))
    assert t.read() == {"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0]}
    assert Tally().read() == {}
    t.mark("x", torch.device("cpu"))
    t.mark("y", torch.device("cpu"))
    assert 0.0 <= t.seconds("x", "y") < 5.0
    with pytest.raises(KeyError):
        t.seconds("x", "nope")


def test_to_device_keeps_host_tensors_on_the_host():
    x = torch.arange(4)
    assert to_device(x, "cpu") is x or torch.equal(to_device(x, "cpu"), x)


@pytest.mark.gpu
def test_to_device_copies_to_the_gpu_without_waiting_and_the_values_arrive():
    torch.cuda.set_sync_debug_mode("error")  # a blocking copy would raise here
    try:
        x = to_device(torch.arange(1 << 20, dtype=torch.float32), "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.device.type == "cuda" and float(x[-1]) == float((1 << 20) - 1)
    t = Tally()
    t.mark("a", x.device)
    t.add("sum", x.sum())
    t.mark("b", x.device)
    assert t.read()["sum"] == [float(sum(range(1 << 20)))]
    assert 0.0 <= t.seconds("a", "b") < 5.0
