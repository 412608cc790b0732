"""What crosses between the processes of weight sync: Redis records, RPC results, errors.

Three processes take part (see :mod:`rollq.weightsync.nccl` for one update's protocol):

- the trainer writes a :class:`GroupInfo` (``wgroup``) and an :class:`Offer` (``woffer``),
  and reads each worker's :class:`Ack` and :class:`FlatLayout`;
- a replica registers and answers the trainer's group calls with a :func:`member_entry`
  (``wmembers``, ``wanswers``; see :mod:`rollq.weightsync.trainer.group`), hands its workers a
  :class:`Listen`, and reads their :class:`WorkerStatus`, :class:`StageStatus` and
  :class:`SwapReport` back from ``collective_rpc``;
- a vLLM worker reads the offers and writes the acks.

Redis records are msgpack; RPC results cross ``collective_rpc`` as plain maps
(:func:`to_wire`), since vLLM's channel carries no custom types, and are validated back into
their struct on the replica (:func:`from_wire`). An exception raised in a worker crosses as
a :class:`WorkerError` value and is raised again, as its own type, where the replica waits.
This module imports no torch.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, TypeVar

import msgspec

from ..errors import (
    CorruptWeights,
    ProtocolError,
    WeightMismatch,
    WeightSyncError,
    WeightSyncTimeout,
)
from .ipc_wire import IpcUnavailable, TornDirectSwap
from .versions import TensorMeta

T = TypeVar("T")


# -- errors ----------------------------------------------------------------------------
_ERRORS: dict[str, type[WeightSyncError]] = {
    c.__name__: c for c in (WeightSyncError, CorruptWeights, WeightSyncTimeout, WeightMismatch, IpcUnavailable, TornDirectSwap)
}


class WorkerError(msgspec.Struct, kw_only=True):
    """An exception raised inside a worker, as a value (only text crosses ``collective_rpc``)."""

    kind: str  # the exception's class name
    message: str

    @classmethod
    def of(cls, e: BaseException) -> WorkerError:
        return cls(kind=type(e).__name__, message=str(e))

    @property
    def corrupt(self) -> bool:
        """The stored version is corrupt: it is never retried."""
        return self.kind == CorruptWeights.__name__

    def exception(self, context: str = "") -> WeightSyncError:
        """The error to raise on this side: the worker's own weight-sync type, else
        :class:`~rollq.errors.WeightSyncError`; ``context`` goes before the message."""
        cls = _ERRORS.get(self.kind, WeightSyncError)
        return cls(f"{context}{self}")

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


# -- the broadcast group and its offers (Redis) -------------------------------------------
class GroupInfo(msgspec.Struct, kw_only=True):
    """The trainer's broadcast group (Redis ``wgroup``)."""

    id: str
    host: str
    port: int
    world_size: int
    backend: str
    timeout: float
    #: NCCL: at least this many channels (CTAs) per collective (0: NCCL's default). Given to
    #: NCCL as ``NCCL_MIN_NCHANNELS`` (unless already set), which NCCL reads once per process,
    #: at its first communicator, so it changes the whole process: off by default
    #: (benchmarks/README.md has the measurements). NCCL refuses ``min_ctas`` in the
    #: communicator config, hence the environment variable.
    min_ctas: int = 0
    #: The member replicas (those that answered the group's call) and the first rank of
    #: each; a replica holds ranks ``ranks[id] .. ranks[id] + workers - 1``.
    ranks: dict[str, int] = {}


def member_entry(workers: int, incarnation: str) -> str:
    """A replica's entry in the broadcast members hash, and its answer to a group's call: its
    worker count and a token new at each start (a restart under the same id is a new member)."""
    return f"{workers} {incarnation}"


def member_workers(entry: bytes | str) -> int:
    """The worker count of a :func:`member_entry`."""
    return int((entry.decode() if isinstance(entry, bytes) else entry).split()[0])


