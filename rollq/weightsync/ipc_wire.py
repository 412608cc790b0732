"""What the IPC transport hands from the trainer process to a replica's workers on the same host:
the handles of one version's tensors (:class:`IpcHandles`, Redis ``QueueKeys.weights_ipc``).

Every field is a plain value (ints, strings, bytes) that rollq writes itself; nothing is
pickled. A CPU storage is a shared-memory file the trainer process holds open: its pid, the
descriptor's number there and the file's inode (a replica opens ``/proc/<pid>/fd/<fd>`` and
checks the inode, so a descriptor number the trainer reused for another file is refused). A
CUDA storage is the fields of ``torch.UntypedStorage._share_cuda_()`` with the device's UUID;
its reference counter counts the workers that map it, each of which takes its reference itself
(:mod:`rollq.weightsync.ipc_counters`), so one message serves every version and every worker.
The ``token`` is a small CPU storage the trainer keeps exactly as long as it exposes the
version: a worker that cannot open it (before or after its copy) knows the trainer exited or
released the version. Tensors the trainer may change in place carry their ``checksum``, which
the worker verifies after its copy; a publisher-owned snapshot (``owned``) needs none.

Decoding validates everything a worker relies on before it opens anything:

>>> h = IpcHandles(version=3, host="h", pid=42, checksum="c",
...                token=IpcStorage(kind=StorageKind.CPU, nbytes=8, fd=5, inode=77),
...                storages=[IpcStorage(kind=StorageKind.CPU, nbytes=16, fd=6, inode=78)],
...                tensors=[IpcTensor("w", "float32", [2, 2], 0, 0)])
>>> decode_handles(encode_handles(h)).tensors[0].nbytes
16
>>> bad = msgspec.to_builtins(h)
>>> bad["tensors"][0][2] = [4, 2]  # a shape larger than its storage
>>> decode_handles(msgspec.msgpack.encode(bad))
Traceback (most recent call last):
rollq.weightsync.ipc_wire.MalformedIpcHandles: malformed IPC handles: tensor 'w' (32 bytes at offset 0) runs past the end of storage 0 (16 bytes)

This module imports no torch.
"""

from __future__ import annotations

import enum
import os

import msgspec

from ..errors import WeightSyncError
from .versions import _ITEMSIZE, tensor_nbytes

#: Schema of :class:`IpcHandles`; a worker refuses handles of another. 2: a CUDA storage's
#: reference counter is left at zero by the trainer and counted by each worker that maps it.
IPC_SCHEMA = 2


class MalformedIpcHandles(WeightSyncError, ValueError):
    """Bytes in ``weights_ipc`` that are not valid IPC handles of this schema."""


class IpcUnavailable(WeightSyncError):
    """The handles of a version cannot be used here: the trainer exited or released the
    version (before or during the copy), or the replica is on another host or GPU. The
    version is not applied; a memmap copy of it is loaded instead where the record has one."""


class TornDirectSwap(IpcUnavailable):
    """A direct swap (``WeightSyncSettings.ipc_direct``) copied tensors its trainer stopped
    guaranteeing meanwhile: the trainer process exited while its CUDA tensors were copied, or
    released the version (the replica's claim was lost): the live weights may hold part of the
    version."""


class StorageKind(str, enum.Enum):
    CPU = "cpu"  # a shared-memory file, opened through /proc/<pid>/fd/<fd>
    CUDA = "cuda"  # a CUDA IPC memory handle


