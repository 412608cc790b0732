"""The IPC transport's wire struct, the trainer's exposure and its registration (no engine)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from rollq.weightsync.ipc_export import Exposure
from rollq.weightsync.ipc_wire import (
    IPC_SCHEMA, IpcHandles, IpcStorage, IpcTensor, MalformedIpcHandles, StorageKind, decode_handles, encode_handles,
)
from rollq.weightsync.transports import replica_transport, trainer_transport
from rollq.weightsync.transports.ipc import IpcReceive, IpcSend
from rollq.weightsync.worker_ipc import _open_cpu, _token_alive


def good() -> dict[str, Any]:
    h = IpcHandles(
        version=3, host="h", pid=42, checksum="c",
        token=IpcStorage(kind=StorageKind.CPU, nbytes=8, fd=5, inode=77),
        storages=[IpcStorage(kind=StorageKind.CPU, nbytes=64, fd=6, inode=78)],
        tensors=[IpcTensor("a", "float32", [2, 2], 0, 0), IpcTensor("b", "bfloat16", [3], 0, 16)],
    )
    out: dict[str, Any] = msgspec.to_builtins(h)
    return out


def test_valid_handles_round_trip():
    h = decode_handles(msgspec.msgpack.encode(good()))
    assert [t.nbytes for t in h.tensors] == [16, 6] and h.nbytes == 22
    assert decode_handles(encode_handles(h)) == h


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(v=IPC_SCHEMA + 1), "schema 2 is not supported"),
    (lambda d: d.update(pid=0), "pid 0 must be positive"),
    (lambda d: d["tensors"][0].__setitem__(1, "float128"), "unknown dtype 'float128'"),
    (lambda d: d["tensors"][0].__setitem__(2, [2, -2]), "negative dimension"),
    (lambda d: d["tensors"][1].__setitem__(3, 1), "names storage 1 of 1"),
    (lambda d: d["tensors"][1].__setitem__(4, 60), r"runs past the end of storage 0 \(64 bytes\)"),
    (lambda d: d["tensors"][0].__setitem__(4, 2), "not a multiple of its item size"),
    (lambda d: d["storages"][0].pop("fd"), "a CPU storage needs its descriptor and inode"),
    (lambda d: d["storages"][0].update(kind="cuda"), "a CUDA storage needs its IPC handle"),
    (lambda d: d["token"].update(kind="cuda", handle=b"x", device_uuid="GPU-0"), "the liveness token must be a CPU storage"),
    (lambda d: d["storages"][0].update(kind="tpu"), "Invalid enum value 'tpu'"),
    (lambda d: d.pop("token"), "missing required field `token`"),
])
def test_malformed_handles_are_refused_saying_why(change, why):
    d = good()
    change(d)
    with pytest.raises(MalformedIpcHandles, match=why):
        decode_handles(msgspec.msgpack.encode(d))


def test_bytes_that_are_not_handles_are_refused():
    with pytest.raises(MalformedIpcHandles, match="malformed IPC handles"):
        decode_handles(b"\xc1not msgpack")
    with pytest.raises(MalformedIpcHandles, match="Expected `object`, got `array`"):
        decode_handles(msgspec.msgpack.encode([1, 2, 3]))


def test_the_ipc_transport_is_registered_on_both_sides():
    assert trainer_transport("ipc") is IpcSend
    assert replica_transport("ipc") is IpcReceive


def test_shared_tensors_are_exposed_zero_copy_and_others_copied_once():
    shared = torch.arange(12, dtype=torch.float32).share_memory_()
    views = [("lo", shared[:6]), ("hi", shared[6:])]  # one storage, two tensors
    x = Exposure(1, [*views, ("own", torch.ones(4, dtype=torch.bfloat16))])
    try:
        assert x.copied_bytes == 8  # only the bfloat16 tensor that was not shared
        h = x.handles
        assert len(h.storages) == 2 and [t.storage for t in h.tensors] == [0, 0, 1]
        assert [t.offset for t in h.tensors] == [0, 24, 0]
        assert _token_alive(h)
        # What another process opens (here: this one, through /proc/<pid>/fd) is the same memory.
        s = _open_cpu(h.pid, h.storages[0], "storage 0")
        assert torch.equal(torch.empty(0).set_(s, 6, (6,)), shared[6:])
    finally:
        x.release()
    assert not _token_alive(h)  # released: a worker refuses it