class Listen(msgspec.Struct, kw_only=True):
    """Where a worker listens for offers and writes its ack (given when it joins)."""

    url: str  # Redis URL (a ``redis+cluster://`` URL goes through the cluster client)
    channel: str  # the queue's control channel (``woffer <v>`` hints)
    offer_key: str  # hash holding the current offer
    field: str  # this worker's ack field, ``replica/rank-in-replica``
    poll: float = 1.0  # seconds between checks of the offer record (pub/sub is only a hint)
    layouts_key: str = ""  # hash to report this worker's FlatLayout in (same field)
    version_key: str = ""  # the committed version record (a swap overlapped with the receive waits for it)
    #: The replica's serving version when it joined: offers of it or older are not received.
    #: Only the replica knows what it serves: an engine reused by another consumer (another
    #: queue, whose versions start again at 1) keeps the last version it loaded.
    serving: int = 0


class IpcWatch(msgspec.Struct, kw_only=True):
    """Where a worker watches for versions exposed over IPC, to start copying each one as soon
    as it is announced (:class:`~rollq.weightsync.worker._ipc_watch.IpcWatcher`)."""

    url: str  # Redis URL (a ``redis+cluster://`` URL goes through the cluster client)
    channel: str  # the queue's control channel (``version <v>`` hints)
    handles_key: str  # the trainer's exposed handles (``QueueKeys.weights_ipc``)
    status_key: str  # hash the worker writes its copy's StageStatus to (``QueueKeys.weights_ipc_staged``)
    field: str  # this worker's field there, ``replica/rank-in-replica`` (the rank is appended)
    #: Hash the worker writes each direct swap's SwapTimes to, under the same field, once its
    #: copies ended (``QueueKeys.weights_ipc_swaps``; empty: not written).
    swaps_key: str = ""
    poll: float = 1.0  # seconds between checks of the handles (pub/sub is only a hint)
    chunk_bytes: int = 0  # as ``WeightSyncSettings.ipc_chunk_bytes``
    keep_maps: bool = True  # as ``WeightSyncSettings.ipc_keep_mappings``
    high_priority: bool = False  # as ``WeightSyncSettings.ipc_high_priority``
    direct: bool = False  # as ``WeightSyncSettings.ipc_direct``
    #: The replica's serving version when it started watching: versions up to it are not
    #: copied (an engine reused by another queue keeps the last version it loaded).
    serving: int = 0


class Mode(str, enum.Enum):
    """How an offer's bytes travel (:attr:`Offer.mode`)."""

    #: Tensors packed into ``bucket_bytes`` buckets: few large messages, best for gloo.
    PACKED = "packed"
    #: One broadcast per tensor straight from the trainer's tensors into the receivers'
    #: staging views or shadow bytes: no copy on either side.
    DIRECT = "direct"
    #: Buckets packed by the trainer at ``offsets``, the layout every receiver reported for
    #: its shadow weights: each bucket lands in place, a few collective calls per version.
    LAYOUT = "layout"


class Offer(msgspec.Struct, kw_only=True):
    """A version being broadcast (Redis ``woffer``)."""

    version: int
    group: str
    #: state_checksum of the tensors; "" when the sender does not verify.
    checksum: str
    bucket_bytes: int
    manifest: list[TensorMeta]
    timeout: float
    mode: Mode = Mode.PACKED
    #: Hash receivers write their :class:`Ack` into, under ``replica/worker``.
    acks: str = ""
    #: List receivers also push their :class:`Ack` onto (the trainer blocks on it); "": none.
    ack_signal: str = ""
    #: ``direct`` mode on NCCL: consecutive tensors up to this many bytes go as one coalesced
    #: NCCL group (one kernel launch: per-tensor launches wait for the SMs a busy engine
    #: holds). 0: one launch per tensor.
    group_bytes: int = 0
    #: ``layout`` mode: each tensor's byte offset in the flat stream, and the stream's size.
    offsets: list[int] = []
    total: int = 0

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)  # an offer built in code may name its mode as a string

    @property
    def verify(self) -> bool:
        return bool(self.checksum)


class FlatLayout(msgspec.Struct, kw_only=True):
    """Where a receiver's shadow weights hold each tensor of a manifest, in one flat buffer
    (Redis ``wlayouts``; see :meth:`rollq.weightsync.worker._shadow.ShadowWeights.flat_offsets`)."""

    sig: str  # manifest_digest of the manifest it is for
    offsets: list[int]
    total: int


def manifest_digest(manifest: list[TensorMeta]) -> str:
    """A short digest of a manifest's names, dtypes and shapes, in order."""
    return hashlib.blake2b(msgspec.msgpack.encode(manifest), digest_size=12).hexdigest()


