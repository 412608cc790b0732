"""Weight transports behind one interface per side (:mod:`.base`), chosen by name (:mod:`.factory`):
memmap files (:mod:`.memmap`), the broadcast group, over NCCL or Gloo (:mod:`.broadcast`), and the
trainer's own tensors shared with replicas on its host, over CUDA IPC or CPU shared memory (:mod:`.ipc`)."""

from .base import PublisherSide, ReplicaTransport, Staged, TrainerTransport
from .factory import UnknownTransport, replica_transport, trainer_transport

__all__ = ["PublisherSide", "ReplicaTransport", "Staged", "TrainerTransport", "UnknownTransport", "replica_transport", "trainer_transport"]
