"""The typed stub for calls into a replica's vLLM workers (the replica's side of
:mod:`rollq.weightsync.worker.ext`).

One method per RPC of :class:`~rollq.weightsync.worker.ext.RollqWorkerExtension`, its name
written once (:class:`WorkerRpc`), its arguments passed by keyword, and its results, one per
worker, validated into the structs of :mod:`rollq.weightsync.wire`. A result that is not what
the call returns raises :class:`~rollq.weightsync.wire.MalformedReply`. Everything goes
through one generic call, the engine's ``call_workers`` (vLLM's ``collective_rpc``), as
vLLM's ``core_client.py`` puts one method per engine-core utility over ``call_utility``.

>>> import asyncio
>>> class Engine:  # any WorkerEngine: VllmEngine, FakeWorkerEngine, ...
...     num_workers = 1
...     async def call_workers(self, method, *args, timeout=None, **kwargs):
...         return [{"state": "staged", "version": kwargs.get("version", 3)}]
>>> [s.state for s in asyncio.run(WorkerCalls(Engine()).staged_status())]
[<State.STAGED: 'staged'>]
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from ..wire import (
    GroupInfo,
    IpcWatch,
    Listen,
    MalformedReply,
    StageStatus,
    SwapReport,
    SwapTimes,
    WorkerStatus,
    from_wire,
)

if TYPE_CHECKING:
    from ..base import WorkerEngine

T = TypeVar("T")


class WorkerRpc(str, enum.Enum):
    """The worker extension's methods (their names in the worker)."""

    LOAD_MEMMAP = "rollq_load_memmap"
    STAGE_MEMMAP = "rollq_stage_memmap"
    STAGED_STATUS = "rollq_staged_status"
    STAGE_IPC = "rollq_stage_ipc"
    IPC_STATUS = "rollq_ipc_status"
    WATCH_IPC = "rollq_watch_ipc"
    UNWATCH_IPC = "rollq_unwatch_ipc"
    JOIN_GROUP = "rollq_join_group"
    LEAVE_GROUP = "rollq_leave_group"
    RECEIVE_STATUS = "rollq_receive_status"
    APPLY_STAGED = "rollq_apply_staged"
    SWAP_OVERLAPPED = "rollq_swap_overlapped"
    SWAP_DONE = "rollq_swap_done"
    VERSION = "rollq_version"
    TRACK_PROGRESS = "rollq_track_progress"
    WEIGHT_SAMPLE = "rollq_weight_sample"


