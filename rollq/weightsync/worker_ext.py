"""vLLM worker extension: loads rollq weight versions inside every vLLM worker.

Pass ``worker_extension_cls="rollq.weightsync.worker_ext.RollqWorkerExtension"`` to the engine;
the replica then calls these methods by name through ``collective_rpc`` (one call per update
for all workers, never one per tensor). Methods run inside each worker process, next to the
model, so the weights never travel through the engine's RPC channel.

Loading: on GPU workers ``model.load_weights`` (the checkpoint-format loader every vLLM model
has), run while the engine serves into shadow weights (:mod:`rollq.weightsync.shadow`) where
memory allows, so the swap is one device copy; on the CPU backend, whose linear layers are
repacked at start-up, ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
at the swap. Staging (broadcast receive, memmap read) runs in threads of the worker process:
an RPC that did the work itself would hold the engine's step loop for its whole duration.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Iterable

import torch

log = logging.getLogger(__name__)

#: Prefix of worker errors that mean "the stored version is corrupt" (see WeightFollower).
CORRUPT_TAG = "[rollq:CorruptWeights]"

_init_lock = threading.Lock()
#: Requests that vLLM let go of are remembered (with their token counts) this long, at most
#: this many: a swap reports them so a request that finished on the old weights, whose
#: output had not reached the replica yet, is not taken for one that had not started.
_REMOVED_WINDOW_S = 30.0
_REMOVED_KEEP = 16384


class RollqWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    # -- loading -----------------------------------------------------------------------
    def _rollq_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device):
            return dev
        return torch.device("cpu")

    def _rollq_load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        sh = getattr(self, "_rollq_shadow_obj", None)
        if sh is not None:
            sh.synced = False  # live weights change behind the shadow's back
        if self._rollq_device().type == "cpu" and hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=iter(list(items)), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=iter(items))

    def _rollq_lock(self) -> Any:
        """The worker's lock for its shadow weights and memmap staging (a broadcast receiver
        has its own lock for its buffer, always taken before this one)."""
        with _init_lock:
            lock = getattr(self, "_rollq_lock_obj", None)
            if lock is None:
                lock = self._rollq_lock_obj = threading.Lock()
            return lock

    def _rollq_shadow(self) -> Any:
        """The shadow weights (built on first use), or None where they are not used.

        ``ROLLQ_SHADOW_WEIGHTS``: ``auto`` (default: on CUDA when memory allows), ``1``, ``0``.
        """
        if getattr(self, "_rollq_shadow_off", None) is not None:
            return None
        sh = getattr(self, "_rollq_shadow_obj", None)
        if sh is not None:
            return sh
        import os

        from .shadow import ShadowWeights, shadow_supported

        mode = os.environ.get("ROLLQ_SHADOW_WEIGHTS", "auto").lower()
        model = self.model_runner.model
        why = None
        if mode in ("0", "off", "false", "no"):
            why = "disabled by ROLLQ_SHADOW_WEIGHTS"
        elif mode == "auto" and self._rollq_device().type != "cuda":
            why = "not on a GPU (the CPU backend repacks its weights)"
        else:
            why = shadow_supported(model)
        if why is not None:
            self._rollq_shadow_off = why
            log.info("no shadow weights: %s; versions load during the swap", why)
            return None
        self._rollq_shadow_obj = ShadowWeights(model)
        log.info("shadow weights: %.2f GB; new versions load while the engine serves", self._rollq_shadow_obj.nbytes / 1e9)
        return self._rollq_shadow_obj

    def _rollq_prepare(self, version: int, items: Iterable[tuple[str, torch.Tensor]], stream: Any = None, manifest: Any = None) -> bool:
        """Load a version into the shadow weights (in a background thread, with the worker
        lock held); False when there is no shadow or it failed (the swap then loads).
        With its ``manifest`` given, the load is traced once per manifest for a load plan
        (:mod:`rollq.weightsync.shadow`): later versions are then written in place."""
        try:
            with self._rollq_lock():
                sh = self._rollq_shadow()
                if sh is None:
                    return False
                sh.load(items, version, stream, trace=manifest is not None and sh.wants_trace(manifest))
                return True
        except Exception as e:  # never lose the staged version over the shadow
            log.warning("loading version %d into the shadow weights failed (%s: %s); shadow disabled", version, type(e).__name__, e)
            self._rollq_shadow_obj = None
            self._rollq_shadow_off = f"{type(e).__name__}: {e}"
            return False

    def _rollq_direct(self, version: int, manifest: Any, stream: Any = None) -> "_DirectTarget | None":
        """Where to write ``version`` in place: the shadow weights' bytes by their load plan,
        with the worker lock held until :meth:`_DirectTarget.done`; None when there is no
        shadow or no plan for this manifest (stage it and load it instead)."""
        lock = self._rollq_lock()
        lock.acquire()
        try:
            sh = self._rollq_shadow()
            views = sh.begin_direct(manifest, stream) if sh is not None else None
        except BaseException:
            lock.release()
            raise
        if views is None:
            lock.release()
            return None
        return _DirectTarget(sh, views, lock, sh.flat_offsets(manifest))

    def _rollq_flat_layout(self, manifest: Any) -> Any:
        """This worker's shadow layout for ``manifest`` as a FlatLayout (None without one)."""
        from .nccl import FlatLayout, manifest_digest

        sh = getattr(self, "_rollq_shadow_obj", None)
        got = sh.flat_offsets(manifest) if sh is not None else None
        if got is None:
            return None
        return FlatLayout(sig=manifest_digest(list(manifest)), offsets=got[0], total=got[1])

    def rollq_load_memmap(self, root: str, slot: str, version: int, checksum: str, verify: bool = True) -> dict[str, Any]:
        """Load committed ``version`` from a memmap slot; returns timings (seconds).

        On a GPU the tensors are copied to the device first and verified there (the checksum
        runs at memory bandwidth); on CPU they are verified in place.
        """
        from ..errors import CorruptWeights
        from .checksum import state_checksum
        from .memmap import MemmapStore

        dev = self._rollq_device()
        t0 = time.perf_counter()
        try:
            items = MemmapStore(root).read(slot, version=version, checksum=checksum, verify=verify and dev.type != "cuda")
            t1 = time.perf_counter()
            if dev.type == "cuda":
                items = [(n, t.to(dev, non_blocking=True)) for n, t in items]
                torch.cuda.synchronize(dev)
                if verify and state_checksum(items) != checksum:
                    raise CorruptWeights(f"version {version} in {slot}: checksum mismatch after copying to {dev}")
        except CorruptWeights as e:
            # Only a message crosses collective_rpc: tag it so the replica re-raises the type.
            raise RuntimeError(f"{CORRUPT_TAG} {e}") from e
        t2 = time.perf_counter()
        self._rollq_load(items)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t3 = time.perf_counter()
        self._rollq_version = version
        return {"read_s": t1 - t0, "copy_verify_s": t2 - t1, "load_s": t3 - t2, "progress": self._rollq_progress()}

    def rollq_stage_memmap(self, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int = 3) -> dict[str, Any]:
        """Start reading ``version``, copying it to the device and verifying it, in a thread
        of this worker (the engine keeps serving: an RPC that did the work itself would hold
        the engine's step loop). Poll :meth:`rollq_staged_status`; :meth:`rollq_apply_staged`
        then swaps it in."""
        import threading

        t = getattr(self, "_rollq_stage_thread", None)
        if t is not None and t.is_alive():
            return {"state": "busy"}
        self._rollq_staged_mm = None  # free a previously staged copy first
        self._rollq_stage_state = {"state": "staging", "version": version}
        self._rollq_stage_thread = threading.Thread(
            target=self._rollq_stage, args=(root, slot, version, checksum, chunks_in_flight), name="rollq-stage", daemon=True
        )
        self._rollq_stage_thread.start()
        return {"state": "started"}

    def rollq_staged_status(self) -> dict[str, Any]:
        return dict(getattr(self, "_rollq_stage_state", {"state": "idle"}))

    def _rollq_stage(self, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int = 3) -> None:
        from .nccl import responsive_gil

        with responsive_gil():
            self._rollq_stage_locked(root, slot, version, checksum, chunks_in_flight)

    def _rollq_stage_locked(self, root: str, slot: str, version: int, checksum: str, chunks_in_flight: int) -> None:
        from ..errors import CorruptWeights
        from .checksum import state_checksum
        from .memmap import MemmapStore

        dev = self._rollq_device()
        t0 = time.perf_counter()
        pinned = False
        stream = None
        try:
            store = MemmapStore(root, chunks_in_flight=chunks_in_flight)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
                stream = torch.cuda.Stream(dev)  # off the engine's stream
                target: _DirectTarget | None = None

                def into(manifest: Any) -> Any:  # straight into the shadow when it has a plan
                    nonlocal target
                    target = self._rollq_direct(version, manifest, stream)
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
                    with self._rollq_lock():
                        self._rollq_staged_mm = (version, None)
                    self._rollq_stage_state = {"state": "staged", "version": version, "stage_s": time.perf_counter() - t0,
                                               "prepare_s": 0.0, "pinned": True, "shadow": True, "in_place": True}
                    return
                pinned = items is not None
                if items is None:
                    items = store.read(slot, version=version, checksum=checksum, verify=False)
                    with torch.cuda.stream(stream):
                        items = [(n, t.to(dev, non_blocking=True)) for n, t in items]
                        if state_checksum(items) != checksum:
                            raise CorruptWeights(f"version {version} in {slot}: checksum mismatch after copying to {dev}")
            else:
                items = store.read(slot, version=version, checksum=checksum, verify=True)
            t1 = time.perf_counter()
            from .memmap import manifest_of

            shadowed = self._rollq_prepare(version, items, stream, manifest_of(items))
            with self._rollq_lock():
                self._rollq_staged_mm = (version, None if shadowed else items)  # in the shadow: free the copy
            del items
            self._rollq_stage_state = {"state": "staged", "version": version, "stage_s": t1 - t0,
                                       "prepare_s": time.perf_counter() - t1, "pinned": pinned, "shadow": shadowed}
        except Exception as e:
            corrupt = isinstance(e, CorruptWeights)
            self._rollq_stage_state = {"state": "failed", "version": version, "corrupt": corrupt,
                                       "error": f"{CORRUPT_TAG} {e}" if corrupt else f"{type(e).__name__}: {e}"}

    # -- broadcast (NCCL / gloo) -------------------------------------------------------
    def rollq_join_group(self, info: bytes, rank_offset: int, listen: bytes = b"") -> None:
        """Join the trainer's broadcast group as rank ``rank_offset + self.rank`` (in a thread).

        With ``listen`` (a msgpack :class:`~rollq.weightsync.nccl.Listen`) the worker then
        follows offers itself and acks each one in Redis (field ``listen.field + rank``).
        """
        import threading

        import msgspec

        from .nccl import GroupInfo, Listen, WorkerReceiver

        gi = msgspec.msgpack.decode(info, type=GroupInfo)
        lst = msgspec.msgpack.decode(listen, type=Listen) if listen else None
        local = int(getattr(self, "rank", 0))
        rank = rank_offset + local
        self.rollq_leave_group()
        self._rollq_status = {"state": "joining", "group": gi.id, "joined": False}

        def join() -> None:
            try:
                rcv = WorkerReceiver(gi, rank, self._rollq_device(), sink=self._rollq_prepare,
                                     sink_invalidate=self._rollq_invalidate, direct=self._rollq_direct,
                                     layout=self._rollq_flat_layout)
                self._rollq_receiver = rcv
                if lst is not None:
                    rcv.listen(msgspec.structs.replace(lst, field=f"{lst.field}{local}"), self.rollq_version)
                self._rollq_status = {"state": "idle", "group": gi.id, "joined": True, "rank": rank}
            except Exception as e:
                self._rollq_status = {"state": "failed", "group": gi.id, "joined": False, "error": f"{type(e).__name__}: {e}"}

        threading.Thread(target=join, name="rollq-join", daemon=True).start()

    def _rollq_invalidate(self) -> None:
        with self._rollq_lock():
            sh = getattr(self, "_rollq_shadow_obj", None)
            if sh is not None:
                sh.invalidate()

    def rollq_leave_group(self) -> None:
        """Stop following offers and drop the group (the staging buffer goes with it)."""
        rcv = getattr(self, "_rollq_receiver", None)
        self._rollq_receiver = None
        if rcv is not None:
            rcv.close()

    def rollq_receive_status(self) -> dict[str, Any]:
        rcv = getattr(self, "_rollq_receiver", None)
        base = dict(getattr(self, "_rollq_status", {"state": "idle"}))
        if rcv is not None:
            base.update(rcv.status)
            base["group"] = rcv.info.id
            base["joined"] = True
        return base

    def rollq_apply_staged(self, version: int) -> dict[str, Any]:
        """Swap a staged version in.

        vLLM's engine core runs this RPC between two scheduler steps (and the copies are
        ordered on the engine's stream after the step in flight), so no step sees a mix of
        versions; generation stops only while it runs.
        """
        t0 = time.perf_counter()
        how = "shadow"
        swapped = None
        with self._rollq_lock():  # nothing rewrites the shadow or memmap staging mid-swap
            sh = getattr(self, "_rollq_shadow_obj", None)
            mm = getattr(self, "_rollq_staged_mm", None)
            if sh is not None and sh.version == version:
                # Copies enqueued on the engine's stream between two steps: the next step runs
                # after them. No host wait: the engine prepares that step meanwhile.
                swapped = sh.swap()
                sh.version = None
                self._rollq_staged_mm = None
            elif mm is not None and mm[0] == version and mm[1] is not None:
                how = "load"
                self._rollq_staged_mm = None
                self._rollq_load(mm[1])
            else:
                how = "broadcast"
        if how == "broadcast":
            rcv = getattr(self, "_rollq_receiver", None)
            if rcv is None:
                raise RuntimeError(f"version {version} is not staged here")
            # lock order: the receiver's buffer, then the worker's (as in a receive)
            with rcv.lock, self._rollq_lock():
                self._rollq_load(rcv.take(version))
        if swapped is not None:
            self._rollq_watch_swap(version, swapped)
        elif self._rollq_device().type == "cuda":
            torch.cuda.synchronize(self._rollq_device())
        self._rollq_version = version
        out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "swap": how, "progress": self._rollq_progress()}
        if how != "shadow":
            out["no_shadow"] = getattr(self, "_rollq_shadow_off", None) or "not prepared"
        return out

    def rollq_swap_overlapped(
        self, version: int, commit_timeout: float = 0.25, receive_timeout: float = 5.0, start_timeout: float = 0.05,
        programs: int = 0,
    ) -> dict[str, Any]:
        """Swap ``version`` in while its last parts still arrive, then wait for its commit.

        vLLM's engine core runs this RPC between two steps, so generation stands still from
        here until it returns. Each part of the in-place receive (a bucket, or a coalesced
        group of tensors) is swapped in as soon as it is complete, by
        :meth:`~rollq.weightsync.shadow.ShadowWeights.exchange` stream-ordered after the
        part's event, while the rest still arrives; once every byte is in and the trainer has
        committed the version, the next step runs on it. If the receive fails, or the commit
        does not come within ``commit_timeout`` of the last byte, the exchanges are undone:
        the old weights serve on, and a committed version is swapped in the usual way
        (:meth:`rollq_apply_staged`).

        ``programs`` caps the exchange kernel's concurrent blocks (0: no cap), leaving memory
        bandwidth to the receive still running beside it.

        Returns ``{"swap": "overlap" | "reverted" | "none", ...}`` with timings (seconds):
        ``wait_parts_s`` (until the last part was swapped in), ``wait_commit_s``, ``load_s``.
        """
        t0 = time.perf_counter()
        rcv = getattr(self, "_rollq_receiver", None)
        sh = getattr(self, "_rollq_shadow_obj", None)
        if rcv is None or sh is None:
            return {"swap": "none", "why": "no broadcast receiver" if rcv is None else "no shadow weights"}
        prog = rcv.progress_for(version, start_timeout)
        groups = sh.params_by_part(prog.manifest, prog.part_of) if prog is not None else None
        if groups is None:
            return {"swap": "none", "why": f"version {version} is not being received in place"}
        dev = self._rollq_device()
        cur = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        done: list[int] = []
        parts_done = 0
        deadline = time.monotonic() + receive_timeout
        ok = True
        for k, params in enumerate(groups):
            got, ev = prog.wait_part(k, max(0.0, deadline - time.monotonic()))
            if not got:
                ok = False
                break
            if ev is not None and cur is not None:
                cur.wait_event(ev)  # after the part's bytes, on the engine's stream
            sh.exchange(params, programs=programs)
            done += params
            parts_done = k + 1
        t_parts = time.perf_counter() - t0
        ok = ok and prog.wait_done(max(0.0, deadline - time.monotonic())) and sh.version == version
        why = "" if ok else "the receive failed or did not finish in time"
        t1 = time.perf_counter()
        if ok and not rcv.wait_committed(version, commit_timeout):
            ok, why = False, f"version {version} was not committed within {commit_timeout}s"
        t_commit = time.perf_counter() - t1
        if not ok:
            # Exchanges queued behind a part that never completes (a peer died mid-transfer)
            # would hold the engine's stream until NCCL's own timeout: abandon the receive,
            # which aborts the group and ends its kernels (the version then comes by memmap,
            # the group is formed anew). An exchange is its own inverse, so undoing restores
            # the old bytes whatever arrived. The receive may still hold the worker lock: the
            # undo touches only the parts already swapped, which it no longer writes.
            if any(ev is not None and not ev.query() for ev in prog.parts[:parts_done]):
                log.warning("version %d: abandoning its receive (parts still pending)", version)
                rcv.abandon(version)
            sh.exchange(reversed(done))
            log.warning("overlapped swap of version %d undone: %s", version, why)
            return {"swap": "reverted", "why": why, "load_s": time.perf_counter() - t0}
        with self._rollq_lock():
            ev = sh.exchanged(version)
        if ev is not None:
            self._rollq_watch_swap(version, ev)
        self._rollq_version = version
        return {"swap": "overlap", "progress": self._rollq_progress(), "parts": len(groups), "wait_parts_s": t_parts, "wait_commit_s": t_commit,
                "load_s": time.perf_counter() - t0, "receive_s": rcv.status.get("receive_s"), "kernel": sh.exchange_kernel}

    # -- per-token versions -------------------------------------------------------------
    def rollq_track_progress(self) -> bool:
        """Start remembering how many tokens each request had generated when vLLM let go of
        it (finished or aborted), so a later swap can tell a request that finished on the old
        weights from one that had not started. True where this vLLM allows it; the engine
        calls it once at start.

        Two model runners are read: vLLM's first GPU runner (also the CPU backend's; one
        ``CachedRequestState`` per request in ``requests``, removal through
        ``_on_request_state_removed``) and the second (``vllm.v1.worker.gpu``, default on
        GPUs in 0.26: ``req_states`` arrays, removal through ``req_states.remove_request``).
        """
        runner = getattr(self, "model_runner", None)
        if runner is None or _runner_counts(runner) is None:
            return False
        if getattr(runner, "_rollq_removed", None) is not None:
            return True
        removed: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()

        def remember(req_id: str, n: int | None) -> None:
            if n is not None:
                removed[req_id] = (n, time.monotonic())
                if len(removed) > _REMOVED_KEEP:
                    removed.popitem(last=False)

        if isinstance(getattr(runner, "requests", None), dict):
            orig = getattr(runner, "_on_request_state_removed", None)
            if orig is None:
                return False

            def on_removed(req_id: str, req_state: Any, *args: Any, **kwargs: Any) -> Any:
                remember(req_id, len(req_state.output_token_ids) if req_state is not None else None)
                return orig(req_id, req_state, *args, **kwargs)

            runner._on_request_state_removed = on_removed
        else:
            states = runner.req_states
            orig_remove = states.remove_request

            def on_remove(req_id: str, *args: Any, **kwargs: Any) -> Any:
                i = states.req_id_to_index.get(req_id)
                remember(req_id, _v2_count(states, i) if i is not None else None)
                return orig_remove(req_id, *args, **kwargs)

            states.remove_request = on_remove
        runner._rollq_removed = removed
        return True

    def _rollq_progress(self) -> dict[str, Any]:
        """Tokens generated so far by every request vLLM holds, taken inside a swap (between
        two engine steps, so each of them was sampled on the weights being replaced; a token
        of a step still in flight counts too, since the swap's copies run after that step).

        ``{"tokens": {engine request id: count}, "complete": bool}``; ``complete``: a request
        missing from ``tokens`` had generated nothing yet (requests that ended in the last
        :data:`_REMOVED_WINDOW_S` seconds are included with their final counts).
        """
        runner = getattr(self, "model_runner", None)
        tokens = _runner_counts(runner) if runner is not None else None
        if tokens is None:
            return {"tokens": {}, "complete": False}
        removed = getattr(runner, "_rollq_removed", None)
        if removed is not None:
            horizon = time.monotonic() - _REMOVED_WINDOW_S
            while removed and next(iter(removed.values()))[1] < horizon:
                removed.popitem(last=False)
            for rid, (n, _) in removed.items():
                tokens.setdefault(rid, n)
        return {"tokens": tokens, "complete": removed is not None}

    def _rollq_watch_swap(self, version: int, event: Any) -> None:
        """Note (wall clock) when the swap's copies of ``version`` finished on the device."""
        self._rollq_swap_done = {"version": version, "enqueued_at": time.time(), "done_at": None}
        rec = self._rollq_swap_done

        def wait() -> None:
            event.synchronize()  # blocks without the GIL: no polling beside the engine
            rec["done_at"] = time.time()

        threading.Thread(target=wait, name="rollq-swap-watch", daemon=True).start()

    def rollq_swap_done(self) -> dict[str, Any]:
        """When the last swap was enqueued and when its copies finished (``time.time()``)."""
        return dict(getattr(self, "_rollq_swap_done", {}))

    def rollq_version(self) -> int:
        return getattr(self, "_rollq_version", 0)

    def rollq_weight_sample(self, name_contains: str = "embed", offset: int = 0) -> list[float]:
        """Four values of the first parameter whose name contains ``name_contains``, from
        element ``offset`` on (tests and benchmarks use it to see an update land)."""
        for name, p in self.model_runner.model.named_parameters():
            if name_contains in name and p.numel() > 0:
                return p.detach().reshape(-1)[offset : offset + 4].float().cpu().tolist()
        return []


