"""Parameter shards: publishing from a trainer whose parameters are split over its ranks
(FSDP2 ``fully_shard`` / DTensor): every rank takes part, no rank holds the whole model.
(A queue's shards, the streams one queue spreads over, are :mod:`rollq.shards`'.)

Every rank of the trainer group calls
:meth:`WeightPublisher.publish_weights(state, group=...) <rollq.weightsync.trainer.publisher.WeightPublisher.publish_weights>`
with its own state dict and gets the same record back; rank 0 of the group alone talks to
Redis (the served manifest, the version number, the commit) and tells the others what it
decided through the group::

    fully_shard(model)                                       # on each of W ranks
    pub = WeightPublisher(url, "grpo", root="/dev/shm/rollq-weights",    # the same root everywhere
                          sender=BroadcastSender(backend="nccl") if dist.get_rank() == 0 else None)
    rec = await pub.publish_weights(model.state_dict(), group=dist.group.WORLD)      # memmap
    rec = await pub.publish_weights(model.state_dict(), transport="nccl", group=dist.group.WORLD)

- memmap (:func:`write_parts`): each rank writes its own block of every sharded tensor
  (FSDP2's ``Shard(0)``: a row range, one ``pwrite``) straight into the full-size files of the
  version's slot, in the layout :meth:`MemmapStore.write <rollq.weightsync.memmap.MemmapStore.write>`
  produces, so replicas load it unchanged. A replicated block is written by its first holder,
  a plain tensor by one rank. After a barrier the ranks checksum the files, the tensors divided
  among them by size: one read of every byte through a mapping of the page cache, split W ways
  (about twice the time of a checksum of the same bytes in memory, per byte; in all, the
  model's bytes / W per rank). Then rank 0 writes the commit marker and commits the version.
  **Peak extra memory per rank: about none**: no tensor is gathered or copied on CPU (a GPU
  shard is copied into the file's pages through the driver's own staging), besides the page
  cache the slot lives in. Placements other than ``Shard`` / ``Replicate`` (``Partial``,
  strided shards) are gathered one tensor at a time: one full tensor.
- broadcast (:class:`StreamedItems`): the ranks all-gather the tensors one bucket of at most
  ``bucket_bytes`` (the sender's) at a time, in manifest order, and rank 0 hands each bucket to
  its :class:`~rollq.weightsync.trainer.sender.BroadcastSender` as the broadcast reaches it. **Peak
  extra memory per rank: one bucket of full tensors** (a single larger tensor is a bucket of
  its own; on NCCL in ``direct`` mode, one coalesced group of up to ``group_bytes``), **plus
  the sender's two packing buffers (2 x bucket_bytes) on rank 0**. The sender cannot verify a
  streamed version (its checksum would need the whole state first): ``verify=True`` is refused.
  A failed broadcast is not offered again (the buckets are gone): every rank writes the same
  version through memmap instead, and when some workers did not ack, every rank writes a memmap
  copy for them.

The building blocks walk a DTensor state dict bucket by bucket: every rank walks the same list
of parameters, cut into buckets of at most ``bucket_bytes`` (by global size); for each bucket
the ranks all-gather just that bucket's tensors (``DTensor.full_tensor()``), and the bucket is
released before the next one is gathered.

>>> for bucket in iter_full_buckets(model.state_dict(), bucket_bytes=1 << 30):  # doctest: +SKIP
...     if dist.get_rank() == 0:
...         send(bucket)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Iterator, Mapping

import torch

from ...errors import WeightSyncError
from ..checksum import _MASK, combine_checksums
from ..layout import flat_bytes
from ..memmap import MemmapStore, SlotInfo, manifest_of
from ..versions import TensorMeta

log = logging.getLogger(__name__)


def _global_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # a DTensor reports its global shape


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Cut the names of ``state`` (in order) into buckets of at most ``bucket_bytes`` each.

    >>> plan_buckets({"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(8)}, 32)
    [['a', 'b'], ['c']]
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    buckets: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for name, t in state.items():
        n = _global_nbytes(t)
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        buckets.append(cur)
    return buckets


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``: a collective for a DTensor (every rank must call it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t.detach()


def iter_full_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int = 1 << 30) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield ``[(name, full tensor), ...]`` one bucket at a time; every rank must iterate fully.

    The caller must drop its references to a bucket before asking for the next one, so that
    only one bucket of gathered tensors is alive per rank.

    >>> [[n for n, _ in b] for b in iter_full_buckets({"a": torch.ones(2)}, 64)]
    [['a']]
    """
    for names in plan_buckets(state, bucket_bytes):
        bucket = [(n, full_tensor(state[n])) for n in names]
        log.debug("gathered bucket of %d tensors (%d bytes)", len(bucket), sum(_global_nbytes(t) for _, t in bucket))
        yield bucket
        del bucket


