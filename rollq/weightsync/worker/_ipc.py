"""Worker side of the IPC transport: copying a version the trainer process exposes on this host.

Runs inside each vLLM worker process. :meth:`IpcStaging.stage` opens the handles
(:class:`~rollq.weightsync.ipc_wire.IpcHandles`), copies every tensor (device to device on a
GPU: straight into the shadow weights' bytes when they have a load plan for the manifest;
else ``load_weights`` reads them into the shadow, with no copy of the version beside it, which
traces the plan on a GPU; without a shadow, into new tensors), verifies the
trainer's checksum and checks that the trainer still exposes the version, all in a thread of
the worker while the engine serves; the swap then only swaps it in
(:func:`rollq.weightsync.worker._swap.apply_staged`). A leased version
(``IpcHandles.lease``) is not copied at all when the replica asked for direct swaps
(``WeightSyncSettings.ipc_direct``): the staging only opens it, and the swap copies the
trainer's tensors straight into the live weights (:meth:`IpcStaging.swap_direct`), under
the replica's claim, which the trainer's release waits for. The trainer's storages stay mapped
until the next version has been opened (:class:`~rollq.weightsync.worker._ipc_maps.MappedStorages`),
so a trainer that updates its tensors in place is opened once, not every version. Handles that cannot be opened, or a
trainer that exited or released the version before the copy ended, fail the staging with
:class:`~rollq.weightsync.ipc_wire.IpcUnavailable`; the live weights are never touched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, Callable, Iterable, Protocol

import torch

from ...errors import CorruptWeights
from ..checksum import state_checksum
from ..ipc_wire import IpcHandles, IpcStorage, IpcUnavailable, StorageKind, TornDirectSwap, decode_handles
from ..ipc_wire import token_alive as _token_alive
from ..layout import typed_views
from ..memmap import manifest_of
from ..process_group import responsive_gil
from ..versions import TensorMeta
from ..wire import StageStatus, State, WorkerError
from ._direct_copy import PendingCopy, copy_by_plan
from ._ipc_maps import MappedStorages

Items = list[tuple[str, torch.Tensor]]


class StagingHost(Protocol):
    """What IPC staging uses of its worker
    (:class:`~rollq.weightsync.worker._state.WorkerState` provides it)."""

    lock: Any  # threading.Lock: held while the shadow weights or a staged copy change

    @property
    def device(self) -> torch.device: ...

    def in_place_target(self, version: int, manifest: list[TensorMeta], stream: Any = None) -> Any:
        """Where to write ``version`` in the shadow's bytes (a ``DirectTarget``), or None."""

    def load_while_receiving(self, version: int, items: Iterable[tuple[str, torch.Tensor]], stream: Any = None,
                             manifest: list[TensorMeta] | None = None,
                             check: Callable[[list[torch.Tensor] | None], None] | None = None) -> bool:
        """Load ``items`` into the shadow weights and ``check`` the shadow's bytes by the load
        plan (None without one) under the worker lock; False without a shadow."""

    def takes_direct(self, manifest: list[TensorMeta]) -> bool:
        """Whether a version of ``manifest`` can be copied straight into the live weights."""

    def live_views(self, manifest: list[TensorMeta]) -> list[torch.Tensor | None] | None:
        """The live weights' bytes of each tensor by the load plan (None: load_live instead)."""

    def load_live(self, items: Iterable[tuple[str, torch.Tensor]], *, trace: bool = False) -> None:
        """Load ``items`` into the live weights (generation stands); ``trace``: record their
        load plan where there are no shadow weights."""

    def wrote_live(self, manifest: list[TensorMeta]) -> None:
        """A version was just written into the live weights by :meth:`live_views`."""


def _open_cpu(pid: int, s: IpcStorage, what: str) -> torch.UntypedStorage:
    """The trainer's shared-memory file ``s``, mapped here (its inode checked)."""
    path = f"/proc/{pid}/fd/{s.fd}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise IpcUnavailable(f"cannot open {what} ({path}: {e.strerror}): the trainer exited or released it") from e
    try:
        if os.fstat(fd).st_ino != s.inode:
            raise IpcUnavailable(f"{what} ({path}) is another file now: the trainer released it")
        return torch.UntypedStorage._new_shared_fd_cpu(fd, s.nbytes)
    finally:
        os.close(fd)


