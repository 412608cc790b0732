"""Worker side of the broadcast: a rank of the trainer's group that receives versions.

Runs inside each vLLM worker process, in threads of its own (never in an engine RPC, which
would hold the engine's step loop): an :class:`~rollq.weightsync.worker._listener.OfferListener`
follows the offers and calls :meth:`WorkerReceiver.receive` for each new one while the engine
keeps generating. What the received bytes go into is the worker's business, behind a
:class:`ReceiveSink` (:class:`~rollq.weightsync.worker._state.WorkerState`).

A version is received one of four ways, decided per offer:

- **in place, flat** (``layout`` offer, the worker's shadow weights laid out as the offer
  says): each bucket straight into the shadow's flat buffer;
- **in place, per tensor** (``direct`` offer, a load plan for the manifest): each tensor
  group into the shadow bytes the plan loads it to;
- **staged, per tensor** (``direct`` offer otherwise): each tensor group into its view of a
  staging buffer, handed to the sink as soon as it is enqueued, so loading overlaps the
  transfer;
- **staged, buckets** (``packed`` offers, and ``layout`` offers whose layout this worker
  does not share): the buckets into the staging buffer, then handed to the sink.

In place, nothing is left to load at the swap, and the receive is watched part by part
(:class:`ReceiveProgress`) so that a swap can go live while the last parts arrive.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ...errors import WeightSyncError
from ...protocol import Control, parse_control
from ..base import InPlaceTarget, ReceiveSink
from ..checksum import state_checksum
from ..layout import Layout, groups_of, typed_views
from ..process_group import Group, make_group, responsive_gil, wait_stream
from ..versions import TensorMeta
from ..wire import (
    GroupInfo,
    Listen,
    Mode,
    Offer,
    ReceiveStatus,
    State,
    WorkerError,
)

log = logging.getLogger(__name__)

Items = list[tuple[str, torch.Tensor]]


class ReceiveProgress:
    """An in-place receive, part by part (a bucket or a coalesced group of tensors).

    ``part_of[j]``: the part holding the last bytes of manifest tensor ``j``. ``parts``
    grows as parts are enqueued, each with a CUDA event recorded after it (None on CPU,
    where a part is received when it is listed). The overlapped swap
    (:mod:`rollq.weightsync.worker._swap`) swaps each part's parameters in as soon as the
    part is complete, stream-ordered after its event.
    """

    def __init__(self, version: int, manifest: list[TensorMeta], part_of: list[int], cond: threading.Condition):
        self.version, self.manifest, self.part_of = version, manifest, part_of
        self.parts: list[Any] = []
        self.state = State.RECEIVING  # then STAGED or FAILED
        self._cond = cond

    @classmethod
    def of(cls, offer: Offer, layout: Layout, groups: list[tuple[int, int]], cond: threading.Condition) -> ReceiveProgress:
        if offer.mode is Mode.LAYOUT:
            ends = [e for _, e in layout.buckets]
            part_of = [bisect.bisect_left(ends, off + m.nbytes) for m, off in zip(offer.manifest, layout.offsets)]
        else:
            part_of = [k for k, (lo, hi) in enumerate(groups) for _ in range(lo, hi)]
        return cls(offer.version, offer.manifest, part_of, cond)

    def add(self, event: Any) -> None:
        with self._cond:
            self.parts.append(event)
            self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        with self._cond:
            self.state = State.STAGED if ok else State.FAILED
            self._cond.notify_all()

    def wait_part(self, k: int, timeout: float) -> tuple[bool, Any]:
        """``(True, event)`` once part ``k`` is enqueued; ``(False, None)`` if the receive
        failed first or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.parts) > k or self.state is State.FAILED, timeout)
            if len(self.parts) > k and self.state is not State.FAILED:
                return True, self.parts[k]
            return False, None

    def wait_done(self, timeout: float) -> bool:
        """Whether every byte arrived (the receive ended well) within ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self.state is not State.RECEIVING, timeout)
            return self.state is State.STAGED


@dataclass
class _Receipt:
    """One offer's receive while it runs."""

    offer: Offer
    stream: Any  # the CUDA stream it runs on (None on CPU)
    t0: float
    layout: Layout | None = None
    groups: list[tuple[int, int]] = field(default_factory=list)
    target: InPlaceTarget | None = None
    progress: ReceiveProgress | None = None
    #: In place: the typed views to verify. Staged: the staged tensors.
    items: Items = field(default_factory=list)
    loaded: bool = False  # the sink loaded it as it arrived
    error: BaseException | None = None  # the transfer failed (even if a sink swallowed it)
    times: dict[str, float] = field(default_factory=dict)


