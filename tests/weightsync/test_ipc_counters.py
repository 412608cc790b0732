"""torch's CUDA IPC reference counters as rollq counts them (rollq.weightsync.ipc_counters):
the trainer gives back the count ``_share_cuda_`` took, each worker takes one before it maps a
storage; each counter file is mapped once per call.

On CPU the counter file is a torch shared-memory file made the way torch makes the CUDA
counters' (``at::RefcountedMapAllocator``: a 64-byte header, then int64 counters); on a GPU
the counters are the ones ``_share_cuda_`` names, torch's own call is the control, and a second
process maps the trainer's storages through the worker's own code.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rollq.weightsync import ipc_counters
from rollq.weightsync.ipc_counters import COUNTER_HEADER, give_back, take
from rollq.weightsync.ipc_wire import IpcStorage, IpcUnavailable, StorageKind
from tests.helpers.ipc import cuda_message as _cuda


@pytest.fixture
def counters(counter_file):
    """A counter file (tests/weightsync/conftest.py), every counter 1: its name and the tensor over it."""
    return counter_file(1)


def _odd_file() -> bytes:
    odd = b"/torch_0_0_%d" % os.getpid()
    with open(f"/dev/shm{odd.decode()}", "wb") as f:
        f.write(b"\0" * (COUNTER_HEADER + 12))  # not a whole number of counters
    return odd


def test_counters_are_given_back_and_taken_in_place_each_file_mapped_once(counters, monkeypatch):
    name, t = counters
    header = open(f"/dev/shm{name.decode()}", "rb").read(COUNTER_HEADER)
    opened = []
    real = os.open
    monkeypatch.setattr(ipc_counters.os, "open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    cpu = IpcStorage(kind=StorageKind.CPU, nbytes=8, fd=3, inode=7)  # no counter: left alone
    assert give_back([_cuda(name, 0), cpu, _cuda(name, 5), _cuda(name, 9999), _cuda(name, 5)]) == 4
    assert t[0] == 0 and t[5] == -1 and t[9999] == 0 and t[1] == 1 and int(t.sum()) == 10000 - 4
    assert opened == [f"/dev/shm{name.decode()}"]  # the file mapped once for all its counters
    assert take([_cuda(name, 0), cpu, _cuda(name, 5), _cuda(name, 5)]) == 3
    assert t[0] == 1 and t[5] == 1 and int(t.sum()) == 10000 - 1 and len(opened) == 2
    assert open(f"/dev/shm{name.decode()}", "rb").read(COUNTER_HEADER) == header  # torch's header untouched
    assert give_back([]) == 0 and take([]) == 0


def test_a_counter_file_its_trainer_unlinked_has_nothing_to_give_back_and_cannot_be_taken():
    assert give_back([_cuda(b"/torch_1_2_3", 0)]) == 1  # no such file: nothing counts it any more
    with pytest.raises(IpcUnavailable, match="is gone: the trainer exited"):
        take([_cuda(b"/torch_1_2_3", 0)])


@pytest.mark.parametrize("name", [b"/../../etc/passwd", b"torch_1_2_3", b"/torch_1_2_3/x", b"/other"])
def test_a_name_torch_would_not_give_a_counter_file_is_left_to_torchs_own_call_or_refused(name, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda n, off: calls.append((n, off)))
    assert give_back([_cuda(name, 3)]) == 1 and calls == [(name, 3)]
    with pytest.raises(IpcUnavailable, match="not a torch reference-counter file"):
        take([_cuda(name, 3)])


def test_a_counter_past_the_file_or_a_file_laid_out_otherwise_is_left_to_torch_or_refused_taking_none(counters, monkeypatch):
    name, t = counters
    calls = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda n, off: calls.append((n, off)))
    assert give_back([_cuda(name, 2), _cuda(name, 10000)]) == 2
    assert calls == [(name, 2), (name, 10000)] and int(t.sum()) == 10000  # none decremented here
    odd = _odd_file()
    try:
        calls.clear()
        assert give_back([_cuda(odd, 0)]) == 1 and calls == [(odd, 0)]
        with pytest.raises(IpcUnavailable):  # the good file's counter is taken first, then given back
            take([_cuda(name, 7), _cuda(odd, 0)])
        assert int(t.sum()) == 10000 and t[7] == 1
    finally:
        os.unlink(f"/dev/shm{odd.decode()}")


def test_torchs_own_call_failing_is_not_counted(monkeypatch):
    def fail(n, off):
        raise RuntimeError("cannot map")

    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", fail)
    assert give_back([_cuda(b"/other", 0)]) == 0


def _read(name: bytes, off: int) -> int:
    return int(torch.from_file(f"/dev/shm{name.decode()}", shared=False, size=COUNTER_HEADER // 8 + 10000,
                               dtype=torch.int64)[COUNTER_HEADER // 8 + off])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_counters_of_share_cuda_are_given_back_as_torchs_own_call_gives_them_back():
    x = torch.ones(1 << 20, device="cuda")
    s = x.untyped_storage()
    msgs = [s._share_cuda_() for _ in range(3)]
    name = bytes(msgs[0][4])
    assert all(bytes(m[4]) == name for m in msgs)  # one counter file for the process's messages
    offs = [int(m[5]) for m in msgs]
    assert [_read(name, o) for o in offs] == [1, 1, 1]
    torch.UntypedStorage._release_ipc_counter_cuda(name, offs[0])  # the control
    assert give_back([_cuda(name, offs[1]), _cuda(name, offs[2])]) == 2
    assert [_read(name, o) for o in offs] == [0, 0, 0]
    assert take([_cuda(name, offs[1])]) == 1 and _read(name, offs[1]) == 1


_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    from rollq.weightsync.ipc_wire import decode_handles
    from rollq.weightsync.worker._ipc import _open_cuda
    from rollq.weightsync.worker._ipc_maps import MappedStorages
    maps = MappedStorages(watch_interval=60)
    dev = torch.device("cuda", 0)
    for line in sys.stdin:
        cmd, raw = line.split()
        if cmd == "clear":
            maps.clear()
            torch.cuda.synchronize()
        else:
            h = decode_handles(bytes.fromhex(raw))
            got = maps.open(h, lambda i, s: _open_cuda(s, dev))
            first = torch.empty(0, dtype=torch.bfloat16, device=dev).set_(got[0], 0, (4,))
            print(json.dumps({"opened": maps.opened, "reused": maps.reused, "first": first.float().tolist()}), flush=True)
            del got, first  # the mappings are the maps' alone
            continue
        print(json.dumps({}), flush=True)
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_a_storage_exposed_again_is_shared_once_and_counts_the_worker_that_maps_it(tmp_path):
    """A trainer exposing the same CUDA tensors version after version shares each storage
    once: later versions carry the same messages (no new counter files in /dev/shm), the
    counter reads 0 while no worker maps the storage and 1 while a worker process keeps it
    mapped across versions, and 0 again once that worker unmaps it; the worker reads each
    version's bytes."""
    from rollq.weightsync.ipc_wire import encode_handles
    from rollq.weightsync.trainer.ipc_export import Exposure

    ws = [torch.full((64,), float(i), dtype=torch.bfloat16, device="cuda") for i in range(4)]
    items = [(f"w{i}", w) for i, w in enumerate(ws)]
    files = lambda: set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdin is not None and proc.stdout is not None

    def ask(cmd: str, raw: bytes = b"") -> dict:
        proc.stdin.write(f"{cmd} {raw.hex() or '-'}\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    try:
        x = Exposure(1, items, lease=True)
        first = x.handles.storages
        counters = [(s.ref_counter_handle, s.ref_counter_offset) for s in first]
        assert x.shares_reused == 0 and [_read(n, o) for n, o in counters] == [0] * 4
        got = ask("open", encode_handles(x.handles))
        assert got["opened"] == 4 and got["first"] == [0.0] * 4
        assert [_read(n, o) for n, o in counters] == [1] * 4
        x.release()
        before = files()
        shares = x.shares
        for v in range(2, 6):
            with torch.no_grad():
                ws[0].fill_(float(v))  # the optimizer's step: in place
            x = Exposure(v, items, lease=True, shares=shares)
            assert x.shares_reused == 4 and x.handles.storages == first
            got = ask("open", encode_handles(x.handles))
            assert (got["opened"], got["reused"], got["first"]) == (0, 4, [float(v)] * 4)
            assert [_read(n, o) for n, o in counters] == [1] * 4
            x.release()
            shares = x.shares
        assert files() == before  # nothing new shared: no new counters
        ask("clear")
        assert [_read(n, o) for n, o in counters] == [0] * 4
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
