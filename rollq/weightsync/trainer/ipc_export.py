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
>>> x = Exposure(4, [("w", torch.ones(2, 2).share_memory_())], lease=True)
>>> (x.handles.owned, x.handles.lease, x.handles.checksum, x.copied_bytes)
(True, True, '', 0)
>>> x.release()
"""

from __future__ import annotations

import os
import socket
import time

import torch

from ..checksum import state_checksum
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


class Exposure:
    """Version ``version`` of ``items`` exposed to the processes of this host until
    :meth:`release` (or until this process exits): :attr:`handles` say where each tensor is."""

    def __init__(self, version: int, items: Items, snapshot: bool = False, into: Items | None = None, lease: bool = False):
        if snapshot and lease:
            raise ValueError("a version is exposed as a snapshot or leased, not both")
        t0 = time.perf_counter()
        #: Bytes copied for the exposure (into shared memory, or on the GPU for a CUDA snapshot; 0: zero-copy).
        self.copied_bytes = 0
        self._held: list[torch.Tensor] = []  # what keeps the exposed storages alive
        self._token = torch.UntypedStorage._new_using_fd_cpu(8)
        #: Whether the snapshot was copied into ``into`` (an earlier, released version's).
        self.reused = False
        if snapshot:
            items = self._snapshot(items, into)
        storages: list[IpcStorage] = []
        index: dict[tuple[str, int], int] = {}  # (device, data_ptr) of a storage -> its index
        tensors: list[IpcTensor] = []
        exposed: Items = []
        for name, t in items:
            t = t.detach()
            if snapshot:  # copied above: its storages are exposed as they are
                pass
            elif t.device.type == "cuda":
                t = t.contiguous()
            elif t.device.type != "cpu" or not t.is_contiguous() or not t.is_shared():
                t = self._copied(t)
            s = t.untyped_storage()
            key = (str(t.device), s.data_ptr())
            if key not in index:
                try:
                    got = _cuda_storage(s) if t.device.type == "cuda" else _cpu_storage(s)
                except RuntimeError:  # shared by file name (torch's file_system strategy): copy it
                    t = self._copied(t)
                    s = t.untyped_storage()
                    key = (str(t.device), s.data_ptr())
                    got = _cpu_storage(s)
                index[key] = len(storages)
                storages.append(got)
            self._held.append(t)
            exposed.append((name, t))
            tensors.append(IpcTensor(name, _dtype_name(t), list(t.shape), index[key], t.storage_offset() * t.element_size()))
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
