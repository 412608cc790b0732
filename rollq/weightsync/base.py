"""The contracts between weight sync's parts, one per side (structural: nothing subclasses them).

- trainer side: a :class:`Sender` is what :class:`~rollq.weightsync.trainer.publisher.WeightPublisher`
  drives for ``transport="nccl"`` (:class:`~rollq.weightsync.trainer.sender.BroadcastSender`);
- replica side: a :class:`Receiver` is what :class:`~rollq.weightsync.replica.follower.WeightFollower`
  asks which versions arrived while serving
  (:class:`~rollq.weightsync.replica._receiver.ReplicaReceiver`), :class:`ReplicaSide` is what weight
  sync needs from the consumer it updates (:class:`rollq.Consumer` provides it), and
  :class:`WorkerEngine` what it needs from that consumer's engine (every
  :class:`~rollq.consumer.engine.Engine` provides it); calls into the engine's workers go
  through :class:`~rollq.weightsync.replica.worker_calls.WorkerCalls`;
- worker side: a :class:`ReceiveSink` is what a broadcast receiver hands the bytes to (the
  worker's state, :class:`~rollq.weightsync.worker._state.WorkerState`), an
  :class:`InPlaceTarget` the shadow bytes a version is written into; :class:`OfferHost` is
  what the offer listener needs from the receiver it serves
  (:class:`~rollq.weightsync.worker._receiver.WorkerReceiver`), :class:`StagingHost` what memmap
  staging needs from its worker's state.

What crosses between the processes is in :mod:`rollq.weightsync.wire`.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from ..protocol import Control
from .versions import VersionRecord

if TYPE_CHECKING:
    import torch

    from ..consumer.engine import SwapProgress
    from .versions import TensorMeta
    from .wire import FlatLayout, GroupInfo, Offer, Progress, ReceiveStatus, SwapReport
    from .worker._progress import RequestTracker


class Sender(Protocol):
    """Moves one version from the trainer to every replica's workers."""

    async def send(self, version: int, items: list[tuple[str, torch.Tensor]], client: Any, keys: Any) -> VersionRecord:
        """Transfer ``items``; returns the record to commit once every worker holds them."""

    async def reset(self) -> None:
        """Forget the transport's state after a failure (the next send starts afresh)."""


class Receiver(Protocol):
    """A replica's side of a sender: which committed versions its workers already hold."""

    @property
    def num_workers(self) -> int: ...

    #: The backend of the group it last joined (``nccl``, ``gloo``); None before one.
    backend: str | None

    def fields(self) -> list[str]:
        """This replica's workers' fields in a version's ack hash."""

    async def start(self, client: Any) -> None: ...

    async def stop(self) -> None: ...

    async def staged_for(self, rec: VersionRecord, acks: list[Any] | None = None) -> int | None:
        """``rec.version`` when every worker holds it (``acks``: their acks, already read)."""

    async def apply_staged(self, rec: VersionRecord, staged: int, timeout: float) -> SwapReport:
        """Swap the held version in; the first worker's report."""


