"""Trainer side of the IPC transport: exposing one version's tensors to other processes of the
same host (:class:`Exposure`), described by :class:`~rollq.weightsync.ipc_wire.IpcHandles`.

Runs in the trainer process. A CPU tensor already in shared memory (``share_memory_()``) is
exposed as it is, zero-copy; any other CPU tensor is copied once into a new shared-memory
storage. A CUDA tensor is exposed through its storage's CUDA IPC handle, zero-copy. The
extra memory is :attr:`Exposure.copied_bytes` (0 when every tensor was shareable).

An exposed tensor must not change until the replicas have copied it: a replica verifies the
checksum taken here and refuses a version whose bytes changed meanwhile
(:class:`~rollq.errors.CorruptWeights`). A trainer that updates its weights in place right
after publishing exposes a snapshot (``snapshot=True``: every tensor copied here, a CUDA
tensor on its own GPU) or waits for the replicas' copies first (``WeightPublisher.release_weights``).

A snapshot is the publisher's own (``IpcHandles.owned``): nothing writes it while the version
is exposed, so no checksum is taken here or verified by the replicas, whose copy is good when
the version was still exposed at its end. A lease (``lease=True``) is the same promise made by
the trainer for its own tensors, zero-copy: it changes none of them until it has released the
version (``WeightPublisher.release_weights``, which first waits for the replicas' copies).
The next version of the same layout is copied into the same snapshot (``into``) once this one
is released, so the extra memory stays one copy of the weights and the replicas' kept mappings
of its storages stay valid.

A storage is shared once (:class:`ShareTable`): an exposure given the last one's table
(``shares``) reuses the message of every storage of the caller's that it exposes again, so a
trainer that steps its optimizer in place pays torch's ``_share_cuda_`` (a CUDA IPC memory
handle, an IPC event and a reference counter per storage: 7.5-9.5 ms for the 339 tensors of a
7B model beside a busy engine) for its first version only, and its storages do not gather a
new event and counter every version. The count ``_share_cuda_`` takes is given back at once
(:func:`~rollq.weightsync.ipc_counters.give_back`): the table holds the storage while it may be
exposed, and each worker counts its own reference when it maps it. The table holds the
caller's storages, never the copies an exposure makes, until the next exposure's table
replaces it (``WeightPublisher.close`` drops it).

>>> import torch
>>> x = Exposure(1, [("w", torch.ones(2, 2))])
>>> (x.handles.tensors[0].name, x.copied_bytes, x.handles.owned)
('w', 16, False)
>>> x.release()
>>> s1 = Exposure(2, [("w", torch.ones(2, 2))], snapshot=True)
>>> s1.release()
>>> s2 = Exposure(3, [("w", torch.zeros(2, 2))], snapshot=True, into=s1.snapshot)
>>> (s2.handles.owned, s2.handles.checksum, s2.reused, s2.snapshot[0][1].data_ptr() == s1.snapshot[0][1].data_ptr())
(True, '', True, True)
>>> s2.release()
>>> w = torch.ones(2, 2).share_memory_()
>>> x = Exposure(4, [("w", w)], lease=True)
>>> (x.handles.owned, x.handles.lease, x.handles.checksum, x.copied_bytes)
(True, True, '', 0)
>>> x.release()
>>> y = Exposure(5, [("w", w)], lease=True, shares=x.shares)  # the same storage: shared once
>>> (y.shares_reused, y.handles.storages == x.handles.storages)
(1, True)
>>> y.release()
"""

from __future__ import annotations

import os
import socket
import time

import torch

from ..checksum import state_checksum
from ..ipc_counters import give_back
from ..ipc_wire import IpcHandles, IpcStorage, IpcTensor, StorageKind

Items = list[tuple[str, torch.Tensor]]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _cpu_storage(s: torch.UntypedStorage) -> IpcStorage:
    fd, size = s._share_fd_cpu_()
    return IpcStorage(kind=StorageKind.CPU, nbytes=int(size), fd=int(fd), inode=os.fstat(fd).st_ino)


def _cuda_storage(s: torch.UntypedStorage) -> IpcStorage:
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = s._share_cuda_()
    return IpcStorage(
        kind=StorageKind.CUDA, nbytes=int(size), device_uuid=str(torch.cuda.get_device_properties(device).uuid),
        handle=bytes(handle), offset=int(offset), ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync),
    )


def _shared_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a new shared-memory storage (opened by descriptor)."""
    s = torch.UntypedStorage._new_using_fd_cpu(max(1, t.numel() * t.element_size()))
    out = torch.empty(0, dtype=t.dtype).set_(s, 0, tuple(t.shape))
    out.copy_(t)
    return out


StorageKey = tuple[str, int, int, int]


def _key(t: torch.Tensor, s: torch.UntypedStorage) -> StorageKey:
    """What identifies storage ``s`` of ``t`` in this process while something holds it: its
    device, its ``StorageImpl``, its bytes' address and size."""
    return (str(t.device), int(s._cdata), s.data_ptr(), s.nbytes())


class ShareTable:
    """The messages of the storages one exposure shared, each with the storage it names (held:
    while the table lives, no other storage can take its address, so an equal key is the same
    memory). See the module docstring.

    >>> ShareTable().get(("cpu", 1, 2, 3)) is None
    True
    """

    def __init__(self) -> None:
        self._by_key: dict[StorageKey, tuple[torch.UntypedStorage, IpcStorage]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: StorageKey) -> IpcStorage | None:
        got = self._by_key.get(key)
        return None if got is None else got[1]

    def put(self, key: StorageKey, storage: torch.UntypedStorage, message: IpcStorage) -> None:
        self._by_key[key] = (storage, message)


