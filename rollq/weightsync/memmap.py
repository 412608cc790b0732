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
from .layout import flat_bytes
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
        src: Any = TensorDict(dict(items), batch_size=[]) if not pinned else None
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
        nbytes = self.commit(slot, version, checksum, manifest)
        log.info("wrote version %d to %s (%.1f MB, %.3fs, reused=%s, pinned=%s)", version, d, nbytes / 1e6, write_s, reused, pinned)
        return SlotInfo(slot, version, checksum, manifest, nbytes, write_s, checksum_s, pinned)

    def commit(self, slot: str, version: int, checksum: str, manifest: list[TensorMeta]) -> int:
        """Write ``slot``'s commit marker (atomically): from now on readers accept it as
        ``version``. Returns the bytes of its tensors."""
        d = self.path(slot)
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
        return nbytes

    # -- writes in parts (the ranks of a trainer with parameter shards, param_shards.py) ----
    def open_slot(self, slot: str, manifest: list[TensorMeta]) -> bool:
        """Make ``slot`` (:meth:`slot_for` the version) ready for :meth:`write_part` (one
        process does this, before any part is written): its commit marker removed, and one
        full-size file per tensor of ``manifest`` in the layout :meth:`write` produces
        (``meta.json`` and ``<name>.memmap``, so readers load it unchanged). The existing
        files are kept when the slot already has this layout; new ones are sparse (nothing is
        materialised). Returns whether the files were reused."""
        from tensordict import TensorDict

        d = self.path(slot)
        (d / COMMIT).unlink(missing_ok=True)  # readers now refuse this slot
        reused = self._has_layout(d, manifest)
        if not reused:
            shutil.rmtree(d, ignore_errors=True)
            shapes = {m.name: torch.zeros((), dtype=getattr(torch, m.dtype)).expand(m.shape) for m in manifest}
            TensorDict(shapes, batch_size=[]).memmap_like(prefix=d)  # zero-stride sources: no data
        self._layouts[slot] = manifest
        return reused

    def _has_layout(self, d: Path, manifest: list[TensorMeta]) -> bool:
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        names = {k for k, v in meta.items() if isinstance(v, dict)}
        if names != {m.name for m in manifest}:
            return False
        for m in manifest:
            row = meta[m.name]
            if row.get("shape") != m.shape or row.get("dtype") != f"torch.{m.dtype}":
                return False
            p = d / f"{m.name}.memmap"
            if m.nbytes and (not p.is_file() or p.stat().st_size != m.nbytes):
                return False
        return True

    def _mapped(self, slot: str, meta: TensorMeta) -> tuple[Any, torch.Tensor]:
        """``meta``'s file in ``slot`` memory-mapped for writing (shared: writes reach the
        file), and a view of its bytes shaped like the tensor with the last dimension counted
        in bytes. Nothing is copied."""
        import numpy as np

        p = self.path(slot) / f"{meta.name}.memmap"
        if not p.is_file() or p.stat().st_size < meta.nbytes:
            raise CorruptWeights(f"{p} is missing or shorter than the {meta.nbytes} bytes of {meta.name}")
        mm = np.memmap(p, dtype=np.uint8, mode="r+", shape=(meta.nbytes,))
        t = torch.from_numpy(mm)
        item = getattr(torch, meta.dtype).itemsize
        return mm, (t.view(*meta.shape[:-1], meta.shape[-1] * item) if meta.shape else t)

    def write_part(self, slot: str, meta: TensorMeta, part: torch.Tensor, offset: list[int]) -> int:
        """Write ``part``, the block of tensor ``meta`` that starts at index ``offset``
        (``[0, ...]`` and the whole tensor for an unsharded one), into its file in ``slot``
        (prepared by :meth:`open_slot`); returns the bytes written. Several processes may
        write disjoint parts of one file at once. A block that is one byte range of the file
        (rows of a row-sharded tensor) on CPU is written with ``pwrite``; any other block
        through a shared mapping of the file (a device tensor is copied to its pages directly).
        Nothing is copied on the way."""
        if part.numel() == 0:
            return 0
        if str(part.dtype).removeprefix("torch.") != meta.dtype or len(offset) != len(meta.shape) or part.dim() != len(offset):
            raise WeightSyncError(f"a part of {meta.name} ({part.dtype}, shape {list(part.shape)} at {offset}) does not fit {meta}")
        src = flat_bytes(part)
        if src.device.type == "cpu" and (not offset or (offset[1:] == [0] * (len(offset) - 1) and list(part.shape[1:]) == meta.shape[1:])):
            row = src.numel() // part.shape[0] if offset else 0
            self._pwrite(self.path(slot) / f"{meta.name}.memmap", memoryview(src.numpy()), offset[0] * row if offset else 0)
            return src.numel()
        mm, dst = self._mapped(slot, meta)
        item = part.element_size()
        index = [slice(o, o + n) for o, n in zip(offset, part.shape)]
        if index:
            index[-1] = slice(index[-1].start * item, index[-1].stop * item)
            dst = dst[tuple(index)]
        dst.copy_(src.view(dst.shape))
        mm.flush()
        return src.numel()

    @staticmethod
    def _pwrite(path: Path, data: memoryview, at: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], at + done)
        finally:
            os.close(fd)

    def part_checksum(self, slot: str, meta: TensorMeta) -> int:
        """:func:`~rollq.weightsync.checksum.tensor_checksum` of one tensor as its file in
        ``slot`` holds it now: one read of its bytes through a read-only, pre-faulted mapping
        (from the page cache; nothing is copied)."""
        import mmap

        import numpy as np

        from .checksum import buffer_checksum

        dtype = getattr(torch, meta.dtype)
        if meta.nbytes == 0:
            return buffer_checksum(np.zeros(0, dtype=np.uint8), dtype, tuple(meta.shape))
        p = self.path(slot) / f"{meta.name}.memmap"
        if not p.is_file() or p.stat().st_size < meta.nbytes:
            raise CorruptWeights(f"{p} is missing or shorter than the {meta.nbytes} bytes of {meta.name}")
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), meta.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        try:
            return buffer_checksum(np.frombuffer(mm, dtype=np.uint8), dtype, tuple(meta.shape))
        finally:
            with contextlib.suppress(BufferError):  # numpy may still hold a view until collected
                mm.close()

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
                with torch.cuda.stream(streams[t.device]):
                    v.copy_(flat_bytes(t), non_blocking=True)

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