# -- a worker's answer to an offer (Redis) -------------------------------------------------
class Ack(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One worker's answer to an offer: the same bytes go into the offer's ack hash (field
    ``worker``) and onto its signal list. Times are the receiver's own, in seconds."""

    worker: str  # ``replica/rank-in-replica``
    version: int
    ok: bool  # every byte arrived (and matched the checksum, when verified)
    group: str = ""  # the group it was received over (a version may be offered again in a new group)
    error: WorkerError | None = None
    in_place: bool = False  # written straight into the shadow weights
    receive_s: float = 0.0  # until every byte was in
    verify_s: float = 0.0
    setup_s: float = 0.0  # until the first broadcast was enqueued
    enqueued_s: float = 0.0  # until the last one was


_ACK = msgspec.msgpack.Decoder(Ack)


def encode_ack(ack: Ack) -> bytes:
    return msgspec.msgpack.encode(ack)


def decode_ack(raw: bytes | None, worker: str = "?") -> Ack | None:
    """The ack in ``raw`` (None: none written yet); bytes that are not an ack read as a
    failed one, so the trainer reports them instead of waiting for them."""
    if raw is None:
        return None
    try:
        return _ACK.decode(raw)
    except msgspec.DecodeError as e:
        return Ack(worker=worker, version=0, ok=False, error=WorkerError(kind=ProtocolError.__name__, message=f"unreadable ack: {e}"))


# -- worker statuses and reports (collective_rpc results) ----------------------------------
class State(str, enum.Enum):
    """Where a worker's receive, join or memmap staging stands."""

    IDLE = "idle"
    JOINING = "joining"
    RECEIVING = "receiving"
    STAGING = "staging"
    STAGED = "staged"
    BUSY = "busy"  # a staging request arrived while another still ran
    FAILED = "failed"


class ReceiveStatus(msgspec.Struct, kw_only=True):
    """A worker's last broadcast receive (:attr:`rollq.weightsync.worker._receiver.WorkerReceiver.status`)."""

    state: State = State.IDLE
    version: int = 0
    receive_s: float = 0.0
    verify_s: float = 0.0
    setup_s: float = 0.0
    enqueued_s: float = 0.0
    #: The shadow weights loaded the tensors as they arrived.
    loaded_while_receiving: bool = False
    in_place: bool = False
    error: WorkerError | None = None

    def ack(self, worker: str, group: str = "") -> Ack:
        return Ack(
            worker=worker, version=self.version, ok=self.state is State.STAGED, group=group, error=self.error, in_place=self.in_place,
            receive_s=self.receive_s, verify_s=self.verify_s, setup_s=self.setup_s, enqueued_s=self.enqueued_s,
        )


class WorkerStatus(msgspec.Struct, kw_only=True):
    """A worker's place in the trainer's broadcast group (``rollq_receive_status``)."""

    state: State = State.IDLE  # JOINING, then IDLE once joined, or FAILED
    group: str = ""
    joined: bool = False
    rank: int = -1
    error: WorkerError | None = None
    receive: ReceiveStatus = msgspec.field(default_factory=ReceiveStatus)


class StageStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A worker's memmap or IPC staging (``rollq_stage_memmap``, ``rollq_staged_status``;
    ``rollq_stage_ipc``, ``rollq_ipc_status``)."""

    state: State = State.IDLE
    version: int = 0
    stage_s: float | None = None  # read, copied to the device and verified
    prepare_s: float | None = None  # loaded into the shadow weights
    pinned: bool | None = None  # read through page-locked mappings of the files
    shadow: bool | None = None  # held in the shadow weights
    in_place: bool | None = None  # read straight into the shadow's bytes
    open_s: float | None = None  # IPC: the trainer's handles opened (part of stage_s)
    opened: int | None = None  # IPC: storages opened for this version
    reused: int | None = None  # IPC: storages kept mapped from the last version
    verify_s: float | None = None  # the checksum verified after the copy (part of stage_s)
    #: IPC: a leased version opened, not copied: the swap copies it straight into the live
    #: weights (``WeightSyncSettings.ipc_direct``), under the replica's claim.
    direct: bool | None = None
    error: WorkerError | None = None

    def report(self) -> dict[str, Any]:
        """The timings and flags, for the update's report."""
        return {k: v for k, v in to_wire(self).items() if k not in ("state", "version", "error")}