class Exposure:
    """Version ``version`` of ``items`` exposed to the processes of this host until
    :meth:`release` (or until this process exits): :attr:`handles` say where each tensor is.
    ``shares``: the last exposure's :attr:`shares`, whose messages are reused for the storages
    exposed again."""

    def __init__(self, version: int, items: Items, snapshot: bool = False, into: Items | None = None, lease: bool = False,
                 shares: ShareTable | None = None):
        if snapshot and lease:
            raise ValueError("a version is exposed as a snapshot or leased, not both")
        t0 = time.perf_counter()
        #: The messages of the caller's storages exposed here (``shares`` of the next exposure).
        self.shares = ShareTable()
        #: Storages whose message came from ``shares`` (not shared again).
        self.shares_reused = 0
        fresh: list[IpcStorage] = []  # CUDA messages shared here: their counts are given back
        #: Bytes copied for the exposure (into shared memory, or on the GPU for a CUDA snapshot; 0: zero-copy).
        self.copied_bytes = 0
        self._held: list[torch.Tensor] = []  # what keeps the exposed storages alive
        self._token = torch.UntypedStorage._new_using_fd_cpu(8)
        #: Whether the snapshot was copied into ``into`` (an earlier, released version's).
        self.reused = False
        if snapshot:
            items = self._snapshot(items, into)
        storages: list[IpcStorage] = []
        index: dict[StorageKey, int] = {}  # a storage -> its index in ``storages``
        tensors: list[IpcTensor] = []
        exposed: Items = []
        try:
            for name, t in items:
                t = t.detach()
                mine = snapshot  # the storage is one this exposure made (not the caller's)
                if snapshot:  # copied above: its storages are exposed as they are
                    pass
                elif t.device.type == "cuda":
                    c = t.contiguous()  # ``t`` itself when it is contiguous
                    mine, t = c is not t, c
                elif t.device.type != "cpu" or not t.is_contiguous() or not t.is_shared():
                    t, mine = self._copied(t), True
                s = t.untyped_storage()
                key = _key(t, s)
                if key not in index:
                    got = None if mine or shares is None else shares.get(key)
                    if got is not None:
                        self.shares_reused += 1
                    else:
                        try:
                            got = _cuda_storage(s) if t.device.type == "cuda" else _cpu_storage(s)
                        except RuntimeError:  # shared by file name (torch's file_system strategy): copy it
                            t, mine = self._copied(t), True
                            s = t.untyped_storage()
                            key = _key(t, s)
                            got = _cpu_storage(s)
                        if got.kind is StorageKind.CUDA:
                            fresh.append(got)
                    if not mine:
                        self.shares.put(key, s, got)
                    index[key] = len(storages)
                    storages.append(got)
                self._held.append(t)
                exposed.append((name, t))
                tensors.append(IpcTensor(name, _dtype_name(t), list(t.shape), index[key],
                                         t.storage_offset() * t.element_size()))
        finally:  # held here (and by the table) while exposed; each worker counts its own reference
            give_back(fresh)
        for dev in {t.device for t in self._held if t.device.type == "cuda"}:
            torch.cuda.synchronize(dev)  # the bytes a replica reads are written
        self.expose_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        owned = snapshot or lease  # nothing writes the bytes while the version is exposed: no checksum
        checksum = "" if owned else state_checksum(exposed, graph=True)
        self.checksum_s = 0.0 if owned else time.perf_counter() - t1
        #: The snapshot's tensors (empty without ``snapshot``): ``into`` of the next version.
        self.snapshot: Items = exposed if snapshot else []
        self.handles = IpcHandles(
            version=version, host=socket.gethostname(), pid=os.getpid(), checksum=checksum,
            token=_cpu_storage(self._token), storages=storages, tensors=tensors, owned=owned, lease=lease,
        )

    def _snapshot(self, items: Items, into: Items | None) -> Items:
        """``items`` copied into ``into`` when it has their names, shapes, dtypes and devices
        (and its version is released), else into new storages (shared memory, or on the
        tensor's GPU)."""
        if into is not None and [(n, t.shape, t.dtype, t.device) for n, t in items] == [
                (n, t.shape, t.dtype, t.device) for n, t in into]:
            with torch.no_grad():
                cuda = [(d, s.detach()) for (_, d), (_, s) in zip(into, items) if d.device.type == "cuda"]
                if cuda:  # one call for every tensor on the GPU
                    torch._foreach_copy_([d for d, _ in cuda], [s for _, s in cuda], non_blocking=True)
                for (_, d), (_, s) in zip(into, items):
                    if d.device.type != "cuda":
                        d.copy_(s.detach())
            self.copied_bytes += sum(t.numel() * t.element_size() for _, t in into)
            self.reused = True
            return [(n, d) for (n, _), (_, d) in zip(items, into)]
        return [(n, self._copied(t.detach())) for n, t in items]

    def _copied(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":
            out = t.clone(memory_format=torch.contiguous_format)
            self.copied_bytes += out.numel() * out.element_size()
            return out
        out = _shared_copy(t.cpu())
        self.copied_bytes += out.numel() * out.element_size()
        return out

    @property
    def nbytes(self) -> int:
        return self.handles.nbytes

    def release(self) -> None:
        """Stop exposing the version: the token and the storages this exposure held go
        (a replica copying now refuses the version)."""
        self._held.clear()
        self._token = torch.UntypedStorage(0)
