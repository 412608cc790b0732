"""Versioned TensorDict memmap storage for policy weights (shared filesystem or /dev/shm).

Layout under a root directory::

    root/slot-0/  meta.json  <name>.memmap ...  COMMIT
    root/slot-1/  ...

Version ``v`` goes to ``slot-(v % keep)`` (``keep`` >= 2), so the slot a reader may still be
loading is never the one being written. A write first removes the slot's ``COMMIT`` marker,
then writes the tensors (reusing the existing memmap files in place when the layout is
unchanged: no re-allocation, no page faults on warm pages), then writes ``COMMIT`` (JSON:
version, checksum, tensor manifest) atomically. A reader checks ``COMMIT`` before loading,
verifies the checksum of what it loaded, and checks ``COMMIT`` again afterwards, so a
half-written or concurrently rewritten slot is refused with
:class:`~rollq.errors.CorruptWeights`. Paths never leave the root.

>>> store = MemmapStore("/dev/shm/rollq-weights")                 # doctest: +SKIP
>>> info = store.write(3, model.state_dict())                       # doctest: +SKIP
>>> tensors = store.read(info.slot, version=3, checksum=info.checksum)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..errors import CorruptWeights, WeightSyncError
from .checksum import state_checksum
from .versions import TensorMeta

log = logging.getLogger(__name__)

COMMIT = "COMMIT"


@dataclass
class SlotInfo:
    slot: str
    version: int
    checksum: str
    manifest: list[TensorMeta]
    nbytes: int
    write_s: float
    checksum_s: float
    pinned: bool = False  # written through page-locked mappings (GPU -> file pages directly)


def named_tensors(state: Mapping[str, torch.Tensor] | torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Normalise a state dict, a module or ``(name, tensor)`` pairs to a list of pairs."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    items = list(state.items()) if isinstance(state, Mapping) else list(state)
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise WeightSyncError(f"weights must be (str, Tensor) pairs, got ({type(name).__name__}, {type(t).__name__})")
    return items


def manifest_of(items: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in items]


class MemmapStore:
    """Versioned slots of memory-mapped tensors under ``root``."""

    def __init__(self, root: str | os.PathLike, keep: int = 2, num_threads: int = 4, chunk_bytes: int = 256 << 20, chunks_in_flight: int = 3):
        if keep < 2:
            raise ValueError("keep must be >= 2 (a reader's slot is never rewritten)")
        self.root = Path(root).resolve()
        self.keep = keep
        self.num_threads = num_threads
        #: Host-to-device reads go in chunks of this size, at most ``chunks_in_flight`` queued
        #: (0: everything at once: faster, but it holds back the engine's own copies and so
        #: stops generation meanwhile; benchmarks/README.md has the figures).
        self.chunk_bytes = chunk_bytes
        self.chunks_in_flight = chunks_in_flight
        self.root.mkdir(parents=True, exist_ok=True)
        #: Layout this store last wrote into each slot (enables in-place pinned writes).
        self._layouts: dict[str, list[TensorMeta]] = {}

    # -- paths -------------------------------------------------------------------------
    def slot_for(self, version: int) -> str:
        return f"slot-{version % self.keep}"

    def path(self, slot: str) -> Path:
        """The directory of ``slot``, refusing anything outside the root."""
        p = (self.root / slot).resolve()
        if p.parent != self.root or not p.name.startswith("slot-"):
            raise WeightSyncError(f"slot {slot!r} is outside the weight store root {self.root}")
        return p

    def marker(self, slot: str) -> dict | None:
        try:
            return json.loads((self.path(slot) / COMMIT).read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError) as e:
            raise CorruptWeights(f"commit marker of {slot} is unreadable: {e}") from e

    # -- write -------------------------------------------------------------------------
    def write(self, version: int, state: Mapping[str, torch.Tensor] | torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> SlotInfo:
        """Write ``state`` as ``version`` and commit it; returns where and its checksum."""
        from tensordict import TensorDict

        items = named_tensors(state)
        slot = self.slot_for(version)
        d = self.path(slot)
        t0 = time.perf_counter()
        (d / COMMIT).unlink(missing_ok=True)  # readers now refuse this slot
        manifest = manifest_of(items)
        finish = self._write_pinned(d, slot, items, manifest)  # copies run while we checksum
        reused = pinned = finish is not None
        src = TensorDict(dict(items), batch_size=[]) if not pinned else None
        if not pinned and (d / "meta.json").exists():
            try:
                dst = TensorDict.load_memmap(d)
                if sorted(dst.keys()) == sorted(n for n, _ in items) and all(
                    dst[n].shape == t.shape and dst[n].dtype == t.dtype for n, t in items
                ):
                    dst.update_(src)  # in place into the existing (warm) files
                    for v in dst.values():
                        if hasattr(v, "_memmap_flush"):
                            v._memmap_flush()
                    reused = True
            except Exception as e:  # layout changed or files damaged: rewrite from scratch
                log.info("rewriting slot %s from scratch (%s)", slot, e)
        if not reused:
            shutil.rmtree(d, ignore_errors=True)
            src.memmap(prefix=d, num_threads=self.num_threads)
        self._layouts[slot] = manifest
        write_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        checksum = state_checksum(items)
        checksum_s = time.perf_counter() - t1
        if finish is not None:
            finish()
            write_s = time.perf_counter() - t0  # the copies overlapped the checksum
        nbytes = sum(m.nbytes for m in manifest)
        marker = {
            "version": version, "checksum": checksum, "nbytes": nbytes, "written_at": time.time(),
            "manifest": [[m.name, m.dtype, m.shape] for m in manifest],
        }
        tmp = d / (COMMIT + ".tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / COMMIT)
        log.info("wrote version %d to %s (%.1f MB, %.3fs, reused=%s, pinned=%s)", version, d, nbytes / 1e6, write_s, reused, pinned)
        return SlotInfo(slot, version, checksum, manifest, nbytes, write_s, checksum_s, pinned)

    def _write_pinned(self, d: Path, slot: str, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta]) -> Any:
        """Enqueue copies of GPU tensors into the slot's existing files through their
        page-locked mappings (the copy engines write the file pages directly), on side
        streams; returns a function that waits for them and flushes, or None ("use the
        TensorDict path"). Only when this store wrote the same layout into the slot before."""
        from . import pinned

        if not items or self._layouts.get(slot) != manifest or not pinned.available():
            return None
        if not all(t.device.type == "cuda" for _, t in items):
            return None
        views = []
        for (name, _), m in zip(items, manifest):
            p = d / f"{name}.memmap"
            if not p.is_file() or p.stat().st_size != m.nbytes:
                return None
            v = pinned.pinned_file(p) if m.nbytes else torch.empty(0, dtype=torch.uint8)
            if v is None:
                return None
            views.append((str(p), v))
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for dev in {t.device for _, t in items}:
            streams[dev] = torch.cuda.Stream(dev)
            streams[dev].wait_stream(torch.cuda.current_stream(dev))  # after whatever wrote the weights
        for (_, t), (_, v) in zip(items, views):
            if v.numel():
                t = t.detach()
                with torch.cuda.stream(streams[t.device]):
                    v.copy_((t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8), non_blocking=True)

        def finish() -> None:
            for st in streams.values():
                st.synchronize()
            pinned.flush([p for p, _ in views])

        return finish

    # -- read --------------------------------------------------------------------------
    def _committed(self, slot: str, version: int, checksum: str) -> tuple[Path, dict]:
        d = self.path(slot)
        m = self.marker(slot)
        if m is None:
            raise CorruptWeights(f"{d} has no commit marker: version {version} is not (or no longer) complete")
        if m.get("version") != version or m.get("checksum") != checksum:
            raise CorruptWeights(
                f"{d} holds version {m.get('version')} (checksum {m.get('checksum')}), not version {version} ({checksum})"
            )
        return d, m

    def read_to_device(
        self, slot: str, *, version: int, checksum: str, device: torch.device, stream: torch.cuda.Stream | None = None,
        into: Any = None,
    ) -> list[tuple[str, torch.Tensor]] | None:
        """Copy a committed slot straight into new tensors on ``device`` through page-locked
        mappings of its files, then verify on the device. Copies are enqueued on ``stream``
        (default: the current one); this returns after they finished and were verified.
        None when the files cannot be registered (use :meth:`read` and copy instead).

        ``into(manifest)`` may give, per tensor, the device bytes (``uint8``, contiguous) to
        copy it into instead of new tensors (the shadow weights' own bytes); it is called
        only once the files are known to be readable."""
        from . import pinned

        d, m = self._committed(slot, version, checksum)
        if not pinned.available() or device.type != "cuda":
            return None
        srcs = []
        for name, dtype, shape in m["manifest"]:
            p = d / f"{name}.memmap"
            nbytes = TensorMeta(name, dtype, shape).nbytes
            if not p.is_file() or p.stat().st_size < nbytes:
                raise CorruptWeights(f"{d}: file of {name} is missing or shorter than its {nbytes} bytes")
            v = pinned.pinned_file(p) if nbytes else torch.empty(0, dtype=torch.uint8)
            if v is None:
                return None
            srcs.append((name, getattr(torch, dtype), shape, v[:nbytes]))
        items = []
        pending: collections.deque = collections.deque()
        metas = [TensorMeta(name, dtype, shape) for name, dtype, shape in m["manifest"]]
        dests = into(metas) if into is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, (name, dt, shape, v) in enumerate(srcs):
                if dests is not None:
                    flat = dests[i]
                    dst = flat.view(dt).view(shape)
                else:
                    dst = torch.empty(shape, dtype=dt, device=device)
                    flat = dst.view(-1).view(torch.uint8)
                # In chunks, few at a time: the copy engine serves copies in the order they
                # were queued, so a whole model queued at once would hold back the engine's
                # own small per-step copies (and generation with them) until it is through.
                if self.chunks_in_flight <= 0:  # unthrottled: fastest, but stalls the engine
                    if v.numel():
                        flat.copy_(v, non_blocking=True)
                    items.append((name, dst))
                    continue
                for off in range(0, v.numel(), self.chunk_bytes):
                    flat[off : off + self.chunk_bytes].copy_(v[off : off + self.chunk_bytes], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    pending.append(ev)
                    if len(pending) > self.chunks_in_flight:
                        pending.popleft().synchronize()
                items.append((name, dst))
            got = state_checksum(items)  # on the same stream, after the copies: one host sync
        if got != checksum:
            raise CorruptWeights(f"{d}: checksum {got} of the copy on {device} does not match the committed {checksum}")
        if self.marker(slot) != m:
            raise CorruptWeights(f"{d} was rewritten while it was being read")
        return items

    def read(self, slot: str, *, version: int, checksum: str, verify: bool = True) -> list[tuple[str, torch.Tensor]]:
        """Load a committed slot (memory-mapped tensors), refusing anything but ``version``."""
        from tensordict import TensorDict

        d, m = self._committed(slot, version, checksum)
        try:
            td = TensorDict.load_memmap(d)
        except Exception as e:
            raise CorruptWeights(f"cannot load {d}: {type(e).__name__}: {e}") from e
        names = [row[0] for row in m["manifest"]]
        try:
            items = [(n, td[n]) for n in names]
        except KeyError as e:
            raise CorruptWeights(f"{d} lacks tensor {e} listed in its commit marker") from e
        if verify:
            got = state_checksum(items)
            if got != checksum:
                raise CorruptWeights(f"{d}: checksum {got} does not match the committed {checksum}")
        if self.marker(slot) != m:
            raise CorruptWeights(f"{d} was rewritten while it was being read")
        return items
