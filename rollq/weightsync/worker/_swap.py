"""Worker side of a swap: putting a version that arrived while serving live.

Runs inside each vLLM worker process, inside the extension's swap RPCs, which vLLM's engine
core runs between two scheduler steps (and the copies are ordered on the engine's stream
after the step in flight), so no step sees a mix of versions; generation stops only while
they run.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ...errors import WeightSyncError
from ..ipc_wire import IpcUnavailable
from ..wire import Swap, SwapReport, WorkerError

if TYPE_CHECKING:
    from ._direct_copy import PendingCopy
    from ._receiver import ReceiveProgress, WorkerReceiver
    from ._shadow import ShadowWeights
    from ._state import WorkerState

log = logging.getLogger(__name__)


def apply_staged(st: WorkerState, version: int) -> SwapReport:
    """Swap a staged version in: from the shadow weights, else from the memmap or IPC copy
    staged here (or the trainer's leased tensors: a direct swap), else from the broadcast's
    staging buffer.

    Copies from the shadow and a direct swap's copies by its load plan are enqueued on the
    engine's stream and not waited for (the next step runs after them on the device);
    :attr:`~rollq.weightsync.worker._state.WorkerState.last_swap` says when they ended. A
    direct swap's report then says ``pending``: the trainer's tensors are read until that end
    (``SwapTimes.done_at``), which the replica's claim must outlast. The requests' progress
    is read off the device ahead of the copies (:meth:`~rollq.weightsync.worker._progress.RequestTracker.begin_report`),
    so the call returns once the step in flight has ended, while the copies run: the engine
    then prepares its next step, which the device runs right after them."""
    t0 = time.perf_counter()
    progress = st.tracker.begin_report(st.worker)
    how = Swap.SHADOW
    swapped = None
    copied_by: str | None = None
    pending: PendingCopy | None = None
    with st.lock:  # nothing rewrites the shadow or memmap staging mid-swap
        sh, mm, ipc = st.shadow, st.memmap.staged, st.ipc.staged
        if sh is not None and sh.version == version:
            # Copies enqueued on the engine's stream between two steps: the next step runs
            # after them. No host wait: the engine prepares that step meanwhile.
            swapped = sh.swap()
            sh.version = None
            st.memmap.staged = st.ipc.staged = None
        elif mm is not None and mm[0] == version and mm[1] is not None:
            how = Swap.LOAD
            st.memmap.staged = None
            st.load_live(mm[1])
        elif ipc is not None and ipc[0] == version and ipc[1] is not None:
            how = Swap.LOAD
            try:
                direct = st.ipc.swap_direct(version)  # the trainer's leased tensors, straight into live
            except IpcUnavailable as e:  # refused (or torn) data: an answer, not a failed call
                return SwapReport(swap=Swap.DIRECT, error=WorkerError.of(e), load_s=time.perf_counter() - t0)
            if direct is not None:
                how = Swap.DIRECT
                copied_by, pending = direct
            else:
                st.ipc.staged = None
                st.load_live(ipc[1])
        else:
            how = Swap.BROADCAST
    if how is Swap.BROADCAST:
        rcv = st.receiver
        if rcv is None:
            raise WeightSyncError(f"version {version} is not staged here")
        # lock order: the receiver's buffer, then the worker's (as in a receive)
        with rcv.lock, st.lock:
            st.load_live(rcv.take(version))
    if swapped is not None:
        st.watch_swap(version, swapped)
    elif pending is not None:  # its copies end on the device after this call: watched for
        st.watch_swap(version, pending.end, finish=pending.finish)
    elif st.device.type == "cuda":
        torch.cuda.synchronize(st.device)
    st.version = version
    return SwapReport(swap=how, load_s=time.perf_counter() - t0, progress=progress(),
                      no_shadow=None if how is Swap.SHADOW or copied_by == "plan" or (how is Swap.DIRECT and st.shadow is not None)
                      else (st.shadow_off or "not prepared"), copied_by=copied_by, pending=pending is not None)


def swap_overlapped(
    st: WorkerState, version: int, commit_timeout: float = 0.25, receive_timeout: float = 5.0, start_timeout: float = 0.05,
    programs: int = 0,
) -> SwapReport:
    """Swap ``version`` in while its last parts still arrive, then wait for its commit.

    Generation stands still from the call until it returns. Each part of the in-place
    receive (a bucket, or a coalesced group of tensors) is swapped in as soon as it is
    complete, by :meth:`~rollq.weightsync.worker._shadow.ShadowWeights.exchange` stream-ordered after
    the part's event, while the rest still arrives; once every byte is in and the trainer has
    committed the version, the next step runs on it. If the receive fails, or the commit
    does not come within ``commit_timeout`` of the last byte, the exchanges are undone: the
    old weights serve on, and a committed version is swapped in the usual way
    (:func:`apply_staged`).

    ``programs`` caps the exchange kernel's concurrent blocks (0: no cap), leaving memory
    bandwidth to the receive still running beside it.

    Returns a report with ``swap`` ``overlap``, ``reverted`` or ``none``, and timings:
    ``wait_parts_s`` (until the last part was swapped in), ``wait_commit_s``, ``load_s``.
    """
    t0 = time.perf_counter()
    rcv, sh = st.receiver, st.shadow
    if rcv is None or sh is None:
        return SwapReport(swap=Swap.NONE, why="no broadcast receiver" if rcv is None else "no shadow weights")
    progress = st.tracker.begin_report(st.worker)  # ahead of the exchanges, as in apply_staged
    prog = rcv.progress_for(version, start_timeout)
    groups = sh.params_by_part(prog.manifest, prog.part_of) if prog is not None else None
    if prog is None or groups is None:
        return SwapReport(swap=Swap.NONE, why=f"version {version} is not being received in place")
    deadline = time.monotonic() + receive_timeout
    done, parts_done = _exchange_parts(st, sh, prog, groups, deadline, programs)
    t_parts = time.perf_counter() - t0
    ok = parts_done == len(groups) and prog.wait_done(max(0.0, deadline - time.monotonic())) and sh.version == version
    why = "" if ok else "the receive failed or did not finish in time"
    t1 = time.perf_counter()
    if ok and not rcv.wait_committed(version, commit_timeout):
        ok, why = False, f"version {version} was not committed within {commit_timeout}s"
    t_commit = time.perf_counter() - t1
    if not ok:
        _undo(rcv, sh, prog, version, done, parts_done, why)
        return SwapReport(swap=Swap.REVERTED, why=why, load_s=time.perf_counter() - t0)
    with st.lock:
        ev = sh.exchanged(version)
    if ev is not None:
        st.watch_swap(version, ev)
    st.version = version
    return SwapReport(swap=Swap.OVERLAP, progress=progress(), parts=len(groups), wait_parts_s=t_parts,
                      wait_commit_s=t_commit, load_s=time.perf_counter() - t0, receive_s=rcv.status.receive_s,
                      kernel=sh.exchange_kernel)


def _exchange_parts(
    st: WorkerState, sh: ShadowWeights, prog: ReceiveProgress, groups: list[list[int]], deadline: float, programs: int,
) -> tuple[list[int], int]:
    """Exchange each part's parameters once the part is in (until ``deadline``), on the
    engine's stream after the part's event; the parameters exchanged and the parts done."""
    cur = torch.cuda.current_stream(st.device) if st.device.type == "cuda" else None
    done: list[int] = []
    parts_done = 0
    for k, params in enumerate(groups):
        got, ev = prog.wait_part(k, max(0.0, deadline - time.monotonic()))
        if not got:
            break
        if ev is not None and cur is not None:
            cur.wait_event(ev)  # after the part's bytes, on the engine's stream
        sh.exchange(params, programs=programs)
        done += params
        parts_done = k + 1
    return done, parts_done


def _undo(rcv: WorkerReceiver, sh: ShadowWeights, prog: ReceiveProgress, version: int, done: list[int],
          parts_done: int, why: str) -> None:
    """Put the old weights back after an overlapped swap that did not go live.

    Exchanges queued behind a part that never completes (a peer died mid-transfer) would
    hold the engine's stream until NCCL's own timeout: the receive is abandoned, which
    aborts the group and ends its kernels (the version then comes by memmap, the group is
    formed anew). An exchange is its own inverse, so undoing restores the old bytes whatever
    arrived. The receive may still hold the worker lock: the undo touches only the parts
    already swapped, which it no longer writes.
    """
    if any(ev is not None and not ev.query() for ev in prog.parts[:parts_done]):
        log.warning("version %d: abandoning its receive (parts still pending)", version)
        rcv.abandon(version)
    sh.exchange(reversed(done))
    log.warning("overlapped swap of version %d undone: %s", version, why)
