"""The broadcast backend: NCCL on GPUs, gloo on CPU-only machines, same protocol.

The trainer is rank 0; every vLLM worker of every replica is a rank (tensor-parallel
workers included). The group is a stateless process group over its own ``TCPStore``
(:mod:`rollq.weightsync.process_group`), so it never disturbs the trainer's own groups.

Protocol of one update (one control message, never one RPC per tensor):

1. The trainer (:class:`~rollq.weightsync.trainer.sender.BroadcastSender`) writes the *offer*
   (:class:`~rollq.weightsync.wire.Offer`: version, tensor manifest, optional checksum,
   mode) to Redis and announces it (``woffer <v>``).
2. Every worker that joined the group follows the offers itself
   (:class:`~rollq.weightsync.worker._listener.OfferListener`: a thread in the worker process with
   its own Redis connection, no engine RPC, which would queue behind generation steps) and
   receives the tensors (:class:`~rollq.weightsync.worker._receiver.WorkerReceiver`) straight into
   its shadow weights or a persistent flat staging buffer, on its own CUDA stream, while the
   engine keeps generating; then it writes its :class:`~rollq.weightsync.wire.Ack` into the
   offer's ack hash.
3. The trainer broadcasts (per tensor group, or in buckets: see
   :class:`~rollq.weightsync.wire.Mode`), then waits for every worker's ack.
4. All acked: the version is committed (durable record, pub/sub). Each replica
   (:class:`~rollq.weightsync.replica._receiver.ReplicaReceiver`) then swaps the staged tensors in
   with one ``collective_rpc`` (``rollq_apply_staged``), which vLLM runs between two engine
   steps.

Verification: with ``verify=True`` both sides compute the device-side checksum of the
tensors and the receivers refuse a mismatch. It is off by default for broadcasts (NCCL and
gloo deliver what was sent, and the checksum adds two full passes over the weights to the
update); storage (memmap) is always verified.

The group's members are the replicas that answered the trainer's call (each replica that
follows broadcasts registers itself); the trainer forms a new group before a version when a
replica joined, left or died. Every phase has a timeout (the call, each broadcast, the acks).
A broadcast broken by a member that died is offered once more over a group formed without it;
a version that some workers did not ack is committed for those that did, with a memmap copy for
the others where the publisher has a store; any other failure drops the group and the publisher
falls back to memmap for the same version; receivers that staged nothing load that copy.

This module gathers what a user of the backend imports: the trainer's sender, the wire
structs, the layout and the process-group plumbing. The parts that run in a replica and in
its workers are internal to :mod:`rollq.weightsync.replica` and :mod:`rollq.weightsync.worker`.
"""

from __future__ import annotations

from .layout import Layout, groups_of, typed_views
from .trainer.sender import BroadcastSender
from .process_group import (
    Group,
    free_port,
    in_daemon_thread,
    make_group,
    responsive_gil,
    wait_stream,
)
from .wire import Ack, FlatLayout, GroupInfo, Listen, Mode, Offer, manifest_digest

__all__ = [
    # trainer
    "BroadcastSender",
    # wire
    "Ack", "FlatLayout", "GroupInfo", "Listen", "Mode", "Offer", "manifest_digest",
    # transport and layout
    "Group", "Layout", "free_port", "groups_of", "in_daemon_thread", "make_group", "responsive_gil", "typed_views",
    "wait_stream",
]
