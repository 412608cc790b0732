"""vLLM worker extension: loads rollq weight versions inside every vLLM worker.

Pass ``worker_extension_cls="rollq.weightsync.worker.ext.RollqWorkerExtension"`` to the engine;
the replica then calls these methods through ``collective_rpc``, by keyword, one call per
update for all workers (never one per tensor), only through the typed stub
:class:`~rollq.weightsync.replica.worker_calls.WorkerCalls`, which names each method once. Methods run inside each worker process, next to the
model, so the weights never travel through the engine's RPC channel.

This class is only the RPC surface: each method is a call into the worker's
:class:`~rollq.weightsync.worker._state.WorkerState` (:attr:`RollqWorkerExtension.rollq_state`,
the one attribute rollq sets on vLLM's worker). Arguments and results are plain values,
since nothing else crosses ``collective_rpc``: results are the maps of the structs in
:mod:`rollq.weightsync.wire`, and refused data comes back as a ``WorkerError`` in them.
Staging (broadcast receive, memmap read) runs in threads of the worker process: an RPC that
did the work itself would hold the engine's step loop for its whole duration.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec

from ..wire import GroupInfo, IpcWatch, Listen, to_wire
from ._state import WorkerState

_init_lock = threading.Lock()


class RollqWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    model_runner: Any  # vLLM's worker has one

    @property
    def rollq_state(self) -> WorkerState:
        """rollq's state in this worker (built on first use)."""
        st = self.__dict__.get("_rollq")
        if st is None:
            with _init_lock:
                st = self.__dict__.get("_rollq")
                if st is None:
                    st = self.__dict__["_rollq"] = WorkerState(self)
        return st

    # -- memmap --------------------------------------------------------------------------
    def rollq_load_memmap(self, root: str, slot: str, version: int, checksum: str, verify: bool = True,
                          progress_since: float = 0.0) -> dict[str, Any]:
        """Load committed ``version`` from a memmap slot now; a
        :class:`~rollq.weightsync.wire.SwapReport` (``progress_since`` as for :meth:`rollq_apply_staged`)."""
        self.rollq_state.tracker.since = progress_since
        return to_wire(self.rollq_state.memmap.load(root, slot, version, checksum, verify))

    def rollq_stage_memmap(self, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int = 3) -> dict[str, Any]:
        """Start reading ``version``, copying it to the device and verifying it, in a thread
        of this worker (the engine keeps serving). Poll :meth:`rollq_staged_status`;
        :meth:`rollq_apply_staged` then swaps it in."""
        return to_wire(self.rollq_state.memmap.stage(root, slot, version, checksum, chunks_in_flight))

    def rollq_staged_status(self) -> dict[str, Any]:
        """The memmap staging: a :class:`~rollq.weightsync.wire.StageStatus`."""
        return to_wire(self.rollq_state.memmap.status)

    # -- IPC (the trainer process on the same host) -------------------------------------
    def rollq_stage_ipc(self, handles: bytes, version: int, chunk_bytes: int = 0, keep_maps: bool = True,
                        high_priority: bool = False, direct: bool = False) -> dict[str, Any]:
        """Start copying ``version`` from the trainer's exposed tensors (``handles``: a msgpack
        :class:`~rollq.weightsync.ipc_wire.IpcHandles`) in a thread of this worker (the engine
        keeps serving), waiting for the device after every ``chunk_bytes`` (0: never), keeping
        the trainer's storages mapped for the next version when ``keep_maps``, leaving a
        leased version to a direct swap when ``direct``. Poll :meth:`rollq_ipc_status`;
        :meth:`rollq_apply_staged` swaps it in."""
        return to_wire(self.rollq_state.ipc.stage(handles, version, chunk_bytes, keep_maps, high_priority, direct))

    def rollq_ipc_status(self) -> dict[str, Any]:
        """The IPC staging: a :class:`~rollq.weightsync.wire.StageStatus`."""
        return to_wire(self.rollq_state.ipc.status)

    def rollq_watch_ipc(self, watch: bytes) -> None:
        """Start copying each version exposed over IPC when it is announced (``watch``: a
        msgpack :class:`~rollq.weightsync.wire.IpcWatch`), in a thread of this worker."""
        self.rollq_state.watch_ipc(msgspec.msgpack.decode(watch, type=IpcWatch))

    def rollq_unwatch_ipc(self) -> None:
        """Stop watching for IPC versions."""
        self.rollq_state.unwatch_ipc()

    # -- broadcast (NCCL / gloo) -------------------------------------------------------
    def rollq_join_group(self, info: bytes, rank_offset: int, listen: bytes = b"") -> None:
        """Join the trainer's broadcast group as rank ``rank_offset + self.rank`` (in a thread).

        ``info``: a msgpack :class:`~rollq.weightsync.wire.GroupInfo`. With ``listen`` (a
        msgpack :class:`~rollq.weightsync.wire.Listen`) the worker then follows offers itself
        and acks each one in Redis (field ``listen.field + rank``).
        """
        gi = msgspec.msgpack.decode(info, type=GroupInfo)
        lst = msgspec.msgpack.decode(listen, type=Listen) if listen else None
        self.rollq_state.join_group(gi, rank_offset, lst)

    def rollq_leave_group(self) -> None:
        """Stop following offers and drop the group (the staging buffer goes with it)."""
        self.rollq_state.leave_group()

    def rollq_receive_status(self) -> dict[str, Any]:
        """The join and the last receive: a :class:`~rollq.weightsync.wire.WorkerStatus`."""
        return to_wire(self.rollq_state.receive_status())

    # -- swaps -----------------------------------------------------------------------------
    def rollq_apply_staged(self, version: int, progress_since: float = 0.0) -> dict[str, Any]:
        """Swap a staged version in (:func:`rollq.weightsync.worker._swap.apply_staged`);
        ``progress_since``: :attr:`~rollq.weightsync.worker._progress.RequestTracker.since` for its report."""
        from ._swap import apply_staged

        self.rollq_state.tracker.since = progress_since
        report = apply_staged(self.rollq_state, version)
        report.returned_at = time.time()
        return to_wire(report)

    def rollq_swap_overlapped(
        self, version: int, commit_timeout: float = 0.25, receive_timeout: float = 5.0, start_timeout: float = 0.05,
        programs: int = 0, progress_since: float = 0.0,
    ) -> dict[str, Any]:
        """Swap ``version`` in while its last parts still arrive, then wait for its commit
        (:func:`rollq.weightsync.worker._swap.swap_overlapped`; ``progress_since`` as for
        :meth:`rollq_apply_staged`)."""
        from ._swap import swap_overlapped

        self.rollq_state.tracker.since = progress_since
        return to_wire(swap_overlapped(self.rollq_state, version, commit_timeout, receive_timeout, start_timeout, programs))

    def rollq_swap_done(self) -> dict[str, Any]:
        """When the last swap was enqueued and when its copies finished: a
        :class:`~rollq.weightsync.wire.SwapTimes`."""
        return to_wire(self.rollq_state.last_swap)

    def rollq_version(self) -> int:
        return self.rollq_state.version

    # -- per-token versions -------------------------------------------------------------
    def rollq_track_progress(self) -> bool:
        """Start remembering how many tokens each request had generated when vLLM let go of
        it, so a later swap can tell a request that finished on the old weights from one that
        had not started. True where this vLLM allows it; the engine calls it once at start
        (:meth:`rollq.weightsync.worker._progress.RequestTracker.install`)."""
        return self.rollq_state.tracker.install(getattr(self, "model_runner", None))

    def rollq_weight_sample(self, name_contains: str = "embed", offset: int = 0) -> list[float]:
        """Four values of the first parameter whose name contains ``name_contains``, from
        element ``offset`` on (tests and benchmarks use it to see an update land)."""
        for name, p in self.model_runner.model.named_parameters():
            if name_contains in name and p.numel() > 0:
                return p.detach().reshape(-1)[offset : offset + 4].float().cpu().tolist()
        return []
