"""The trainer's storages a worker keeps mapped from one IPC version to the next
(rollq.weightsync.worker._ipc_maps.MappedStorages), and the CUDA IPC references it counts:
one taken before each storage it maps, none for a storage it keeps mapped.

On CPU the counter file is a torch shared-memory file made the way torch makes the CUDA
counters' (``at::RefcountedMapAllocator``: a 64-byte header, then int64 counters), starting
at zero as the trainer leaves them.
"""

from __future__ import annotations

import os

import pytest
import torch

from rollq.weightsync.ipc_wire import IpcHandles, IpcStorage, IpcUnavailable, StorageKind
from rollq.weightsync.worker._ipc_maps import MappedStorages
from tests.helpers.ipc import cuda_message as _cuda


@pytest.fixture
def counters(counter_file):
    """A counter file (tests/weightsync/conftest.py), every counter 0: its name and the tensor over it."""
    return counter_file(0)


def _handles(storages: list[IpcStorage]) -> IpcHandles:
    token = IpcStorage(kind=StorageKind.CPU, nbytes=1, fd=3, inode=1)
    return IpcHandles(version=1, host="h", pid=os.getpid(), checksum="c", token=token, storages=storages, tensors=[])


def test_a_worker_takes_one_reference_per_storage_it_maps_and_none_for_those_it_keeps(counters):
    """The first version maps both storages, a reference taken for each before it is mapped;
    the next names the same memory (the same messages: the trainer shares a storage once) and
    takes nothing; a third whose new storage cannot be mapped gives back the reference it took
    for it and unmaps everything (the mappings, here plain storages, give theirs back when
    they go, which a real CUDA mapping does in torch's deleter)."""
    name, t = counters
    maps = MappedStorages(watch_interval=60)
    mem = {b"a": torch.UntypedStorage(8), b"b": torch.UntypedStorage(8)}
    seen = []

    def opener(i, s):
        seen.append((s.handle, int(t[s.ref_counter_offset])))  # the reference is taken before the mapping
        return mem[s.handle]

    first = [_cuda(name, 0, b"a"), _cuda(name, 1, b"b"), _cuda(name, 0, b"a")]  # a storage named twice
    got = maps.open(_handles(first), opener)
    assert (maps.opened, maps.reused) == (2, 0) and seen == [(b"a", 1), (b"b", 1)] and got[0] is got[2]
    assert t[0] == 1 and t[1] == 1 and int(t.sum()) == 2
    maps.open(_handles(first[:2]), opener)
    assert (maps.opened, maps.reused) == (0, 2) and len(seen) == 2 and int(t.sum()) == 2

    def broken(i, s):
        raise OSError("gone")

    with pytest.raises(OSError):
        maps.open(_handles([_cuda(name, 0, b"a"), _cuda(name, 5, b"c"), _cuda(name, 6, b"d")]), broken)
    assert t[5] == 0 and t[6] == 0 and len(maps) == 0  # the two taken for c and d given back, all unmapped


def test_a_storage_whose_counter_file_is_gone_is_not_mapped(counters):
    maps = MappedStorages(watch_interval=60)
    opened = []
    with pytest.raises(IpcUnavailable, match="is gone: the trainer exited"):
        maps.open(_handles([_cuda(b"/torch_1_2_3", 0)]), lambda i, s: opened.append(i))
    assert opened == [] and len(maps) == 0