class WorkerEngine(Protocol):
    """What weight sync needs from a replica's engine: calls into its workers (only through
    :class:`~rollq.weightsync.replica.worker_calls.WorkerCalls`), pausing it around a load, and how
    far running requests had got at a swap."""

    @property
    def num_workers(self) -> int:
        """Workers of the engine; each joins weight broadcasts."""

    async def call_workers(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` of the worker extension in every worker; one result each."""

    async def pause(self, mode: str = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self) -> bool | None: ...

    def swap_progress(self, report: Progress | None) -> SwapProgress | None:
        """A swap report's progress (engine request ids) as the consumer's (its request ids)."""

    def progress_since(self) -> float:
        """A swap's report may leave out requests the engine let go of before this wall-clock
        time (0.0: it leaves out none)."""


class ReplicaSide(Protocol):
    """What weight sync needs from the consumer whose engine it updates."""

    id: str
    keys: Any  # rollq.keys.QueueKeys
    redis_settings: Any  # rollq.settings.RedisSettings
    @property
    def engine(self) -> WorkerEngine: ...
    version: int  # the policy version the engine serves
    converted_from: list[str]  # dtypes of the last version that the engine converts to its own

    def add_control_handler(self, cb: Callable[[Control, str], Any]) -> None: ...

    def close_intake(self) -> None: ...

    def open_intake(self) -> None: ...

    def paused_for_update(self) -> contextlib.AbstractContextManager[None]: ...

    def swapping(self) -> contextlib.AbstractContextManager[None]: ...

    def record_update(self, update_s: float, pause_s: float) -> None: ...

    def set_version(self, version: int, progress: SwapProgress | None = None) -> None: ...

    async def announce(self) -> None: ...

    def running_count(self) -> int: ...

    def abort_running(self) -> list[Any]: ...

    def collect_partials(self) -> None: ...

    async def partials(self, timeout: float) -> list[Any]: ...

    def parked_jobs(self) -> list[Any]: ...

    def restart(self, jobs: list[Any]) -> None: ...

    def version_failed(self, version: int, reason: str) -> None: ...


# -- worker side -------------------------------------------------------------------------------
class InPlaceTarget(Protocol):
    """The bytes a version is written into in place (the worker lock is held until :meth:`done`)."""

    #: Each tensor's bytes (``uint8``), in manifest order.
    views: list[torch.Tensor]
    #: The shadow's flat buffer and each tensor's offset in it with its size (None: not flat).
    flat: torch.Tensor | None
    flat_offsets: tuple[list[int], int] | None

    def done(self, version: int, ok: bool) -> None:
        """Every byte is in (the caller waited for its copies), or the write failed."""


class ReceiveSink(Protocol):
    """What a worker does with received versions."""

    def load_while_receiving(self, version: int, items: Iterable[tuple[str, torch.Tensor]], stream: Any,
                             manifest: list[TensorMeta]) -> bool:
        """Consume the ``(name, tensor)`` pairs as they arrive, in the receiving thread; True
        when it holds the whole version (then nothing is loaded at the swap)."""

    def invalidate(self) -> None:
        """Drop what :meth:`load_while_receiving` loaded: the version turned out bad."""

    def in_place_target(self, version: int, manifest: list[TensorMeta], stream: Any) -> InPlaceTarget | None:
        """Where to receive each tensor in place; None: stage it and hand it over instead."""

    def flat_layout(self, manifest: list[TensorMeta]) -> FlatLayout | None:
        """This worker's flat layout for ``manifest``, reported to the trainer."""


class OfferHost(Protocol):
    """What the offer listener (:class:`~rollq.weightsync.worker._listener.OfferListener`) needs from
    the receiver it serves: the group, this worker's rank and status, and the receive."""

    rank: int
    info: GroupInfo
    #: Set when the receiver left its group (the listener then ends).
    closed: threading.Event
    status: ReceiveStatus
    sink: ReceiveSink | None

    def on_control(self, text: str) -> None:
        """A control message the listener heard (a verb about the group)."""

    def receive(self, offer: Offer) -> None:
        """Take part in ``offer``'s broadcast (blocks until it ends)."""


class StagingHost(ReceiveSink, Protocol):
    """What memmap staging (:class:`~rollq.weightsync.worker._memmap.MemmapStaging`) needs
    from its worker's state: the sink a version is loaded into, and the live weights."""

    #: vLLM's worker object.
    worker: Any
    #: Held while the shadow weights or the staging change.
    lock: threading.Lock
    #: The policy version the live weights hold.
    version: int
    tracker: RequestTracker

    @property
    def device(self) -> torch.device: ...

    def load_live(self, items: Iterable[tuple[str, torch.Tensor]], *, trace: bool = False) -> None:
        """Load ``items`` into the served weights now (the engine is paused); ``trace``: record
        their load plan where there are no shadow weights (a direct swap's load)."""