class Swap(str, enum.Enum):
    """How a version went live in a worker (:attr:`SwapReport.swap`)."""

    SHADOW = "shadow"  # copied from the shadow weights
    LOAD = "load"  # loaded from the memmap or IPC copy staged in the worker
    DIRECT = "direct"  # copied from the trainer's leased tensors (IPC, ``ipc_direct``)
    BROADCAST = "broadcast"  # loaded from the broadcast's staging buffer
    OVERLAP = "overlap"  # exchanged part by part while it arrived
    REVERTED = "reverted"  # an overlapped swap, undone
    NONE = "none"  # nothing to do (an overlapped swap of a version not received in place)


class Progress(msgspec.Struct, kw_only=True):
    """Tokens generated so far by every request vLLM holds, taken inside a swap;
    ``complete``: a request missing from ``tokens`` had generated nothing yet."""

    tokens: dict[str, int]
    complete: bool


class SwapReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a worker's load or swap call did (``rollq_apply_staged``,
    ``rollq_swap_overlapped``, ``rollq_load_memmap``); times in seconds."""

    swap: Swap | None = None  # None: a memmap load at the swap (rollq_load_memmap)
    why: str | None = None  # an overlapped swap that did not happen, or was undone
    no_shadow: str | None = None  # why the shadow weights were not used
    load_s: float | None = None
    progress: Progress | None = None
    read_s: float | None = None
    copy_verify_s: float | None = None
    parts: int | None = None
    wait_parts_s: float | None = None  # until the last part was swapped in
    wait_commit_s: float | None = None
    receive_s: float | None = None
    kernel: str | None = None  # how the exchanges swapped bytes: triton | copies
    copied_by: str | None = None  # a direct swap: plan (a copy per tensor) | load_weights
    #: A direct swap's copies still ran when the call returned (``rollq_swap_done`` says when
    #: they ended); the replica's claim of the version lasts until then.
    pending: bool = False
    wait_copy_s: float | None = None  # the replica's wait for those copies after the call
    #: When the worker's call returned (``time.time()``; ``rollq_apply_staged``): with the
    #: time its caller got the answer, how long the answer took to come back.
    returned_at: float | None = None
    error: WorkerError | None = None


class SwapTimes(msgspec.Struct, kw_only=True):
    """When a worker's last swap from the shadow weights, or direct swap by a load plan, was
    enqueued and when its device copies finished (``time.time()``; ``done_at`` None while
    they run; ``rollq_swap_done``). ``version`` 0: no such swap yet. ``torn``: why a direct
    swap's copies may hold part of the version (the trainer stopped guaranteeing its tensors
    before they ended), set before ``done_at``. On a GPU, ``started_at``: when the device
    reached the copies (the work enqueued before them, such as the engine step in flight, was
    done), and ``device_s``: how long they ran there (CUDA timing events around them)."""

    version: int = 0
    enqueued_at: float = 0.0
    done_at: float | None = None
    torn: str | None = None
    started_at: float | None = None
    device_s: float | None = None


class MalformedReply(WeightSyncError):
    """A worker's answer to a call is not what the call returns (a worker of another rollq
    release, or an extension that is not rollq's)."""


def to_wire(s: msgspec.Struct) -> dict[str, Any]:
    """A struct as the plain map that crosses ``collective_rpc``."""
    out: dict[str, Any] = msgspec.to_builtins(s)
    return out


def from_wire(raw: Any, cls: type[T], what: str = "") -> T:
    """``raw`` (a worker's answer) validated into ``cls``; :class:`MalformedReply` when it is
    not one.

    >>> from_wire({"state": "staged", "version": 3}, StageStatus).state
    <State.STAGED: 'staged'>
    >>> from_wire({"state": 7}, StageStatus, "rollq_staged_status")
    Traceback (most recent call last):
    rollq.weightsync.wire.MalformedReply: a worker answered rollq_staged_status with "{'state': 7}": Expected `str`, got `int` - at `$.state`
    """
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        raise MalformedReply(f"a worker answered {what or cls.__name__} with {str(raw)[:200]!r}: {e}") from e
