"""Versioned policy weights: durable records, memmap and NCCL/gloo transports.

Submodules import torch; this package imports them lazily, so ``import rollq.weightsync``
stays cheap for tools that only read version records (dashboards).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "state_checksum": "checksum", "tensor_checksum": "checksum",
    "UpdateStats": "follower", "WeightFollower": "follower",
    "MemmapStore": "memmap",
    "WeightPublisher": "publisher",
    "TensorMeta": "versions", "VersionRecord": "versions", "commit_version": "versions",
    "read_version": "versions", "version_log": "versions", "LoadError": "versions", "read_load_errors": "versions",
    "Manifest": "manifest", "read_manifest": "manifest", "check_state": "manifest",
    "BroadcastSender": "nccl",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'rollq.weightsync' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
