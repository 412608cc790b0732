"""torch's CUDA IPC reference counters, as rollq's IPC transport counts them.

``UntypedStorage._share_cuda_()`` names a counter (an int64 in a shared-memory file of the
trainer process, ``ref_counter_handle`` / ``ref_counter_offset`` of
:class:`~rollq.weightsync.ipc_wire.IpcStorage`) and sets it to 1; a process that maps the
storage (``_new_shared_cuda``) decrements it when its mapping goes, and the trainer frees the
storage's block, once its own tensors are gone, only when the counter reads zero. That counts
one reader per message. rollq counts readers instead: the trainer gives back the count
``_share_cuda_`` took as soon as it has the message (:func:`give_back`), so one message serves
every version that exposes the same storage and every worker that maps it, and each worker
takes a reference before it maps a storage (:func:`take`), which its mapping gives back when it
goes. While the trainer exposes a storage it holds it itself; the counter then keeps the block
allocated for as long as any worker has it mapped.

A counter file is mapped once for all the counters a call changes in it. torch changes a
counter without a lock, and so does this module: two workers of one GPU that map or unmap the
same storage at the same instant could lose one change, as torch's own decrements could. A
lost decrement keeps the block until the trainer process exits; a lost increment lets the
trainer free the block while a worker still maps it, which that worker's next copy of the
storage would read wrongly (its checksum, or the lease's token, refuses a version whose bytes
changed while it copied, not one whose memory was reused before).

>>> give_back([]), take([])
(0, 0)
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from typing import Iterable

from .ipc_wire import IpcStorage, IpcUnavailable, StorageKind

log = logging.getLogger(__name__)

#: Bytes before the first counter in a torch reference-counter file (``at::RefcountedMapAllocator``
#: keeps its own header there: ``map_alloc_alignment``).
COUNTER_HEADER = 64
#: The names torch gives the shared-memory files it creates (``at::NewProcessWideShmHandle``).
_SHM_NAME = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")


def _by_file(storages: Iterable[IpcStorage]) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    for s in storages:
        if s.kind is StorageKind.CUDA and s.ref_counter_handle:
            out.setdefault(s.ref_counter_handle, []).append(s.ref_counter_offset)
    return out


def give_back(storages: Iterable[IpcStorage]) -> int:
    """Decrement the counter of each CUDA storage in ``storages`` (CPU storages have none).
    Returns the counters given back. A file already gone (its trainer exited) has nothing to
    give back; a file not laid out as torch lays it out is left to torch's own call
    (``UntypedStorage._release_ipc_counter_cuda``, which maps the whole file for each counter:
    for the 339 storages of a 7B model 4.8 ms on an H100, against 0.8 ms here,
    ``benchmarks/ipc_open.py --device cuda``)."""
    done = 0
    for name, offsets in _by_file(storages).items():
        if _add(name, offsets, -1) is not None:
            done += len(offsets)
            continue
        import torch

        for off in offsets:
            try:
                torch.UntypedStorage._release_ipc_counter_cuda(name, off)
                done += 1
            except RuntimeError as e:  # torch gives up on a file it cannot map, silently
                log.debug("could not give back IPC counter %d of %r: %s", off, name, e)
    return done


def take(storages: Iterable[IpcStorage]) -> int:
    """Increment the counter of each CUDA storage in ``storages``, before it is mapped here.
    Returns the counters taken. Raises :class:`~rollq.weightsync.ipc_wire.IpcUnavailable`,
    having taken none, when a counter file is gone (its trainer exited) or is not laid out as
    torch lays it out (no reference could be counted, so the storage is not mapped)."""
    files = _by_file(storages)
    done: list[tuple[bytes, list[int]]] = []
    try:
        for name, offsets in files.items():
            got = _add(name, offsets, +1)
            if got is None:
                raise IpcUnavailable(f"cannot count a reference to the trainer's storage in {name[:80]!r}: "
                                     "not a torch reference-counter file")
            if not got:
                raise IpcUnavailable(f"the trainer's reference-counter file {name[:80]!r} is gone: the trainer exited")
            done.append((name, offsets))
    except BaseException:
        for name, offsets in done:
            _add(name, offsets, -1)
        raise
    return sum(len(o) for _, o in done)


def _add(name: bytes, offsets: list[int], delta: int) -> bool | None:
    """Add ``delta`` to counters ``offsets`` of torch's reference-counter file ``name``: True
    when done, False when the file is gone, None when this cannot be done the way torch
    does it."""
    if _SHM_NAME.fullmatch(name) is None:
        return None
    try:
        fd = os.open(f"/dev/shm{name.decode()}", os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        count, rest = divmod(size - COUNTER_HEADER, 8)
        if rest or count <= 0 or not all(0 <= off < count for off in offsets):
            return None
        with mmap.mmap(fd, size) as m:
            counters = memoryview(m)[COUNTER_HEADER:].cast("q")
            try:
                for off in offsets:
                    counters[off] += delta
            finally:
                counters.release()
        return True
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