def _open_cuda(s: IpcStorage, device: torch.device) -> torch.UntypedStorage:
    own = str(torch.cuda.get_device_properties(device).uuid)
    if s.device_uuid != own:
        raise IpcUnavailable(f"the tensors are on GPU {s.device_uuid}; this worker is on {own}")
    try:
        return torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(), s.handle, s.nbytes, s.offset,
            s.ref_counter_handle, s.ref_counter_offset, s.event_handle, s.event_sync_required,
        )
    except RuntimeError as e:
        raise IpcUnavailable(f"cannot open a CUDA IPC handle ({e}): the trainer exited or freed it") from e


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class IpcStaging:
    """IPC copies of one worker (``state``: its :class:`~rollq.weightsync.worker._state.WorkerState`)."""

    def __init__(self, state: StagingHost):
        self.state = state
        self.status = StageStatus()
        #: ``(version, tensors)`` staged and not swapped in (tensors None: in the shadow
        #: weights); changed under the worker lock.
        self.staged: tuple[int, Items | None] | None = None
        #: Called with ``i`` before tensor ``i`` of a version is copied (in the staging
        #: thread): an observer, e.g. a test stopping the copy at a known point.
        self.before_copy: Callable[[int], None] | None = None
        #: The device is waited for after every this many bytes copied (0: never).
        self.chunk_bytes = 0
        self._since = 0  # bytes enqueued since the last wait
        self._open_s = self._verify_s = 0.0  # the last staging's parts
        self._dest: tuple[Any, Items] | None = None  # _typed's views and what they are for
        #: The trainer's storages kept mapped from the last version copied.
        self.maps = MappedStorages()
        self.keep_maps = True
        #: Copies run on a high-priority CUDA stream (``WeightSyncSettings.ipc_high_priority``).
        self.high_priority = False
        #: Leased versions are left to a direct swap (``WeightSyncSettings.ipc_direct``).
        self.direct = False
        #: The handles of the version :attr:`staged` holds for a direct swap (its tensors are
        #: the trainer's), else None.
        self.leased: IpcHandles | None = None
        #: The direct swap's copies by the load plan, made while staging (the swap then only
        #: enqueues them): live bytes and the trainer's bytes, tensor by tensor; None: none made.
        self.plan_copy: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._thread: threading.Thread | None = None
        self._starting = threading.RLock()  # the replica's call and the watcher's start one copy at a time
        #: Versions this worker started copying before the replica asked (the watcher's).
        self.prestaged = 0

    def stage(self, handles: bytes, version: int, chunk_bytes: int = 0, keep_maps: bool = True,
              high_priority: bool = False, direct: bool = False) -> StageStatus:
        """Start copying ``version`` from ``handles`` (a msgpack ``IpcHandles``) in a thread of
        this worker, on a GPU waiting for the device after every ``chunk_bytes`` copied or
        checksummed (0: never) and on a high-priority stream when ``high_priority``, keeping
        the trainer's storages mapped for the next version when ``keep_maps`` (:attr:`maps`),
        leaving a leased version to a direct swap when ``direct`` (only opened here);
        poll :attr:`status`."""
        with self._starting:
            if self._thread is not None and self._thread.is_alive():
                return StageStatus(state=State.BUSY, version=self.status.version)
            if self.staged is not None and self.staged[0] == version and self.status.state is State.STAGED:
                return self.status  # copied already (by the watcher): not again
            self.staged, self.leased, self.plan_copy = None, None, None  # free a previously staged copy first
            started = self.status = StageStatus(state=State.STAGING, version=version)
            self.chunk_bytes, self._since = max(0, int(chunk_bytes)), 0
            self.keep_maps = bool(keep_maps)
            self.high_priority = bool(high_priority)
            self.direct = bool(direct)
            self._thread = threading.Thread(target=self._stage, args=(handles, version), name="rollq-ipc-stage", daemon=True)
            self._thread.start()
            return started  # not self.status: the thread may have replaced it already

    def wait(self, timeout: float | None = None) -> None:
        """Until the copy under way (if any) has ended."""
        t = self._thread
        if t is not None:
            t.join(timeout)

    def prestage(self, handles: bytes, version: int, chunk_bytes: int = 0, keep_maps: bool = True,
                 high_priority: bool = False, direct: bool = False) -> bool:
        """:meth:`stage` ``version`` ahead of the replica's call, unless a copy is running or a
        staged one still waits for its swap (the replica then stages the newer version itself,
        after that swap). Returns whether it started."""
        with self._starting:
            if self.staged is not None or (self._thread is not None and self._thread.is_alive()):
                return False
            started = self.stage(handles, version, chunk_bytes, keep_maps, high_priority, direct).state is State.STAGING
            self.prestaged += started
            return started

    def _stage(self, raw: bytes, version: int) -> None:
        t0 = time.perf_counter()
        try:
            with responsive_gil():
                h = decode_handles(raw)
                if h.version != version:
                    raise IpcUnavailable(f"the trainer exposes version {h.version}, not {version}")
                if h.host != socket.gethostname():
                    raise IpcUnavailable(f"version {version} is exposed on host {h.host[:200]}, not on this one")
                if not _token_alive(h):
                    raise IpcUnavailable(f"trainer process {h.pid} exited or released version {version} before this worker opened it")
                t_open = time.perf_counter()
                srcs = self._open(h)
                self._open_s = time.perf_counter() - t_open
                staged = self._copy(h, srcs, t0)
                del srcs  # the views; the storages stay mapped in self.maps when kept
                if not self.keep_maps:
                    self.maps.clear()
                staged.opened, staged.reused = self.maps.opened, self.maps.reused
                self.status = staged
        except Exception as e:
            self.maps.clear()  # the next version opens everything afresh
            self.status = StageStatus(state=State.FAILED, version=version, error=WorkerError.of(e))

    def _open(self, h: IpcHandles) -> Items:
        """The trainer's tensors, mapped into this process (storages the last version mapped,
        and the tensors over them, are taken as they are: :attr:`maps`)."""
        dev = self.state.device

        def open_one(i: int, s: IpcStorage) -> torch.UntypedStorage:
            if s.kind is StorageKind.CUDA:
                if dev.type != "cuda":
                    raise IpcUnavailable("the trainer exposes CUDA tensors; this worker has no GPU")
                return _open_cuda(s, dev)
            return _open_cpu(h.pid, s, f"storage {i} of version {h.version}")

        if not self.keep_maps:
            self.maps.clear()

        def views(opened: list[torch.UntypedStorage]) -> Items:
            out: Items = []
            for t in h.tensors:
                s = opened[t.storage]
                dtype = getattr(torch, t.dtype)
                itemsize = torch.empty(0, dtype=dtype).element_size()
                src = torch.empty(0, dtype=dtype, device=s.device).set_(s, t.offset // itemsize, tuple(t.shape))
                out.append((t.name, src))
            return out

        got: Items = self.maps.tensors(h, open_one, views)
        return got

    def _check(self, h: IpcHandles, items: Items, stream: Any = None) -> None:
        """After the copy (enqueued on ``stream``, or already done): the trainer still exposes
        the version, and the bytes are its.

        The checksum runs eagerly, never as a captured CUDA graph: this thread runs while the
        engine steps, and a capture here killed vLLM 0.26's engine on an H100
        (``cudaErrorCapturedEvent`` in its next input copy, the 17th capture of a run). A
        publisher's own snapshot (``ipc_snapshot``) needs no checksum at all."""
        if h.owned and stream is not None:
            stream.synchronize()  # the copy's end, before the token is looked at
        t0 = time.perf_counter()
        try:
            self._verify(h, items)
        finally:
            self._verify_s = time.perf_counter() - t0

    def _verify(self, h: IpcHandles, items: Items) -> None:
        if not _token_alive(h):
            raise IpcUnavailable(f"trainer process {h.pid} exited or released version {h.version} during the copy")
        if h.owned:
            # The publisher's own snapshot changes only after it released the version: a copy
            # that ended with the token still alive has the version's bytes.
            return
        if state_checksum(items, self.chunk_bytes) != h.checksum:
            raise CorruptWeights(f"version {h.version}: the exposed tensors changed before this worker copied them (checksum mismatch)")

    def _copy(self, h: IpcHandles, srcs: Items, t0: float) -> StageStatus:
        st, version = self.state, h.version
        dev = st.device
        # The views over kept mappings are the same every version: so are their manifest and
        # the direct swap's copies (a thousand tensor calls, each waiting for the engine's GIL).
        manifest = self.maps.derived(srcs, "manifest", None, lambda: manifest_of(srcs))
        if self.direct and h.lease:
            with st.lock:
                views = st.live_views(manifest)
                if views is not None or st.takes_direct(manifest):  # the swap copies them (swap_direct)
                    self.staged, self.leased = (version, srcs), h
                    self.plan_copy = None if views is None else self.maps.derived(
                        srcs, "plan_copy", tuple(map(id, views)), lambda: self._plan_copy(srcs, views))
                    return StageStatus(state=State.STAGED, version=version, stage_s=time.perf_counter() - t0,
                                       prepare_s=0.0, shadow=False, direct=True, open_s=self._open_s)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            # Off the engine's stream; a negative priority is above the engine's (0).
            stream: Any = torch.cuda.Stream(dev, priority=-1 if self.high_priority else 0)
            target = st.in_place_target(version, manifest, stream)
            if target is not None:  # straight into the shadow's bytes
                try:
                    with torch.cuda.stream(stream):
                        dest = self._typed(manifest, target.views)
                        if self.before_copy is None and self.chunk_bytes <= 0:
                            # one call for every tensor (device-to-device, C++ loops): not
                            # hundreds of Python calls, each waiting for the engine's GIL
                            torch._foreach_copy_([t for _, t in dest], [t for _, t in srcs], non_blocking=True)
                        else:
                            for i, ((_, src), (_, view)) in enumerate(zip(srcs, dest)):
                                self._before(i)
                                view.copy_(src, non_blocking=True)
                                self._pace(stream, view.numel() * view.element_size())
                        # The shadow's bytes are the trainer's checksum, or the trainer changed
                        # them during the copy.
                        self._check(h, dest, stream)
                except BaseException:
                    target.done(version, False)
                    raise
                target.done(version, True)
                with st.lock:
                    self.staged = (version, None)
                return StageStatus(state=State.STAGED, version=version, stage_s=time.perf_counter() - t0, prepare_s=0.0,
                                   shadow=True, in_place=True, open_s=self._open_s, verify_s=self._verify_s)
        else:
            stream = None
        # No load plan for this manifest yet (its first version), or no in-place writes on
        # this device: load_weights fills the shadow straight from the trainer's tensors, with
        # no copy of the version beside it, and the check runs on what the shadow received.
        if st.load_while_receiving(version, self._fed(srcs, stream), stream, manifest,
                                   check=lambda views: self._check_loaded(h, srcs, manifest, views, stream)):
            with st.lock:
                self.staged = (version, None)
            return StageStatus(state=State.STAGED, version=version, stage_s=time.perf_counter() - t0, prepare_s=0.0,
                               shadow=True, open_s=self._open_s, verify_s=self._verify_s)
        # No shadow: new tensors, loaded into the live weights at the swap.
        if stream is not None:
            with torch.cuda.stream(stream):
                items = []
                for i, (n, src) in enumerate(srcs):
                    items.append((n, self._copy_one(i, src)))
                    self._pace(stream, src.numel() * src.element_size())
                stream.synchronize()
        else:
            items = [(n, self._copy_one(i, src)) for i, (n, src) in enumerate(srcs)]
        self._check(h, items)
        with st.lock:
            self.staged = (version, items)
        return StageStatus(state=State.STAGED, version=version, stage_s=time.perf_counter() - t0, prepare_s=0.0,
                           shadow=False, open_s=self._open_s, verify_s=self._verify_s)

    def swap_direct(self, version: int) -> tuple[str, PendingCopy | None] | None:
        """Copy leased ``version`` from the trainer's tensors straight into the live weights
        (inside the swap: the worker lock held, generation stopped). How, and what is still
        to end:

        - ``("plan", pending)``: one copy per tensor by a load plan, enqueued on the current
          stream and not waited for (:func:`~rollq.weightsync.worker._direct_copy.copy_by_plan`);
          ``pending`` says when the copies end and whether the version was torn meanwhile.
          The replica's claim must last until then.
        - ``("load_weights", None)``: no plan (the first version of a manifest without shadow
          weights, which traces the plan on the live weights; vLLM's CPU backend), loaded and
          waited for here.

        None when :attr:`staged` holds no leased version ``version``. The replica claimed the
        version, so the trainer changes none of its tensors before its copies end.

        Raises IpcUnavailable when the trainer exited or released the version before the
        copy (the live weights untouched), TornDirectSwap when a copy waited for here read
        tensors the trainer stopped guaranteeing (:meth:`_torn`)."""
        staged, h = self.staged, self.leased
        if staged is None or h is None or staged[0] != version or staged[1] is None:  # leased goes with staged
            return None
        items, plan = staged[1], self.plan_copy
        self.staged, self.leased, self.plan_copy = None, None, None
        if not _token_alive(h):
            raise IpcUnavailable(f"trainer process {h.pid} exited or released version {version} before the direct swap")
        st, dev = self.state, self.state.device
        manifest = self.maps.derived(items, "manifest", None, lambda: manifest_of(items))  # the staging's
        if plan is None:  # not made while staging (a plan traced since): made now
            plan = self._plan_copy(items, st.live_views(manifest))
        with torch.no_grad():
            if plan is not None:  # by the load plan: one device copy per tensor, not waited for
                end = copy_by_plan(plan[0], plan[1], dev)
                st.wrote_live(manifest)
                return "plan", PendingCopy(end, lambda: self._torn(h), keep=(items, plan))
            st.load_live(items, trace=True)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
        torn = self._torn(h)
        if torn is not None:
            raise TornDirectSwap(torn)
        return "load_weights", None

    @staticmethod
    def _torn(h: IpcHandles) -> str | None:
        """After a direct swap's copies of ``h`` ended: why they may hold part of the version,
        or None. CUDA memory of an exited trainer is undefined; a live trainer that dropped
        the token released the version (the replica's claim was lost) and may have changed
        the tensors. Shared-memory files of an exited trainer stay mapped here, unchanged:
        that copy holds."""
        if _token_alive(h) or not (any(s.kind is StorageKind.CUDA for s in h.storages) or _process_alive(h.pid)):
            return None
        return (f"trainer process {h.pid} exited or released version {h.version} during its direct swap: "
                "the live weights may hold part of it")

    @staticmethod
    def _plan_copy(items: Items, views: list[torch.Tensor | None] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The copies of ``items`` into the live bytes ``views`` (None: no load plan)."""
        if views is None:
            return None
        pairs = [(v, src.reshape(-1).view(torch.uint8)) for (_, src), v in zip(items, views) if v is not None]
        return [d for d, _ in pairs], [s for _, s in pairs]

    def _fed(self, srcs: Items, stream: Any) -> Iterable[tuple[str, torch.Tensor]]:
        """``srcs`` as ``load_weights`` reads them, with :attr:`before_copy` before each
        tensor and the device waited for every :attr:`chunk_bytes`."""
        for i, (n, src) in enumerate(srcs):
            self._before(i)
            yield n, src
            self._pace(stream, src.numel() * src.element_size())

    def _check_loaded(self, h: IpcHandles, srcs: Items, manifest: list[TensorMeta], views: list[torch.Tensor] | None,
                      stream: Any) -> None:
        """:meth:`_check` of a version loaded into the shadow: its bytes there where the load
        plan says each tensor landed; without a plan (a loader that transforms them), the
        trainer's tensors after the load, which a trainer that stepped meanwhile changed."""
        items = srcs if views is None else self._typed(manifest, views)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._check(h, items, stream)

    def _typed(self, manifest: list[TensorMeta], views: list[torch.Tensor]) -> Items:
        """``views`` (raw shadow bytes) typed as ``manifest`` says, made once per set of views
        (the shadow's direct views are the same bytes every version: keyed by their addresses)."""
        key = (tuple((v.data_ptr(), v.numel()) for v in views), tuple((m.name, m.dtype, tuple(m.shape)) for m in manifest))
        if self._dest is None or self._dest[0] != key:
            self._dest = (key, typed_views(manifest, views))
        return self._dest[1]

    def _copy_one(self, i: int, src: torch.Tensor) -> torch.Tensor:
        """Tensor ``i`` copied onto this worker's device (from the trainer's device or memory)."""
        self._before(i)
        out = torch.empty(src.shape, dtype=src.dtype, device=self.state.device)
        out.copy_(src, non_blocking=True)
        return out

    def _pace(self, stream: Any, nbytes: int) -> None:
        """Wait for ``stream`` once ``chunk_bytes`` were enqueued since the last wait (the
        GIL is released meanwhile and the engine's kernels run between the parts)."""
        if self.chunk_bytes <= 0:
            return
        self._since += nbytes
        if self._since >= self.chunk_bytes:
            stream.synchronize()
            self._since = 0

    def _before(self, i: int) -> None:
        hook = self.before_copy
        if hook is not None:
            hook(i)