class WorkerReceiver:
    """A rank of the trainer's broadcast group; receives versions into the worker's shadow
    weights or a persistent staging buffer (tensors are views into it: no unpacking copy).

    ``group`` is the formed group (:meth:`join` forms it; tests hand in a scripted one).
    """

    def __init__(self, info: GroupInfo, rank: int, device: torch.device, group: Group, sink: ReceiveSink | None = None):
        self.info, self.rank, self.device = info, rank, device
        self.pg = group
        self.sink = sink
        self.flat: torch.Tensor | None = None  # the staging buffer
        #: ``(version, tensors)`` received and not swapped in; tensors None: in the shadow.
        self.staged: tuple[int, Items | None] | None = None
        self.status = ReceiveStatus()
        #: Held while receiving into, or swapping from, the staging buffer.
        self.lock = threading.Lock()
        #: The in-place receive in progress or last done (see :class:`ReceiveProgress`).
        self.progress: ReceiveProgress | None = None
        #: Newest version seen committed (``version <v>`` announcements; the record is the truth).
        self.committed = 0
        self._events = threading.Condition()
        self._decided = 0  # newest version whose receive started (in place or staged)
        self._abandoned = 0  # a version whose receive must fail even if its kernels end
        self.closed = threading.Event()
        self._listener: Any = None

    @classmethod
    def join(cls, info: GroupInfo, rank: int, device: torch.device, sink: ReceiveSink | None = None) -> WorkerReceiver:
        """Join the group as ``rank``; returns once every rank is there (``info.timeout``)."""
        group = make_group(info, rank, device)
        group.prove(device, info.timeout)
        return cls(info, rank, device, group, sink)

    # -- following offers ------------------------------------------------------------------
    def listen(self, listen: Listen) -> None:
        """Follow offers in a daemon thread."""
        from ._listener import OfferListener

        self._listener = OfferListener(self, listen)
        self._listener.start()

    def close(self) -> None:
        """Stop following offers (a newer group replaced this one); the group is aborted."""
        self.closed.set()
        self.pg.abort()
        with self._events:
            self._events.notify_all()

    def abandon(self, version: int) -> None:
        """Give up the receive of ``version``: the group is aborted (its pending kernels end,
        so nothing queued behind them waits for NCCL's own timeout) and the receive fails."""
        self._abandoned = version
        self.pg.abort()

    # -- what a swap overlapped with the receive waits for ---------------------------------
    def on_control(self, text: str) -> None:
        """A control message: ``version <v>`` says ``v`` was committed."""
        verb, arg = parse_control(text)
        if verb is Control.VERSION:
            try:
                v = int(arg.split()[0])
            except (ValueError, IndexError):
                return
            with self._events:
                if v > self.committed:
                    self.committed = v
                    self._events.notify_all()

    def progress_for(self, version: int, timeout: float) -> ReceiveProgress | None:
        """The in-place receive of ``version``, waiting up to ``timeout`` for it to start;
        None when it does not (not offered yet, or staged instead of in place)."""
        with self._events:
            self._events.wait_for(lambda: self.closed.is_set() or self._decided >= version, timeout)
            p = self.progress
        return p if p is not None and p.version == version else None

    def wait_committed(self, version: int, timeout: float) -> bool:
        """Whether ``version`` is committed within ``timeout``: its announcement, or else the
        version record (read every 20 ms: the announcement is only a hint)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._events:
                self._events.wait_for(lambda: self.committed >= version or self.closed.is_set(),
                                      max(0.0, min(0.02, deadline - time.monotonic())))
                if self.committed >= version:
                    return self.committed == version or self._recorded() == version
            rec = self._recorded()
            if rec >= version:
                return rec == version
            if time.monotonic() >= deadline or self.closed.is_set():
                return False

    def _recorded(self) -> int:
        """The committed version in Redis (0: unknown)."""
        return self._listener.recorded() if self._listener is not None else 0

    # -- receiving ----------------------------------------------------------------------
    def receive(self, offer: Offer) -> None:
        """Receive ``offer`` (blocking, bounded by its timeouts); the outcome is :attr:`status`."""
        with self.lock, responsive_gil():
            self._receive(offer)

    def _receive(self, offer: Offer) -> None:
        self.status = ReceiveStatus(state=State.RECEIVING, version=offer.version)
        self.staged = None
        cuda = self.device.type == "cuda"
        r = _Receipt(offer, torch.cuda.Stream(self.device) if cuda else None, time.perf_counter())  # off the engine's stream
        try:
            with torch.cuda.stream(r.stream) if cuda else contextlib.nullcontext():
                self._start(r)
                if r.target is not None:
                    self._in_place(r)
                else:
                    self._staged(r)
                self._complete(r)
            self._succeeded(r)
        except Exception as e:
            self._failed(r, e)

    def _start(self, r: _Receipt) -> None:
        """Lay the offer out and decide between in place and staged (a swap waiting for this
        version learns which as soon as it is decided)."""
        offer, cuda = r.offer, r.stream is not None
        r.layout = (Layout.explicit(offer.offsets, offer.total, offer.bucket_bytes) if offer.mode is Mode.LAYOUT
                    else Layout.of(offer.manifest, offer.bucket_bytes))
        r.groups = groups_of(offer.manifest, offer.group_bytes if cuda else 0)
        if offer.mode in (Mode.DIRECT, Mode.LAYOUT) and self.sink is not None:
            r.target = self.sink.in_place_target(offer.version, offer.manifest, r.stream)
            if offer.mode is Mode.LAYOUT and r.target is not None and (
                r.target.flat is None or r.target.flat_offsets != (offer.offsets, offer.total)
            ):
                r.target.done(offer.version, False)  # our shadow is laid out otherwise: stage
                r.target = None
        with self._events:
            self.progress = ReceiveProgress.of(offer, r.layout, r.groups, self._events) if r.target is not None else None
            self._decided = offer.version
            self._events.notify_all()
        r.progress = self.progress

    def _in_place(self, r: _Receipt) -> None:
        """Each tensor lands in the bytes the shadow weights load it to."""
        assert r.target is not None and r.progress is not None and r.layout is not None
        offer, target = r.offer, r.target
        self.flat = None  # the staging buffer is not needed any more
        r.times["setup_s"] = time.perf_counter() - r.t0
        if offer.mode is Mode.LAYOUT:  # straight into the flat shadow, bucket by bucket
            assert target.flat is not None
            for s, e in r.layout.buckets:
                self.pg.broadcast(target.flat[s:e], offer.timeout)
                r.progress.add(self._event(r))
        else:
            for lo, hi in r.groups:
                self._recv_group(offer, target.views[lo:hi])
                r.progress.add(self._event(r))
        # typed views only to checksum them (each tensor call gives the GIL away)
        r.items = typed_views(offer.manifest, target.views) if offer.verify else []

    def _staged(self, r: _Receipt) -> None:
        """Into the staging buffer, one view per tensor; the sink loads them as they come."""
        assert r.layout is not None
        offer, layout = r.offer, r.layout
        if self.flat is None or self.flat.numel() < layout.total:
            self.flat = None  # free the old buffer before allocating the larger one
            self.flat = torch.empty(layout.total, dtype=torch.uint8, device=self.device)
        r.items = layout.views(self.flat, offer.manifest)
        r.times["setup_s"] = time.perf_counter() - r.t0
        if offer.mode is Mode.DIRECT:
            dests = [self.flat[off : off + m.nbytes] for m, off in zip(offer.manifest, layout.offsets)]
            received: Iterator[tuple[str, torch.Tensor]] = self._per_group(r, dests)
        else:
            for s, e in layout.buckets:
                self.pg.broadcast(self.flat[s:e], offer.timeout)
            received = iter(r.items)
        if self.sink is not None:
            # Each tensor is loaded as soon as its broadcast is enqueued (stream-ordered after
            # it), so loading overlaps the transfer, in this thread (a loader thread of its
            # own would compete for the GIL).
            self._feed(r, received)
        else:
            for _ in received:
                pass

    def _per_group(self, r: _Receipt, dests: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """One broadcast per tensor into ``dests``, by coalesced groups, yielding each
        tensor's view once its group is enqueued. A failed transfer is kept in ``r.error``:
        a sink that catches it does not make the receive look complete."""
        try:
            for lo, hi in r.groups:
                self._recv_group(r.offer, dests[lo:hi])
                yield from r.items[lo:hi]
        except Exception as e:
            r.error = e
            raise

    def _recv_group(self, offer: Offer, bufs: list[torch.Tensor]) -> None:
        """One group of a ``direct`` offer's tensors (a coalesced NCCL group when the offer
        says so); on NCCL, what the caller enqueues next on its stream sees the data."""
        work = self.pg.broadcast_many(bufs, offer.timeout, coalesce=offer.group_bytes > 0)
        if work is not None:
            work.wait()  # stream-level

    def _feed(self, r: _Receipt, received: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand the received tensors to the sink; whatever it leaves (it failed or stopped
        early) is still received, since every rank must take part in every broadcast."""
        assert self.sink is not None
        version = r.offer.version
        try:
            r.loaded = bool(self.sink.load_while_receiving(version, received, r.stream, r.offer.manifest))
        except Exception as e:
            log.warning("loading version %d while receiving failed (%s: %s); it loads at the swap", version, type(e).__name__, e)
            self.sink.invalidate()
        for _ in received:  # drain: the rest of the broadcasts
            pass
        if r.error is not None:
            raise r.error

    @staticmethod
    def _event(r: _Receipt) -> Any:
        """A CUDA event after the work enqueued so far on the receive stream (None on CPU)."""
        if r.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(r.stream)
        return ev

    def _complete(self, r: _Receipt) -> None:
        """Wait (bounded) for every byte, then verify when the offer carries a checksum."""
        offer = r.offer
        r.times["enqueued_s"] = time.perf_counter() - r.t0
        if r.stream is not None:
            wait_stream(self.device, offer.timeout * 2, f"receiving version {offer.version}")
        if self._abandoned == offer.version:  # aborted mid-way: whatever arrived is not it
            raise WeightSyncError(f"receive of version {offer.version} abandoned (group aborted)")
        r.times["receive_s"] = time.perf_counter() - r.t0
        if offer.verify:
            got = state_checksum(r.items)  # on the receive stream, one host sync
            r.times["verify_s"] = time.perf_counter() - r.t0 - r.times["receive_s"]
            if got != offer.checksum:
                raise WeightSyncError(f"staged version {offer.version} has checksum {got}, expected {offer.checksum}")

    def _succeeded(self, r: _Receipt) -> None:
        version = r.offer.version
        if r.target is not None:
            r.target.done(version, True)
            r.target = None
            self.staged = (version, None)  # in the shadow weights, not in a buffer here
        else:
            self.staged = (version, r.items)
        t = r.times
        self.status = ReceiveStatus(state=State.STAGED, version=version, loaded_while_receiving=r.loaded,
                                    in_place=self.staged[1] is None, receive_s=t.get("receive_s", 0.0),
                                    verify_s=t.get("verify_s", 0.0), setup_s=t.get("setup_s", 0.0),
                                    enqueued_s=t.get("enqueued_s", 0.0))
        if r.progress is not None:
            r.progress.finish(True)

    def _failed(self, r: _Receipt, e: Exception) -> None:
        version = r.offer.version
        self.staged = None
        with self._events:
            self._decided = max(self._decided, version)
            self._events.notify_all()
        if self.progress is not None and self.progress.version == version:
            self.progress.finish(False)
        if r.target is not None:
            r.target.done(version, False)
        elif r.loaded and self.sink is not None:
            self.sink.invalidate()
        self.status = ReceiveStatus(state=State.FAILED, version=version, error=WorkerError.of(e))
        log.error("receiving version %d failed: %s", version, e)

    def take(self, version: int) -> Items:
        """The staged tensors of ``version`` (to load at the swap)."""
        if self.staged is None or self.staged[0] != version:
            raise WeightSyncError(f"version {version} is not staged here (staged: {self.staged[0] if self.staged else None})")
        if self.staged[1] is None:
            raise WeightSyncError(f"version {version} was received into the shadow weights, which no longer hold it")
        return self.staged[1]