def _runner_counts(runner: Any) -> dict[str, int] | None:
    """Output tokens so far of every request a model runner holds (None: a runner this code
    cannot read)."""
    reqs = getattr(runner, "requests", None)
    if isinstance(reqs, dict):
        return {rid: len(st.output_token_ids) for rid, st in list(reqs.items())}
    states = getattr(runner, "req_states", None)
    index = getattr(states, "req_id_to_index", None)
    if isinstance(index, dict) and hasattr(states, "num_computed_tokens_np") and hasattr(states, "prompt_len"):
        return {rid: _v2_count(states, i) for rid, i in list(index.items())}
    return None


def _v2_count(states: Any, i: int) -> int:
    """Output tokens of row ``i`` of the second model runner's ``req_states``: the prompt is
    computed, then each step computes one more token and samples the next, so a request
    with ``c >= prompt`` computed tokens has sampled ``c - prompt + 1``."""
    computed = int(states.num_computed_tokens_np[i])
    prompt = int(states.prompt_len.np[i])
    return max(0, computed - prompt + 1) if computed >= prompt else 0


class _DirectTarget:
    """A version being written into the shadow weights in place (the worker lock is held).

    ``views``: each tensor's bytes; ``flat`` / ``flat_offsets``: the shadow's flat buffer and
    each tensor's offset in it with the buffer's size (None when it is not laid out flat)."""

    def __init__(self, shadow: Any, views: list[torch.Tensor], lock: Any, flat_offsets: Any = None):
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
