"""The contracts between weight sync's parts, one per side (structural: nothing subclasses them).

- trainer side: a :class:`Sender` is what :class:`~rollq.weightsync.publisher.WeightPublisher`
  drives for ``transport="nccl"`` (:class:`~rollq.weightsync.sender.BroadcastSender`);
- replica side: a :class:`Receiver` is what :class:`~rollq.weightsync.follower.WeightFollower`
  asks which versions arrived while serving
  (:class:`~rollq.weightsync.replica.ReplicaReceiver`), and :class:`ReplicaSide` is what weight
  sync needs from the consumer it updates (:class:`rollq.Consumer` provides it);
- worker side: :class:`~rollq.weightsync.receiver.ReceiveSink` (in
  :mod:`rollq.weightsync.receiver`) is what a broadcast receiver hands the bytes to.

What crosses between the processes is in :mod:`rollq.weightsync.wire`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..protocol import Control
from .versions import VersionRecord

if TYPE_CHECKING:
    import torch


class Sender(Protocol):
    """Moves one version from the trainer to every replica's workers."""

    async def send(self, version: int, items: list[tuple[str, torch.Tensor]], client: Any, keys: Any) -> VersionRecord:
        """Transfer ``items``; returns the record to commit once every worker holds them."""

    async def reset(self) -> None:
        """Forget the transport's state after a failure (the next send starts afresh)."""


class Receiver(Protocol):
    """A replica's side of a sender: which committed versions its workers already hold."""

    num_workers: int

    def fields(self) -> list[str]:
        """This replica's workers' fields in a version's ack hash."""

    async def start(self, client: Any) -> None: ...

    async def stop(self) -> None: ...

    async def staged_for(self, rec: VersionRecord, acks: list[Any] | None = None) -> int | None:
        """``rec.version`` when every worker holds it (``acks``: their acks, already read)."""

    async def apply_staged(self, rec: VersionRecord, staged: int, timeout: float) -> dict[str, Any]:
        """Swap the held version in; the first worker's report."""


class ReplicaSide(Protocol):
    """What weight sync needs from the consumer whose engine it updates."""

    id: str
    keys: Any  # rollq.keys.QueueKeys
    redis_settings: Any  # rollq.settings.RedisSettings
    engine: Any  # rollq.consumer.engine.Engine
    version: int  # the policy version the engine serves
    converted_from: list[str]  # dtypes of the last version that the engine converts to its own

    def add_control_handler(self, cb: Callable[[Control, str], Any]) -> None: ...

    def close_intake(self) -> None: ...

    def open_intake(self) -> None: ...

    def paused_for_update(self) -> contextlib.AbstractContextManager[None]: ...

    def swapping(self) -> contextlib.AbstractContextManager[None]: ...

    def record_update(self, update_s: float, pause_s: float) -> None: ...

    def set_version(self, version: int, progress: Any = None) -> None: ...

    async def announce(self) -> None: ...

    def running_count(self) -> int: ...

    def abort_running(self) -> list[Any]: ...

    def restart(self, jobs: list[Any]) -> None: ...

    def version_failed(self, version: int, reason: str) -> None: ...
