"""The registries of transports, one per side, keyed by the name in the version record.

>>> trainer_transport("gloo").__name__
'BroadcastSend'
>>> replica_transport("gloo").__name__
'BroadcastReceive'
>>> replica_transport("carrier-pigeon")
Traceback (most recent call last):
...
rollq.weightsync.transports.factory.UnknownTransport: unknown weight transport 'carrier-pigeon' on the replica side (known: gloo, ipc, memmap, nccl)

A new transport is one module per side, registered here.
"""

from __future__ import annotations

import importlib

from ...errors import WeightSyncError
from .base import ReplicaTransport, TrainerTransport

#: Trainer side: name given to ``publish_weights(transport=...)`` -> "module:class". The
#: broadcast goes over the sender's backend, whichever of its names is given.
TRAINER: dict[str, str] = {
    "memmap": "rollq.weightsync.transports.memmap:MemmapSend",
    "broadcast": "rollq.weightsync.transports.broadcast:BroadcastSend",
    "nccl": "rollq.weightsync.transports.broadcast:BroadcastSend",
    "gloo": "rollq.weightsync.transports.broadcast:BroadcastSend",
    "ipc": "rollq.weightsync.transports.ipc:IpcSend",
}
#: Replica side: ``VersionRecord.transport`` -> "module:class".
REPLICA: dict[str, str] = {
    "memmap": "rollq.weightsync.transports.memmap:MemmapReceive",
    "nccl": "rollq.weightsync.transports.broadcast:BroadcastReceive",
    "gloo": "rollq.weightsync.transports.broadcast:BroadcastReceive",
    "ipc": "rollq.weightsync.transports.ipc:IpcReceive",
}


class UnknownTransport(WeightSyncError, ValueError):
    """No transport of that name is registered on this side."""


def _load(registry: dict[str, str], name: str, side: str) -> type:
    try:
        target = registry[name]
    except KeyError:
        raise UnknownTransport(
            f"unknown weight transport {name!r} on the {side} side (known: {', '.join(sorted(registry))})"
        ) from None
    module, cls = target.split(":")
    found: type = getattr(importlib.import_module(module), cls)
    return found


def trainer_transport(name: str) -> type[TrainerTransport]:
    """The trainer-side class for ``name`` (:class:`UnknownTransport` if none)."""
    return _load(TRAINER, name, "trainer")


def replica_transport(name: str) -> type[ReplicaTransport]:
    """The replica-side class for a record's ``transport`` (:class:`UnknownTransport` if none)."""
    return _load(REPLICA, name, "replica")
