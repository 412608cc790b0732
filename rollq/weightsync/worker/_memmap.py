"""Worker side of memmap versions: reading a committed slot into the worker.

Runs inside each vLLM worker process. :meth:`MemmapStaging.stage` reads a version, copies it
to the device and verifies it in a thread of the worker while the engine keeps serving (an
RPC that did the work itself would hold the engine's step loop); the swap then only swaps it
in (:func:`rollq.weightsync.worker._swap.apply_staged`). :meth:`MemmapStaging.load` does it all
at once, inside the RPC. A stored version that is corrupt or otherwise refused comes back as
a :class:`~rollq.weightsync.wire.WorkerError` value, raised again on the replica as its type.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ...errors import CorruptWeights, WeightSyncError
from ..checksum import state_checksum
from ..memmap import MemmapStore, manifest_of
from ..process_group import responsive_gil
from ..wire import StageStatus, State, SwapReport, WorkerError

if TYPE_CHECKING:
    from ..base import InPlaceTarget, StagingHost

Items = list[tuple[str, torch.Tensor]]


class MemmapStaging:
    """Memmap reads of one worker (``state``: its :class:`~rollq.weightsync.worker._state.WorkerState`)."""

    def __init__(self, state: StagingHost):
        self.state = state
        self.status = StageStatus()
        #: ``(version, tensors)`` staged and not swapped in (tensors None: in the shadow
        #: weights); changed under the worker lock.
        self.staged: tuple[int, Items | None] | None = None
        self._thread: threading.Thread | None = None

    def load(self, root: str, slot: str, version: int, checksum: str, verify: bool = True) -> SwapReport:
        """Load committed ``version`` from a memmap slot into the live weights now.

        On a GPU the tensors are copied to the device first and verified there (the checksum
        runs at memory bandwidth); on CPU they are verified in place.
        """
        st = self.state
        dev = st.device
        t0 = time.perf_counter()
        try:
            items = MemmapStore(root).read(slot, version=version, checksum=checksum, verify=verify and dev.type != "cuda")
            t1 = time.perf_counter()
            if dev.type == "cuda":
                items = [(n, t.to(dev, non_blocking=True)) for n, t in items]
                torch.cuda.synchronize(dev)
                if verify and state_checksum(items) != checksum:
                    raise CorruptWeights(f"version {version} in {slot}: checksum mismatch after copying to {dev}")
        except WeightSyncError as e:  # refused data: an answer, not a failed call
            return SwapReport(error=WorkerError.of(e))
        t2 = time.perf_counter()
        st.load_live(items)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t3 = time.perf_counter()
        st.version = version
        return SwapReport(read_s=t1 - t0, copy_verify_s=t2 - t1, load_s=t3 - t2, progress=st.tracker.report(st.worker))

    def stage(self, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int = 3) -> StageStatus:
        """Start staging ``version`` in a thread of this worker; poll :attr:`status`."""
        if self._thread is not None and self._thread.is_alive():
            return StageStatus(state=State.BUSY, version=self.status.version)
        self.staged = None  # free a previously staged copy first
        self.status = StageStatus(state=State.STAGING, version=version)
        self._thread = threading.Thread(
            target=self._stage, args=(root, slot, version, checksum, chunks_in_flight), name="rollq-stage", daemon=True
        )
        self._thread.start()
        return self.status

    def _stage(self, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int) -> None:
        t0 = time.perf_counter()
        try:
            with responsive_gil():
                store = MemmapStore(root, chunks_in_flight=chunks_in_flight)
                if self.state.device.type == "cuda":
                    got = self._to_device(store, slot, version, checksum)
                    if got is None:
                        self.status = StageStatus(state=State.STAGED, version=version, stage_s=time.perf_counter() - t0,
                                                  prepare_s=0.0, pinned=True, shadow=True, in_place=True)
                        return
                    items, pinned, stream = got
                else:
                    items, pinned, stream = store.read(slot, version=version, checksum=checksum, verify=True), False, None
                t1 = time.perf_counter()
                shadowed = self.state.load_while_receiving(version, items, stream, manifest_of(items))
                with self.state.lock:
                    self.staged = (version, None if shadowed else items)  # in the shadow: free the copy
                del items
                self.status = StageStatus(state=State.STAGED, version=version, stage_s=t1 - t0,
                                          prepare_s=time.perf_counter() - t1, pinned=pinned, shadow=shadowed)
        except Exception as e:
            self.status = StageStatus(state=State.FAILED, version=version, error=WorkerError.of(e))

    def _to_device(self, store: MemmapStore, slot: str, version: int, checksum: str) -> tuple[Items, bool, Any] | None:
        """Read ``version`` onto the GPU, on a stream of its own: straight into the shadow
        weights' bytes when they have a plan for its manifest (then None: nothing is left to
        load), else ``(tensors, read through page-locked mappings, stream)``."""
        st = self.state
        dev = st.device
        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)  # off the engine's stream
        target: InPlaceTarget | None = None

        def into(manifest: Any) -> Any:  # straight into the shadow when it has a plan
            nonlocal target
            target = st.in_place_target(version, manifest, stream)
            return target.views if target is not None else None

        # Page-locked mappings of the files: the copy engine reads them directly.
        try:
            items = store.read_to_device(slot, version=version, checksum=checksum, device=dev, stream=stream, into=into)
        except BaseException:
            if target is not None:
                target.done(version, False)
            raise
        if target is not None:
            target.done(version, True)
            with st.lock:
                self.staged = (version, None)
            return None
        if items is not None:
            return items, True, stream
        items = store.read(slot, version=version, checksum=checksum, verify=False)
        with torch.cuda.stream(stream):
            items = [(n, t.to(dev, non_blocking=True)) for n, t in items]
            if state_checksum(items) != checksum:
                raise CorruptWeights(f"version {version} in {slot}: checksum mismatch after copying to {dev}")
        return items, False, stream
