"""Versioned policy weights: durable records, memmap and NCCL/gloo transports."""

from .checksum import state_checksum, tensor_checksum
from .follower import UpdateStats, WeightFollower
from .memmap import MemmapStore
from .publisher import WeightPublisher
from .versions import TensorMeta, VersionRecord, commit_version, read_version

__all__ = [
    "MemmapStore", "TensorMeta", "UpdateStats", "VersionRecord", "WeightFollower", "WeightPublisher",
    "commit_version", "read_version", "state_checksum", "tensor_checksum",
]
