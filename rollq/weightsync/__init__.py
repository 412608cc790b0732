"""Versioned policy weights: durable records, memmap, NCCL/gloo and same-host IPC transports.

Modules by the process that runs them (what crosses between them: :mod:`.wire`; the
contracts between the parts: :mod:`.base`):

- trainer: :mod:`.publisher`, :mod:`.sender`, :mod:`.ipc_export`;
- replica (the consumer's process): :mod:`.follower`, :mod:`.overlap`, :mod:`.load_failures`,
  :mod:`.replica`, :mod:`.worker_calls` (its calls into the workers);
- vLLM worker: :mod:`.worker_ext` (the RPC surface), :mod:`.worker_state`, :mod:`.receiver`,
  :mod:`.listener`, :mod:`.worker_swap`, :mod:`.worker_memmap`, :mod:`.worker_ipc`, :mod:`.worker_progress`,
  :mod:`.shadow`, :mod:`.swap_kernel`;
- both sides of each transport, picked by name: :mod:`.transports` (memmap, broadcast, ipc;
  the IPC handles that cross between the trainer and the workers: :mod:`.ipc_wire`);
- shared: :mod:`.process_group`, :mod:`.layout` (the broadcast's plumbing; :mod:`.nccl` tells its
  protocol), :mod:`.memmap`, :mod:`.pinned`, :mod:`.checksum` (storage), :mod:`.manifest`,
  :mod:`.versions`.

Submodules import torch; this package imports them lazily, so ``import rollq.weightsync``
stays cheap for tools that only read version records (dashboards).
"""

from __future__ import annotations

import importlib
from typing import Any

_GROUPS: dict[str, dict[str, str]] = {
    "trainer": {"WeightPublisher": "publisher", "BroadcastSender": "sender"},
    "replica": {"WeightFollower": "follower", "UpdateStats": "follower", "WorkerCalls": "worker_calls"},
    "worker": {"RollqWorkerExtension": "worker_ext", "WorkerState": "worker_state"},
    "storage": {"MemmapStore": "memmap", "state_checksum": "checksum", "tensor_checksum": "checksum"},
    "versions": {
        "TensorMeta": "versions", "VersionRecord": "versions", "commit_version": "versions", "read_version": "versions",
        "version_log": "versions", "LoadError": "versions", "read_load_errors": "versions",
    },
    "manifests": {"Manifest": "manifest", "read_manifest": "manifest", "check_state": "manifest"},
    "contracts": {
        "Sender": "base", "Receiver": "base", "Replica": "base", "WorkerEngine": "base",
        "SwapReport": "wire", "WorkerError": "wire", "Ack": "wire", "Offer": "wire", "GroupInfo": "wire",
        "IpcHandles": "ipc_wire", "IpcUnavailable": "ipc_wire", "MalformedIpcHandles": "ipc_wire",
    },
}
_EXPORTS = {name: mod for group in _GROUPS.values() for name, mod in group.items()}

__all__ = [name for group in _GROUPS.values() for name in group]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rollq.weightsync' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