class IpcStorage(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One storage the trainer exposes (``nbytes``: its size in bytes)."""

    kind: StorageKind
    nbytes: int
    # CPU: the descriptor of the shared-memory file in the trainer process, and its inode.
    fd: int = -1
    inode: int = 0
    # CUDA: ``_share_cuda_()``'s fields (``offset``: of the storage in the IPC allocation).
    device_uuid: str = ""
    handle: bytes = b""
    offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"storage size {self.nbytes} is negative")
        if self.kind is StorageKind.CPU and (self.fd < 0 or self.inode <= 0):
            raise ValueError(f"a CPU storage needs its descriptor and inode (fd={self.fd}, inode={self.inode})")
        if self.kind is StorageKind.CUDA and (not self.handle or not self.device_uuid or self.offset < 0):
            raise ValueError("a CUDA storage needs its IPC handle, device UUID and a non-negative offset")


class IpcTensor(msgspec.Struct, array_like=True, frozen=True):
    """A contiguous tensor at byte ``offset`` of storage ``storage``, by checkpoint name."""

    name: str
    dtype: str  # torch name without ``torch.``
    shape: list[int]
    storage: int
    offset: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


class IpcHandles(msgspec.Struct, kw_only=True, frozen=True):
    """One exposed version (see the module docstring)."""

    v: int = IPC_SCHEMA
    version: int
    host: str  # socket.gethostname() of the trainer
    pid: int  # the trainer process
    checksum: str  # state_checksum of the tensors, in order ("" for an owned snapshot)
    token: IpcStorage  # held exactly as long as the version is exposed
    storages: list[IpcStorage]
    tensors: list[IpcTensor]
    #: The storages are the publisher's own snapshot of the version: nothing writes them while
    #: the token lives, so a worker whose copy ended with the token alive has the version's
    #: bytes, and no checksum is taken or verified.
    owned: bool = False
    #: The storages are the trainer's own tensors, leased (``WeightPublisher(ipc_lease=True)``,
    #: implies ``owned``): unchanged until the publisher releases the version, which it does
    #: only after every claim of a direct swap (``QueueKeys.weights_ipc_claims``) has ended, so
    #: a replica that claimed the version may copy them straight into its live weights.
    lease: bool = False

    def __post_init__(self) -> None:
        if self.v != IPC_SCHEMA:
            raise ValueError(f"IPC handles schema {self.v} is not supported (this build: {IPC_SCHEMA})")
        if self.version <= 0 or self.pid <= 0:
            raise ValueError(f"version {self.version} and pid {self.pid} must be positive")
        if self.token.kind is not StorageKind.CPU:
            raise ValueError("the liveness token must be a CPU storage")
        if self.lease and not self.owned:
            raise ValueError("leased handles are owned (nothing writes them while the version is exposed)")
        if not self.checksum and not self.owned:
            raise ValueError("handles of tensors the trainer may still change need their checksum")
        for t in self.tensors:
            if t.dtype not in _ITEMSIZE:
                raise ValueError(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
            if any(d < 0 for d in t.shape):
                raise ValueError(f"tensor {t.name!r} has a negative dimension {t.shape}")
            if not 0 <= t.storage < len(self.storages):
                raise ValueError(f"tensor {t.name!r} names storage {t.storage} of {len(self.storages)}")
            size = self.storages[t.storage].nbytes
            if t.offset < 0 or t.offset + t.nbytes > size:
                raise ValueError(f"tensor {t.name!r} ({t.nbytes} bytes at offset {t.offset}) runs past the end of "
                                 f"storage {t.storage} ({size} bytes)")
            if t.offset % _ITEMSIZE[t.dtype]:
                raise ValueError(f"tensor {t.name!r} is at offset {t.offset}, not a multiple of its item size")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def token_alive(h: IpcHandles) -> bool:
    """Whether the trainer process still exposes the version of ``h`` (its token is open
    there; only on the trainer's host)."""
    try:
        return os.stat(f"/proc/{h.pid}/fd/{h.token.fd}").st_ino == h.token.inode
    except OSError:
        return False


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(IpcHandles)


def encode_handles(h: IpcHandles) -> bytes:
    return _enc.encode(h)


def decode_handles(raw: bytes) -> IpcHandles:
    """``raw`` validated into :class:`IpcHandles`, or :class:`MalformedIpcHandles` saying why."""
    try:
        return _dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedIpcHandles(f"malformed IPC handles: {e}") from e
