"""Versioned policy weights: durable records, memmap, NCCL/gloo and same-host IPC transports.

Folders by the process that runs them (what crosses between them: :mod:`.wire`; the
contracts between the parts: :mod:`.base`):

- :mod:`.trainer`: the publisher, the broadcast sender and its group, parameter shards, the
  IPC export of a version;
- :mod:`.replica` (the consumer's process): the follower, its calls into the workers;
- :mod:`.worker` (each vLLM worker): the worker extension and what it runs;
- :mod:`.transports`: both sides of each transport, picked by name (memmap, broadcast, ipc;
  the IPC handles that cross between the trainer and the workers: :mod:`.ipc_wire`);
- shared, here: :mod:`.process_group`, :mod:`.layout` (the broadcast's plumbing; :mod:`.nccl`
  tells its protocol), :mod:`.memmap`, :mod:`.pinned`, :mod:`.checksum` (storage),
  :mod:`.manifest`, :mod:`.versions`.

Modules whose names start with an underscore are internal: nothing outside
``rollq.weightsync`` imports them (tests aside), so they may be split or renamed freely.

Submodules import torch; this package imports them lazily, so ``import rollq.weightsync``
stays cheap for tools that only read version records (dashboards).
"""

from __future__ import annotations

import importlib
from typing import Any

_GROUPS: dict[str, dict[str, str]] = {
    "trainer": {"WeightPublisher": "trainer.publisher", "BroadcastSender": "trainer.sender"},
    "replica": {"WeightFollower": "replica.follower", "UpdateStats": "replica._stats", "WorkerCalls": "replica.worker_calls"},
    "worker": {"RollqWorkerExtension": "worker.ext"},
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
