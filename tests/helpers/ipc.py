"""IPC handles' parts for the weight-sync tests."""

from __future__ import annotations

from rollq.weightsync.ipc_wire import IpcStorage, StorageKind


def cuda_message(name: bytes, offset: int, handle: bytes = b"h") -> IpcStorage:
    """A CUDA storage's message whose reference counter is counter ``offset`` of file ``name``
    (``handle`` tells storages apart; nothing here opens it)."""
    return IpcStorage(kind=StorageKind.CUDA, nbytes=8, device_uuid="GPU-0", handle=handle, ref_counter_handle=name,
                      ref_counter_offset=offset)