# ----------------------------------------------------------------------------------------
# Talking within the trainer group
# ----------------------------------------------------------------------------------------
def comm_device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors: CPU for gloo, else the current GPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """``data`` of the group's rank 0 on every rank (others pass None)."""
    import torch.distributed as dist

    dev = comm_device(group)
    src = dist.get_global_rank(group, 0)
    first = dist.get_rank(group) == 0
    n = torch.tensor([len(data) if first and data else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src, group=group)
    if first and data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    if buf.numel():
        dist.broadcast(buf, src, group=group)
    return bytes(buf.cpu().numpy()) if buf.numel() else b""


def agree_ok(error: BaseException | None, group: Any, what: str) -> None:
    """A barrier that carries failures: raises this rank's ``error``, else
    :class:`~rollq.errors.WeightSyncError` when any other rank had one."""
    import torch.distributed as dist

    if error is not None:
        log.error("rank %d failed %s: %s: %s", dist.get_rank(group), what, type(error).__name__, error)
    flag = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(flag, group=group)
    if error is not None:
        raise error
    if int(flag.item()):
        raise WeightSyncError(f"{int(flag.item())} rank(s) of the trainer group failed {what} (their logs say why)")


# ----------------------------------------------------------------------------------------
# memmap: every rank writes its own part of the slot
# ----------------------------------------------------------------------------------------
def own_part(t: torch.Tensor, index: int, rank: int, world: int) -> tuple[torch.Tensor, list[int]] | None:
    """The block of ``t`` this rank writes and where it starts, or None.

    A DTensor sharded and/or replicated over its mesh (``Shard``, ``Replicate``): this
    rank's local block, if it is the first holder of that block (coordinate 0 on every
    replicated mesh dimension). Other placements (``Partial``, strided shards): the whole
    tensor, gathered on every rank (a collective) and written by one. A plain tensor is taken
    to be the same on every rank and written by rank ``index % world``.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return (t.detach(), [0] * t.dim()) if index % world == rank else None
    if all(type(p) in (Shard, Replicate) for p in t.placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        coord = t.device_mesh.get_coordinate()
        if coord is None or any(type(p) is Replicate and c != 0 for p, c in zip(t.placements, coord)):
            return None
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if list(local.shape) != list(shape):
            raise WeightSyncError(f"local shard of shape {list(local.shape)}, expected {list(shape)} at {list(offset)}")
        return local, list(offset)
    full = t.full_tensor()
    return (full, [0] * full.dim()) if index % world == rank else None


def write_parts(
    store: MemmapStore | None, version: int, slot: str, items: list[tuple[str, torch.Tensor]], group: Any
) -> SlotInfo | None:
    """Write ``items`` (every rank its own parts, :func:`own_part`) into ``slot`` as
    ``version`` and, on rank 0, commit it; every rank of ``group`` must call this with the
    same names in the same order. Returns the slot's info on rank 0, None on the others.

    Rank 0 prepares the slot's files; after a barrier every rank writes its blocks straight
    into the file pages (no rank holds more than its own shards); after a second barrier the
    ranks checksum the files, the tensors divided among them by size (one read of every byte,
    from the page cache, split W ways), and rank 0 writes the commit marker.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    manifest = manifest_of(items)
    t0 = time.perf_counter()
    err: BaseException | None = None
    reused = False
    if store is None:
        err = WeightSyncError("memmap transport needs a root directory on every rank (WeightPublisher(root=...))")
    elif rank == 0:
        try:
            reused = store.open_slot(slot, manifest)
        except Exception as e:  # noqa: BLE001 - every rank must reach the barrier; raised there
            err = e
    agree_ok(err, group, f"to prepare memmap slot {slot} for version {version}")
    assert store is not None
    written = 0
    try:
        for k, ((_, t), m) in enumerate(zip(items, manifest)):
            part = own_part(t, k, rank, world)
            if part is not None:
                written += store.write_part(slot, m, *part)
                del part
    except Exception as e:  # noqa: BLE001 - raised at the barrier, after the others finished
        err = e
    agree_ok(err, group, f"to write their part of version {version}")
    write_s = time.perf_counter() - t0
    hashes = torch.zeros(len(manifest), dtype=torch.int64)
    try:
        for k in _share(manifest, world)[rank]:
            hashes[k] = _signed(store.part_checksum(slot, manifest[k]))
    except Exception as e:  # noqa: BLE001
        err = e
    agree_ok(err, group, f"to checksum version {version}")
    hashes = hashes.to(comm_device(group))
    dist.all_reduce(hashes, group=group)  # each entry is set by exactly one rank
    checksum_s = time.perf_counter() - t0 - write_s
    log.debug("rank %d wrote %d bytes of version %d", rank, written, version)
    if rank != 0:
        return None
    checksum = combine_checksums((m.name, int(h) & _MASK) for m, h in zip(manifest, hashes.cpu().tolist()))
    nbytes = store.commit(slot, version, checksum, manifest)
    log.info("wrote version %d to %s from %d ranks (%.1f MB, %.3fs, reused=%s)", version, slot, world, nbytes / 1e6,
             write_s, reused)
    return SlotInfo(slot, version, checksum, manifest, nbytes, write_s, checksum_s)


def _share(manifest: list[TensorMeta], world: int) -> list[list[int]]:
    """Tensor indices per rank, the biggest first to the least loaded (same on every rank)."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for k in sorted(range(len(manifest)), key=lambda i: (-manifest[i].nbytes, i)):
        r = min(range(world), key=lambda j: (load[j], j))
        out[r].append(k)
        load[r] += manifest[k].nbytes
    return out


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


# ----------------------------------------------------------------------------------------
# broadcast: rank 0 sends the buckets every rank gathers
# ----------------------------------------------------------------------------------------
class StreamedItems:
    """The full tensors of a sharded state in order, gathered bucket by bucket as a sender
    asks for them (rank 0 of the trainer group; the other ranks run :func:`gather_all` with
    the same buckets). ``[i]`` gives the i-th tensor's bytes (flat ``uint8``) and releases
    every earlier one: a reader must go forward only. :meth:`drain` gathers whatever the
    reader did not ask for, so the group's collectives stay matched after a failed send.
    Holds one bucket of gathered tensors at a time.
    """

    def __init__(self, items: list[tuple[str, torch.Tensor]], bucket_bytes: int):
        self.manifest = manifest_of(items)
        self._it = iter_full_buckets(dict(items), bucket_bytes)
        self._have: dict[int, torch.Tensor] = {}
        self._next = 0  # the first tensor not gathered yet
        self._low = 0  # the first tensor still held
        self._lock = threading.Lock()
        #: Most gathered bytes held at once.
        self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self.manifest)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < len(self):
            raise IndexError(i)
        with self._lock:
            if i < self._low:
                raise WeightSyncError(f"streamed tensors are read in order: tensor {i} was already released")
            for j in range(self._low, i):
                self._have.pop(j, None)
            self._low = i
            while i >= self._next:
                bucket = next(self._it, None)
                if bucket is None:
                    raise WeightSyncError(f"tensor {i} was asked for after the stream was drained")
                for _, t in bucket:
                    self._have[self._next] = flat_bytes(t)
                    self._next += 1
                del bucket
                self.peak_bytes = max(self.peak_bytes, sum(t.numel() for t in self._have.values()))
            return self._have[i]

    def drain(self) -> None:
        """Gather (and drop) every bucket not gathered yet."""
        with self._lock:
            self._have.clear()
            self._low = self._next = len(self)
            for _ in self._it:
                pass


def gather_all(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    """A non-sending rank's side of a broadcast: take part in every bucket's gather."""
    for bucket in iter_full_buckets(dict(items), bucket_bytes):
        del bucket


def stand_ins(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What rank 0 checks against the served manifest in place of DTensors (checking needs
    no data, and a collective on rank 0 alone would hang): each a new zero-stride view with
    the global shape and dtype, over one element per local shard, so that tied parameters
    (one shard) share their storage and others differ (a tied ``lm_head.weight`` is told
    apart as it is for the real model). Plain tensors are checked as they are."""
    from torch.distributed.tensor import DTensor

    by_storage: dict[int, torch.Tensor] = {}
    out = []
    for name, t in items:
        if isinstance(t, DTensor):
            key = t.to_local().data_ptr() or id(t)
            if key not in by_storage:
                by_storage[key] = torch.full((), len(by_storage) + 1, dtype=t.dtype)
            out.append((name, by_storage[key].expand(t.shape)))  # a new view each: ids tell items apart
        else:
            out.append((name, t.detach()))
    return out


async def in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a worker thread (collectives block), on this thread's current GPU."""
    dev = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> Any:
        if dev is not None:
            torch.cuda.set_device(dev)
        return fn(*args)

    return await asyncio.to_thread(run)