class WorkerCalls:
    """Calls into every worker of ``engine``; each returns one result per worker, in rank
    order (an engine without workers, the echo engine, returns none).

    ``timeout`` (where given) bounds the call in the engine (vLLM's ``collective_rpc``
    timeout); callers that need their own message wrap the call in ``asyncio.wait_for``.
    """

    def __init__(self, engine: WorkerEngine):
        self.engine = engine

    async def _call(self, rpc: WorkerRpc, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        got = await self.engine.call_workers(rpc.value, timeout=timeout, **kwargs)
        if not isinstance(got, list):
            raise MalformedReply(f"{rpc.value}: the engine answered {type(got).__name__}, not one result per worker")
        return got

    async def _each(self, rpc: WorkerRpc, cls: type[T], timeout: float | None = None, **kwargs: Any) -> list[T]:
        return [from_wire(r, cls, rpc.value) for r in await self._call(rpc, timeout, **kwargs)]

    # -- memmap --------------------------------------------------------------------------
    async def load_memmap(self, *, root: str, slot: str, version: int, checksum: str, verify: bool = True) -> list[SwapReport]:
        """Load committed ``version`` from memmap slot ``slot`` under ``root`` now (refused
        data comes back as each report's ``error``)."""
        return await self._each(WorkerRpc.LOAD_MEMMAP, SwapReport, root=root, slot=slot, version=version, checksum=checksum,
                                verify=verify, progress_since=self.engine.progress_since())

    async def stage_memmap(self, *, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int = 3) -> list[StageStatus]:
        """Start staging ``version`` in a thread of each worker; poll :meth:`staged_status`."""
        return await self._each(WorkerRpc.STAGE_MEMMAP, StageStatus, root=root, slot=slot, version=version, checksum=checksum,
                                chunks_in_flight=chunks_in_flight)

    async def staged_status(self) -> list[StageStatus]:
        """Where each worker's memmap staging stands."""
        return await self._each(WorkerRpc.STAGED_STATUS, StageStatus)

    # -- IPC (the trainer process on the same host) -------------------------------------
    async def stage_ipc(self, *, handles: bytes, version: int, chunk_bytes: int = 0, keep_maps: bool = True,
                        high_priority: bool = False, direct: bool = False) -> list[StageStatus]:
        """Start copying ``version`` from the trainer's exposed tensors (``handles``: msgpack
        :class:`~rollq.weightsync.ipc_wire.IpcHandles`) in a thread of each worker, waiting
        for the device after every ``chunk_bytes`` (0: never), keeping the trainer's storages
        mapped for the next version when ``keep_maps``, on a high-priority CUDA stream when
        ``high_priority``, leaving a leased version to a direct swap when ``direct``; poll
        :meth:`ipc_status`."""
        return await self._each(WorkerRpc.STAGE_IPC, StageStatus, handles=handles, version=version, chunk_bytes=chunk_bytes,
                                keep_maps=keep_maps, high_priority=high_priority, direct=direct)

    async def ipc_status(self) -> list[StageStatus]:
        """Where each worker's IPC staging stands."""
        return await self._each(WorkerRpc.IPC_STATUS, StageStatus)

    async def watch_ipc(self, *, watch: IpcWatch) -> int:
        """Have each worker start copying every version exposed over IPC when it is announced;
        how many workers watch."""
        return len(await self._call(WorkerRpc.WATCH_IPC, watch=msgspec.msgpack.encode(watch)))

    async def unwatch_ipc(self) -> None:
        await self._call(WorkerRpc.UNWATCH_IPC)

    # -- broadcast group ---------------------------------------------------------------
    async def join_group(self, *, info: GroupInfo, rank_offset: int, listen: Listen | None = None) -> None:
        """Join the trainer's broadcast group ``info`` as ranks ``rank_offset + rank`` (the
        join runs in a thread of each worker: poll :meth:`receive_status`); with ``listen``
        the workers follow the offers themselves."""
        await self._call(WorkerRpc.JOIN_GROUP, info=msgspec.msgpack.encode(info), rank_offset=rank_offset,
                         listen=msgspec.msgpack.encode(listen) if listen is not None else b"")

    async def leave_group(self, *, timeout: float | None = None) -> None:
        """Stop following offers and drop the group."""
        await self._call(WorkerRpc.LEAVE_GROUP, timeout)

    async def receive_status(self) -> list[WorkerStatus]:
        """Each worker's place in the group and its last receive."""
        return await self._each(WorkerRpc.RECEIVE_STATUS, WorkerStatus)

    # -- swaps -----------------------------------------------------------------------------
    async def apply_staged(self, *, version: int) -> list[SwapReport]:
        """Swap staged ``version`` in (shadow weights, memmap staging or broadcast buffer)."""
        return await self._each(WorkerRpc.APPLY_STAGED, SwapReport, version=version, progress_since=self.engine.progress_since())

    async def swap_overlapped(
        self, *, version: int, commit_timeout: float, receive_timeout: float, start_timeout: float, programs: int = 0,
    ) -> list[SwapReport]:
        """Swap ``version`` in part by part while it still arrives, then wait for its commit
        (``commit_timeout`` after the last part; ``receive_timeout`` for the receive to end;
        ``start_timeout`` for it to start; ``programs``: the exchange kernel's block cap)."""
        return await self._each(WorkerRpc.SWAP_OVERLAPPED, SwapReport, version=version, commit_timeout=commit_timeout,
                                receive_timeout=receive_timeout, start_timeout=start_timeout, programs=programs,
                                progress_since=self.engine.progress_since())

    async def swap_done(self) -> list[SwapTimes]:
        """When each worker's last swap was enqueued and when its copies finished."""
        return await self._each(WorkerRpc.SWAP_DONE, SwapTimes)

    async def version(self) -> list[int]:
        """The version each worker last swapped in (0: the checkpoint's)."""
        return await self._each(WorkerRpc.VERSION, int)

    # -- per-token versions and probes ------------------------------------------------------
    async def track_progress(self, *, timeout: float | None = None) -> list[bool]:
        """Have each worker remember how far requests had got when vLLM let go of them; True
        where this vLLM allows it."""
        return await self._each(WorkerRpc.TRACK_PROGRESS, bool, timeout)

    async def weight_sample(self, *, name_contains: str = "embed", offset: int = 0) -> list[list[float]]:
        """Four values of the first parameter whose name contains ``name_contains``, from
        element ``offset`` on ([] where none matches)."""
        return await self._each(WorkerRpc.WEIGHT_SAMPLE, list[float], name_contains=name_contains, offset=offset)
