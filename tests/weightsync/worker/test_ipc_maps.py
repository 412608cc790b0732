"""The references a worker gives back for the trainer's storages it keeps mapped
(rollq.weightsync.worker._ipc_maps.release_messages): torch's CUDA IPC reference counters,
decremented in place in their shared-memory file, each file mapped once.

On CPU the counter file is a torch shared-memory file made the way torch makes the CUDA
counters' (``at::RefcountedMapAllocator``: a 64-byte header, then int64 counters); on a GPU
the counters are the ones ``_share_cuda_`` names, and torch's own call is the control.
"""

from __future__ import annotations

import os

import pytest
import torch

from rollq.weightsync.ipc_wire import IpcHandles, IpcStorage, StorageKind
from rollq.weightsync.worker import _ipc_maps
from rollq.weightsync.worker._ipc_maps import COUNTER_HEADER, MappedStorages, release_messages


@pytest.fixture
def counters():
    """A torch reference-counted shared-memory file of 10,000 int64 counters (as torch's CUDA
    IPC counter files are), all 1: its name and the tensor over it."""
    import torch.multiprocessing as mp

    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        t = torch.ones(10000, dtype=torch.int64).share_memory_()
        _, name, size = t.untyped_storage()._share_filename_cpu_()
    finally:
        mp.set_sharing_strategy(strategy)
    assert os.path.getsize(f"/dev/shm{name.decode()}") == size + COUNTER_HEADER  # torch's layout
    yield name, t
    del t


def _cuda(name: bytes, offset: int, handle: bytes = b"h") -> IpcStorage:
    return IpcStorage(kind=StorageKind.CUDA, nbytes=8, device_uuid="GPU-0", handle=handle, ref_counter_handle=name,
                      ref_counter_offset=offset)


def test_each_message_of_a_version_is_given_back_in_its_counter_file(counters, monkeypatch):
    name, t = counters
    header = open(f"/dev/shm{name.decode()}", "rb").read(COUNTER_HEADER)
    opened = []
    real = os.open
    monkeypatch.setattr(_ipc_maps.os, "open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    cpu = IpcStorage(kind=StorageKind.CPU, nbytes=8, fd=3, inode=7)  # no counter: left alone
    assert release_messages([_cuda(name, 0), cpu, _cuda(name, 5), _cuda(name, 9999), _cuda(name, 5)]) == 4
    assert t[0] == 0 and t[5] == -1 and t[9999] == 0 and t[1] == 1 and int(t.sum()) == 10000 - 4
    assert opened == [f"/dev/shm{name.decode()}"]  # the file mapped once for all its counters
    assert open(f"/dev/shm{name.decode()}", "rb").read(COUNTER_HEADER) == header  # torch's header untouched
    assert release_messages([]) == 0


def test_a_counter_file_its_trainer_unlinked_has_nothing_to_give_back():
    assert release_messages([_cuda(b"/torch_1_2_3", 0)]) == 1  # no such file: nothing counts it any more


@pytest.mark.parametrize("name", [b"/../../etc/passwd", b"torch_1_2_3", b"/torch_1_2_3/x", b"/other"])
def test_a_name_torch_would_not_give_a_counter_file_is_left_to_torchs_own_call(name, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda n, off: calls.append((n, off)))
    assert release_messages([_cuda(name, 3)]) == 1 and calls == [(name, 3)]


def test_a_counter_past_the_file_or_a_file_laid_out_otherwise_is_left_to_torchs_own_call(counters, monkeypatch):
    name, t = counters
    calls = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda n, off: calls.append((n, off)))
    assert release_messages([_cuda(name, 2), _cuda(name, 10000)]) == 2
    assert calls == [(name, 2), (name, 10000)] and int(t.sum()) == 10000  # none decremented here
    odd = b"/torch_0_0_%d" % os.getpid()
    with open(f"/dev/shm{odd.decode()}", "wb") as f:
        f.write(b"\0" * (COUNTER_HEADER + 12))  # not a whole number of counters
    try:
        calls.clear()
        assert release_messages([_cuda(odd, 0)]) == 1 and calls == [(odd, 0)]
    finally:
        os.unlink(f"/dev/shm{odd.decode()}")


def test_torchs_own_call_failing_is_not_counted(monkeypatch):
    def fail(n, off):
        raise RuntimeError("cannot map")

    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", fail)
    assert release_messages([_cuda(b"/other", 0)]) == 0


def _handles(storages: list[IpcStorage]) -> IpcHandles:
    token = IpcStorage(kind=StorageKind.CPU, nbytes=1, fd=3, inode=1)
    return IpcHandles(version=1, host="h", pid=os.getpid(), checksum="c", token=token, storages=storages, tensors=[])


def test_kept_mappings_give_back_the_next_versions_messages_at_once_even_when_an_open_fails(counters, monkeypatch):
    """The first version opens both storages (their messages are the opened storages' to give
    back when they go); the next names the same memory through new messages, given back in
    one call; a third whose new storage cannot be opened still gives back the kept one's."""
    name, t = counters
    batches = []
    real = _ipc_maps.release_messages
    monkeypatch.setattr(_ipc_maps, "release_messages", lambda ss: batches.append(list(ss)) or real(ss))
    maps = MappedStorages(watch_interval=60)
    mem = {b"a": torch.UntypedStorage(8), b"b": torch.UntypedStorage(8)}
    opener = lambda i, s: mem[s.handle]  # noqa: E731
    maps.open(_handles([_cuda(name, 0, b"a"), _cuda(name, 1, b"b")]), opener)
    assert (maps.opened, maps.reused) == (2, 0) and batches == [[]] and int(t.sum()) == 10000
    second = [_cuda(name, 2, b"a"), _cuda(name, 3, b"b")]
    maps.open(_handles(second), opener)
    assert (maps.opened, maps.reused) == (0, 2) and batches[-1] == second and t[2] == 0 and t[3] == 0

    def broken(i, s):
        raise OSError("gone")

    with pytest.raises(OSError):
        maps.open(_handles([_cuda(name, 4, b"a"), _cuda(name, 5, b"c")]), broken)
    assert t[4] == 0 and t[5] == 1 and len(maps) == 0  # the kept one given back, then all unmapped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_counters_of_share_cuda_are_given_back_as_torchs_own_call_gives_them_back():
    x = torch.ones(1 << 20, device="cuda")
    s = x.untyped_storage()
    msgs = [s._share_cuda_() for _ in range(3)]
    name = bytes(msgs[0][4])
    assert all(bytes(m[4]) == name for m in msgs)  # one counter file for the process's messages
    counters = torch.from_file(f"/dev/shm{name.decode()}", shared=False, size=COUNTER_HEADER // 8 + 10000,
                               dtype=torch.int64)[COUNTER_HEADER // 8:]
    offs = [int(m[5]) for m in msgs]
    assert [int(counters[o]) for o in offs] == [1, 1, 1]

    def read(o):
        return int(torch.from_file(f"/dev/shm{name.decode()}", shared=False, size=COUNTER_HEADER // 8 + 10000,
                                   dtype=torch.int64)[COUNTER_HEADER // 8 + o])

    torch.UntypedStorage._release_ipc_counter_cuda(name, offs[0])  # the control
    assert release_messages([_cuda(name, offs[1]), _cuda(name, offs[2])]) == 2
    assert [read(o) for o in offs] == [0, 0, 0]
