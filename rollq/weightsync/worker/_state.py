"""What rollq keeps inside one vLLM worker: the one object behind the worker extension.

Runs inside each vLLM worker process. :class:`WorkerState` is the only attribute rollq sets
on vLLM's worker (``worker.rollq_state``, built on first use); the extension's RPC methods
(:mod:`rollq.weightsync.worker.ext`) are thin calls into it. It owns the shadow weights,
the broadcast receiver, memmap staging (:mod:`rollq.weightsync.worker._memmap`), IPC staging
(:mod:`rollq.weightsync.worker._ipc`), the
request-progress tracker (:mod:`rollq.weightsync.worker._progress`) and the worker lock.

Loading: on GPU workers ``model.load_weights`` (the checkpoint-format loader every vLLM model
has), run while the engine serves into shadow weights (:mod:`rollq.weightsync.worker._shadow`) where
memory allows, so the swap is one device copy; on the CPU backend, whose linear layers are
repacked at start-up, ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
at the swap.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

import msgspec
import torch

from ..wire import (
    FlatLayout,
    GroupInfo,
    IpcWatch,
    Listen,
    State,
    SwapTimes,
    WorkerError,
    WorkerStatus,
    manifest_digest,
)
from ..memmap import manifest_of
from ..process_group import responsive_gil
from ._direct_copy import DeviceCopies
from ._load_trace import signature_of

if TYPE_CHECKING:
    from ._ipc_watch import IpcWatcher
    from ._live_plan import LivePlan
    from ._receiver import WorkerReceiver
    from ._shadow import ShadowWeights
    from ..versions import TensorMeta

log = logging.getLogger(__name__)


class WorkerState:
    """rollq's state in one vLLM worker (``worker``: vLLM's worker object)."""

    def __init__(self, worker: Any):
        from ._ipc import IpcStaging
        from ._memmap import MemmapStaging
        from ._progress import RequestTracker

        self.worker = worker
        #: Held while the shadow weights or the memmap staging change (a broadcast receiver
        #: has its own lock for its buffer, always taken before this one).
        self.lock = threading.Lock()
        #: The policy version the live weights hold.
        self.version = 0
        #: The shadow weights (:meth:`ensure_shadow` builds them), and why there are none.
        self.shadow: ShadowWeights | None = None
        self.shadow_off: str | None = None
        #: Without shadow weights: the load plan a direct swap traced on the live weights.
        self.live_plan: LivePlan | None = None
        #: This worker's rank in the trainer's broadcast group, and its place there.
        self.receiver: WorkerReceiver | None = None
        self.join = WorkerStatus()
        self.memmap = MemmapStaging(self)
        self.ipc = IpcStaging(self)
        self.ipc_watcher: IpcWatcher | None = None
        self.tracker = RequestTracker()
        #: When the last swap was enqueued and its copies finished (``time.time()``).
        self.last_swap = SwapTimes()

    @property
    def device(self) -> torch.device:
        dev = getattr(self.worker, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    @property
    def model(self) -> Any:
        return self.worker.model_runner.model

    def load_live(self, items: Iterable[tuple[str, torch.Tensor]], *, trace: bool = False) -> None:
        """Load checkpoint-format ``items`` into the live weights (while generation stands).

        ``trace`` (a direct swap's load): without shadow weights, the first load of a manifest
        through ``load_weights`` records its load plan on the live weights (:attr:`live_plan`),
        by which the next direct swaps copy. vLLM's CPU backend reloads instead (it repacks
        the weights after loading them): nothing is traced there."""
        if self.shadow is not None:
            self.shadow.synced = False  # live weights change behind the shadow's back
        if self.device.type == "cpu" and hasattr(self.worker, "reload_weights"):
            self.worker.reload_weights(weights_iterator=iter(list(items)), is_checkpoint_format=True)
            return
        if trace and self.shadow is None:
            from ._live_plan import LivePlan

            items = list(items)
            if self.live_plan is None:
                self.live_plan = LivePlan(self.model)
            if self.live_plan.wants_trace(signature_of(manifest_of(items))):
                self.live_plan.load(items)
                return
        self.model.load_weights(weights=iter(items))

    # -- shadow weights ----------------------------------------------------------------------
    def ensure_shadow(self) -> ShadowWeights | None:
        """The shadow weights (built on first use), or None where they are not used.

        ``ROLLQ_SHADOW_WEIGHTS``: ``auto`` (default: on CUDA when memory allows), ``1``, ``0``.
        """
        if self.shadow_off is not None:
            return None
        if self.shadow is not None:
            return self.shadow
        from ._shadow import ShadowWeights, shadow_supported

        mode = _shadow_mode()
        why: str | None
        if mode == "off":
            why = "disabled by ROLLQ_SHADOW_WEIGHTS"
        elif mode == "auto" and self.device.type != "cuda":
            why = "not on a GPU (the CPU backend repacks its weights)"
        else:
            why = shadow_supported(self.model)
        if why is not None:
            self.shadow_off = why
            log.info("no shadow weights: %s; versions load during the swap", why)
            return None
        self.shadow = ShadowWeights(self.model)
        log.info("shadow weights: %.2f GB; new versions load while the engine serves", self.shadow.nbytes / 1e9)
        return self.shadow

    def drop_shadow(self, why: str) -> None:
        """No shadow weights from now on (versions load at the swap)."""
        self.shadow, self.shadow_off = None, why

    # -- what a broadcast receiver hands over (rollq.weightsync.worker._receiver.ReceiveSink) --------
    def load_while_receiving(self, version: int, items: Iterable[tuple[str, torch.Tensor]], stream: Any = None,
                             manifest: list[TensorMeta] | None = None,
                             check: Callable[[list[torch.Tensor] | None], None] | None = None) -> bool:
        """Load a version into the shadow weights (in a background thread, with the worker
        lock held); False when there is no shadow or it failed (the shadow is then dropped and
        the swap loads). With its ``manifest`` given, the load is traced once per manifest for
        a load plan (:mod:`rollq.weightsync.worker._shadow`): later versions are then written
        in place. ``check(views)`` runs after the load with the lock still held, ``views`` the
        shadow's bytes of each tensor by the plan (None without one); a check that raises
        leaves nothing to swap in and raises."""
        with self.lock:
            try:
                sh = self.ensure_shadow()
                if sh is None:
                    return False
                sh.load(items, version, stream, trace=manifest is not None and sh.wants_trace(manifest))
            except Exception as e:  # never lose the staged version over the shadow
                log.warning("loading version %d into the shadow weights failed (%s: %s); shadow disabled", version, type(e).__name__, e)
                self.drop_shadow(f"{type(e).__name__}: {e}")
                return False
            if check is not None:
                try:
                    check(sh.direct_views(manifest) if manifest is not None else None)
                except BaseException:
                    sh.invalidate()
                    raise
            return True

    def takes_direct(self, manifest: list[TensorMeta]) -> bool:
        """Whether a version of ``manifest`` can be copied straight into the live weights at
        the swap (``WeightSyncSettings.ipc_direct``): by a load plan, or through
        :meth:`load_live` (tracing the plan) where there are no shadow weights. A direct
        replica builds none unless ``ROLLQ_SHADOW_WEIGHTS=1`` (they would cost a copy of the
        weights only to trace the plan); one that has them (built for another transport's
        version, or forced) and no plan for this manifest says no: the version then loads
        into the shadow, which traces it. Call with :attr:`lock`."""
        sh = self.shadow if self.shadow is not None or _shadow_mode() != "on" else self.ensure_shadow()
        return sh is None or self.live_views(manifest) is not None

    def live_views(self, manifest: list[TensorMeta]) -> list[torch.Tensor | None] | None:
        """The live weights' bytes of each tensor of ``manifest`` by a load plan: the shadow's
        (:meth:`~rollq.weightsync.worker._shadow.ShadowWeights.live_views`), else the one
        traced on the live weights (:attr:`live_plan`); None without one."""
        views = self.shadow.live_views(manifest) if self.shadow is not None else None
        if views is None and self.live_plan is not None:
            views = self.live_plan.views(manifest)
        return views

    def wrote_live(self, manifest: list[TensorMeta]) -> None:
        """A version of ``manifest`` was just written into the live weights by
        :meth:`live_views` (see :meth:`~rollq.weightsync.worker._shadow.ShadowWeights.wrote_live`)."""
        if self.shadow is not None:
            self.shadow.wrote_live(signature_of(manifest))

    def invalidate(self) -> None:
        with self.lock:
            if self.shadow is not None:
                self.shadow.invalidate()

    def in_place_target(self, version: int, manifest: list[TensorMeta], stream: Any = None) -> DirectTarget | None:
        """Where to write ``version`` in place: the shadow weights' bytes by their load plan,
        with the worker lock held until :meth:`DirectTarget.done`; None when there is no
        shadow or no plan for this manifest (stage it and load it instead)."""
        self.lock.acquire()
        try:
            sh = self.ensure_shadow()
            views = sh.begin_direct(manifest, stream) if sh is not None else None
        except BaseException:
            self.lock.release()
            raise
        if views is None:
            self.lock.release()
            return None
        assert sh is not None
        return DirectTarget(sh, views, self.lock, sh.flat_offsets(manifest))

    def flat_layout(self, manifest: list[TensorMeta]) -> FlatLayout | None:
        """This worker's shadow layout for ``manifest`` (None without one)."""
        got = self.shadow.flat_offsets(manifest) if self.shadow is not None else None
        if got is None:
            return None
        return FlatLayout(sig=manifest_digest(list(manifest)), offsets=got[0], total=got[1])

    # -- the broadcast group -----------------------------------------------------------------
    def join_group(self, info: GroupInfo, rank_offset: int, listen: Listen | None) -> None:
        """Join ``info`` as rank ``rank_offset + worker.rank``, in a thread (the group forms
        only once every rank is there); :attr:`join` says how far it got. With ``listen``
        the receiver then follows offers itself (ack field ``listen.field + rank``)."""
        from ._receiver import WorkerReceiver

        local = int(getattr(self.worker, "rank", 0))
        rank = rank_offset + local
        self.leave_group()
        self.join = WorkerStatus(state=State.JOINING, group=info.id)

        def join() -> None:
            try:
                rcv = WorkerReceiver.join(info, rank, self.device, sink=self)
                self.receiver = rcv
                if listen is not None:
                    rcv.listen(msgspec.structs.replace(listen, field=f"{listen.field}{local}"))
                self.join = WorkerStatus(state=State.IDLE, group=info.id, joined=True, rank=rank)
            except Exception as e:
                self.join = WorkerStatus(state=State.FAILED, group=info.id, error=WorkerError.of(e))

        threading.Thread(target=join, name="rollq-join", daemon=True).start()

    def leave_group(self) -> None:
        """Stop following offers and drop the group (the staging buffer goes with it)."""
        rcv, self.receiver = self.receiver, None
        if rcv is not None:
            rcv.close()

    def receive_status(self) -> WorkerStatus:
        """The join and the last receive."""
        rcv = self.receiver
        if rcv is None:
            return self.join
        return msgspec.structs.replace(self.join, group=rcv.info.id, joined=True, receive=rcv.status)

    # -- IPC prestaging ----------------------------------------------------------------------
    def watch_ipc(self, watch: IpcWatch) -> None:
        """Start copying each version exposed over IPC when it is announced
        (:class:`~rollq.weightsync.worker._ipc_watch.IpcWatcher`; replaces a running watcher)."""
        from ._ipc_watch import IpcWatcher

        self.unwatch_ipc()
        self.ipc_watcher = IpcWatcher(self.ipc, watch, int(getattr(self.worker, "rank", 0))).start()

    def unwatch_ipc(self) -> None:
        w, self.ipc_watcher = self.ipc_watcher, None
        if w is not None:
            w.close()

    # -- swaps -------------------------------------------------------------------------------
    def watch_swap(self, version: int, event: Any, finish: Callable[[], str | None] | None = None) -> None:
        """Note (wall clock) when the swap's copies of ``version`` finished on the device
        (``event``: a CUDA event, or anything with its ``synchronize``; a
        :class:`~rollq.weightsync.worker._direct_copy.DeviceCopies` also gives when the device
        reached them and how long they ran); ``finish`` (a direct
        swap's :meth:`~rollq.weightsync.worker._direct_copy.PendingCopy.finish`) waits for them
        instead and says whether they were torn (``SwapTimes.torn``, set before ``done_at``).
        With an IPC watcher (:meth:`watch_ipc`), a direct swap's times are written to Redis
        for the follower once its copies ended
        (:meth:`~rollq.weightsync.worker._ipc_watch.IpcWatcher.report_swap`). The wait holds
        the short GIL switch interval, so that its thread, woken beside the engine's busy
        loop, notes the end without waiting up to 5 ms for the GIL."""
        rec = self.last_swap = SwapTimes(version=version, enqueued_at=time.time())
        watcher = self.ipc_watcher if finish is not None else None

        def wait() -> None:
            with responsive_gil():
                timed()
            if watcher is not None:
                watcher.report_swap(rec)

        def timed() -> None:
            try:
                if isinstance(event, DeviceCopies):  # timed: when the device reached them, how long they ran
                    event.wait_started()
                    rec.started_at = time.time()
                if finish is not None:
                    rec.torn = finish()
                else:
                    event.synchronize()  # blocks without the GIL: no polling beside the engine
                if isinstance(event, DeviceCopies):
                    rec.device_s = event.seconds()
            except Exception as e:  # the device failed the copies: they did not make the version
                log.exception("the swap's copies of version %d failed", version)
                rec.torn = f"the swap's copies of version {version} failed: {e}"[:1000]
            rec.done_at = time.time()

        threading.Thread(target=wait, name="rollq-swap-watch", daemon=True).start()


class DirectTarget:
    """A version being written into the shadow weights in place (the worker lock is held).

    ``views``: each tensor's bytes; ``flat`` / ``flat_offsets``: the shadow's flat buffer and
    each tensor's offset in it with the buffer's size (None when it is not laid out flat)."""

    def __init__(self, shadow: ShadowWeights, views: list[torch.Tensor], lock: Any, flat_offsets: Any = None):
        self.shadow, self.views, self._lock = shadow, views, lock
        self.flat_offsets = flat_offsets
        self.flat = shadow.flat if flat_offsets is not None else None

    def done(self, version: int, ok: bool) -> None:
        """All bytes are in (the caller waited for its copies), or the write failed."""
        try:
            if ok:
                self.shadow.end_direct(version)
            else:
                self.shadow.invalidate()
        finally:
            self._lock.release()


def _shadow_mode() -> str:
    """``ROLLQ_SHADOW_WEIGHTS`` as ``auto``, ``on`` or ``off``."""
    mode = os.environ.get("ROLLQ_SHADOW_WEIGHTS", "auto").lower()
    return "off" if mode in ("0", "off", "false", "no") else "on" if mode in ("1", "on", "true", "yes") else "auto"
