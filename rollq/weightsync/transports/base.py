"""The two sides of a transport: how a version's weights leave the trainer, and how they get
into a replica's workers.

A transport is a name in the durable version record (``VersionRecord.transport``) and one
class per side, registered in :mod:`rollq.weightsync.transports.factory`: the publisher asks
the trainer-side registry for the name it was told to publish with, and the follower asks the
replica-side registry for the name in the record it applies. The two registries stay apart,
as each side runs in a process of its own (vLLM's ``weight_transfer`` keeps them apart alike).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from ...errors import CorruptWeights, WeightSyncError, WeightSyncTimeout
from ..wire import StageStatus, State, SwapReport, WorkerError
from ..replica.worker_calls import WorkerCalls

if TYPE_CHECKING:
    import torch

    from ...keys import QueueKeys
    from ...settings import WeightSyncSettings
    from ..base import Receiver, Sender
    from ..memmap import MemmapStore, SlotInfo
    from ..versions import VersionRecord


class PublisherSide(Protocol):
    """What a trainer transport uses of the publisher it serves
    (:class:`~rollq.weightsync.trainer.publisher.WeightPublisher` provides it)."""

    keys: QueueKeys
    store: MemmapStore | None
    sender: Sender | None
    trainer_id: str
    ipc_snapshot: bool
    ipc_lease: bool

    async def redis(self) -> Any:
        """The publisher's Redis client."""

    def memmap_record(self, info: SlotInfo, **extra: Any) -> VersionRecord:
        """The record of a version written into the publisher's memmap store."""


class TrainerTransport(ABC):
    """Trainer side: moves one version's tensors and returns its record (not yet committed;
    the publisher commits it). Built per publish from the publisher it serves."""

    def __init__(self, publisher: PublisherSide):
        self.publisher = publisher

    @abstractmethod
    async def send(self, version: int, items: list[tuple[str, torch.Tensor]]) -> VersionRecord:
        """Move ``items`` as ``version``; the record says how a replica finds them."""


@dataclass
class Staged:
    """A version this replica's workers hold, to swap in (``report``: the staging's timings
    and flags), and the transport that swaps it in."""

    version: int
    transport: ReplicaTransport
    report: dict[str, Any] = field(default_factory=dict)


class ReplicaTransport(ABC):
    """Replica side: gets a version's weights into this replica's workers while the engine
    serves (:meth:`stage`), then swaps them in (:meth:`swap`, intake closed).

    ``engine``: the replica's engine (its workers are reached through :attr:`workers`, the
    typed :class:`~rollq.weightsync.replica.worker_calls.WorkerCalls`);
    ``receiver``: the broadcast group membership, None when the replica is in no group;
    ``client`` and ``keys``: the follower's Redis client and its queue's keys, for a transport
    that reads what the trainer wrote beside the record (None where it needs none);
    ``replica``: the replica's id, for a transport that records what it did in Redis.
    """

    def __init__(self, engine: Any, settings: WeightSyncSettings, receiver: Receiver | None, *,
                 client: Any = None, keys: QueueKeys | None = None, replica: str = ""):
        self.engine = engine
        self.replica = replica
        self.workers = WorkerCalls(engine)
        self.settings = settings
        self.receiver = receiver
        self.client = client
        self.keys = keys

    @abstractmethod
    async def stage(self, rec: VersionRecord, acks: list[Any] | None) -> Staged | None:
        """What the workers hold of ``rec`` (received while serving, or staged now); None:
        nothing (the follower then falls back to the record's memmap copy, if any).
        ``acks``: this replica's acks of ``rec``, already read (or None)."""

    @abstractmethod
    async def swap(self, rec: VersionRecord, staged: Staged) -> SwapReport:
        """Swap the staged version in; the first worker's report."""

    async def unstage(self, staged: Staged) -> None:  # noqa: B027 - optional hook
        """The update of ``staged`` failed before its swap: what staging holds for it goes."""

    async def close(self) -> None:
        """The replica stops following versions (what the transport started in the workers ends)."""

    async def _until_staged(
        self, rec: VersionRecord, status: Callable[[], Awaitable[list[StageStatus]]], *, delay: float, failed: str,
        slow: str, report: dict[str, Any] | None = None,
        refine: Callable[[list[WorkerError], str], Exception | None] = lambda errors, msg: None,
    ) -> Staged:
        """Poll the workers' ``status`` (``delay`` doubling to 10 ms) until every one holds
        ``rec`` staged, for ``load_timeout`` at most. A worker's failure raises what ``refine``
        makes of it, else :class:`~rollq.errors.CorruptWeights` when a checksum refused it,
        else :class:`~rollq.errors.WeightSyncError` (``failed: ...``)."""
        timeout = self.settings.load_timeout
        deadline = time.monotonic() + timeout
        while True:
            states = await status()
            if all(s.state is State.STAGED and s.version == rec.version for s in states):
                return Staged(rec.version, self, report=dict(states[0].report(), **(report or {})))
            bad = [s for s in states if s.state is State.FAILED or s.version not in (0, rec.version)]
            if bad:
                errors = [s.error for s in bad if s.error is not None]
                msg = "; ".join(str(s.error or s) for s in bad)
                refined = refine(errors, msg)
                if refined is not None:
                    raise refined
                if any(e.corrupt for e in errors):
                    raise CorruptWeights(f"version {rec.version} refused: {msg}")
                raise WeightSyncError(f"{failed}: {msg}")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"{slow} took longer than {timeout}s (load_timeout)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)

    async def _swap_in_workers(self, rec: VersionRecord, staged: Staged) -> SwapReport:
        """Have every worker swap in what it staged (``apply_staged``), within ``load_timeout``;
        a worker that refused it raises here as its own error type. The first worker's report."""
        res = await self._swap_each(rec, staged)
        return res[0] if res else SwapReport()

    async def _swap_each(self, rec: VersionRecord, staged: Staged) -> list[SwapReport]:
        """:meth:`_swap_in_workers`, every worker's report."""
        timeout = self.settings.load_timeout
        try:
            res = await asyncio.wait_for(self.workers.apply_staged(version=staged.version), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(f"swapping in version {rec.version} took longer than {timeout}s") from e
        for r in res:
            if r.error is not None:
                raise r.error.exception(f"version {rec.version} refused: ")
        return res
