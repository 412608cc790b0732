"""The content checksum weight sync verifies every version with: one value on CPU and GPU, for
any size and alignment, linear over byte ranges cut at LANE_BYTES, and sensitive to the
accidents it is for (a changed byte, a cut tensor, swapped names)."""

from __future__ import annotations

import pytest
import torch

from rollq.weightsync import checksum as ck

SIZES = [0, 1, 7, 8, 9, ck.LANE_BYTES - 1, ck.LANE_BYTES, ck.LANE_BYTES + 3, 3 * ck.LANE_BYTES + 5]


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", SIZES)
def test_the_device_arithmetic_equals_the_host_arithmetic(n):
    """The device path (run here on CPU tensors: the same torch ops) and numpy's agree."""
    t = _bytes(n)
    host = ck.state_checksum([("w", t)])
    assert f"{ck._state_checksum_device([('w', t)]):016x}" == host


@pytest.mark.parametrize("cut", [ck.LANE_BYTES, 2 * ck.LANE_BYTES])
def test_lanes_of_ranges_cut_at_lane_bytes_add_up_to_the_whole(cut):
    a = _bytes(3 * ck.LANE_BYTES + 11).numpy()
    whole = ck._cpu_sum(a, (-a.size) % ck.LANE_BYTES)
    head = ck._cpu_sum(a[:cut], 0)
    tail = ck._cpu_sum(a[cut:], (-(a.size - cut)) % ck.LANE_BYTES)
    assert (head + tail) & ck._MASK == whole


def test_a_view_at_an_odd_address_checksums_like_its_copy():
    buf = torch.randn(1001, dtype=torch.bfloat16)
    view = buf[1:]  # 2 bytes past an 8-byte boundary
    assert ck.tensor_checksum(view) == ck.tensor_checksum(view.clone())


def test_a_changed_byte_a_cut_tensor_and_swapped_names_change_it():
    a, b = torch.randn(3000), torch.randn(3000)
    base = ck.state_checksum([("a", a), ("b", b)])
    flipped = a.clone()
    flipped.view(torch.uint8)[5000] ^= 1
    assert ck.state_checksum([("a", flipped), ("b", b)]) != base
    assert ck.state_checksum([("a", a[:-1]), ("b", b)]) != base
    assert ck.state_checksum([("a", b), ("b", a)]) != base
    assert ck.state_checksum([("b", b), ("a", a)]) == base  # the order of the items does not matter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_it_equals_the_host_value_with_and_without_waits_and_at_odd_addresses():
    items = [(f"t{i}", torch.randn(n, dtype=torch.bfloat16)) for i, n in enumerate([1, 4097, 3 * 8192 + 3, 100_000])]
    host = ck.state_checksum(items)
    dev = [(n, t.cuda()) for n, t in items]
    assert ck.state_checksum(dev) == host
    assert ck.state_checksum(dev, sync_bytes=4096) == host
    odd = torch.randn(100_001, dtype=torch.bfloat16)
    assert ck.state_checksum([("o", odd.cuda()[1:])]) == ck.state_checksum([("o", odd[1:])])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_captured_checksum_is_replayed_and_reads_the_current_bytes():
    """The second checksum of the same tensors replays the first one's CUDA graph; it gives
    the host value, follows an in-place change of the bytes, and a thread serving other CUDA
    work meanwhile (an engine) is not disturbed by the capture."""
    import threading

    ck._graphs.clear()
    items = [(f"t{i}", torch.randn(n, dtype=torch.bfloat16)) for i, n in enumerate([4096, 3 * 8192 + 4, 100_000])]
    dev = [(n, t.cuda()) for n, t in items]
    stop = threading.Event()

    def busy() -> None:  # other CUDA work in another thread, on its own stream
        x = torch.randn(512, 512, device="cuda")
        with torch.cuda.stream(torch.cuda.Stream()):
            while not stop.is_set():
                x = (x @ x).tanh()
                torch.cuda.synchronize()

    th = threading.Thread(target=busy)
    th.start()
    try:
        first = ck.state_checksum(dev, graph=True)  # captured here
        graphed = ck._graphs[ck._graph_key(dev)]
        assert graphed is not None and graphed.runs == 1
        assert first == ck.state_checksum(items)
        assert ck.state_checksum(dev, graph=True) == first and graphed.runs == 2
        dev[1][1][7] += 1  # in place: same address, new bytes
        items[1][1][7] += 1
        assert ck.state_checksum(dev, graph=True) == ck.state_checksum(items) != first and graphed.runs == 3
    finally:
        stop.set()
        th.join()
    other = [(n, t.clone()) for n, t in dev]  # other addresses: another graph
    assert ck.state_checksum(other, graph=True) == ck.state_checksum(items)
    assert ck._graphs[ck._graph_key(other)] is not graphed
    ck.state_checksum(other + [("z", torch.zeros(8, device="cuda"))])  # without graph=True: none captured
    assert len(ck._graphs) == 2
