"""Page-locked (CUDA-registered) mappings of memmap files, kept for the process's lifetime.

Copying between a GPU and an ordinary memory-mapped file goes through a small pinned bounce
buffer inside the CUDA driver (a few GB/s). Registering the file's mapping with
``cudaHostRegister`` lets the GPU's copy engines read and write the file's pages directly (the
speed of pinned memory, tens of GB/s). Registration pins every page once, which costs about
as much as one slow copy, so mappings are kept and reused: weight slots are rewritten in
place, version after version.

A mapping is keyed by path and checked against the file's inode and size on every use; a
file that was replaced (a slot rewritten from scratch) is mapped and registered anew.

>>> view = pinned_file("/dev/shm/rollq-weights/slot-0/lm_head.weight.memmap")  # doctest: +SKIP
>>> gpu_tensor.view(-1).view(torch.uint8).copy_(view, non_blocking=True)      # doctest: +SKIP
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class _Mapping:
    key: tuple[int, int, int]  # st_dev, st_ino, st_size
    mm: mmap.mmap
    view: torch.Tensor  # uint8 view of the whole file, sharing the mapping's memory


_maps: dict[str, _Mapping] = {}
_lock = threading.Lock()
_unsupported: str | None = None


def available() -> bool:
    """Whether CUDA host registration can be used in this process."""
    return _unsupported is None and torch.cuda.is_available()


def pinned_file(path: str | os.PathLike) -> torch.Tensor | None:
    """A uint8 tensor over the whole file, page-locked for CUDA copies; None when this
    process cannot register host memory (the caller then copies the ordinary way)."""
    global _unsupported
    if not available():
        return None
    path = os.fspath(path)
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size)
    with _lock:
        m = _maps.get(path)
        if m is not None and m.key == key:
            return m.view
        if m is not None:
            _release(path)
        if st.st_size == 0:
            return None
        fd = os.open(path, os.O_RDWR)  # registration needs a writable mapping
        try:
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        # cudaHostRegisterPortable (1): pinned for every CUDA context of the process.
        rc = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), st.st_size, 1)
        if int(rc) != 0:
            _unsupported = f"cudaHostRegister failed ({rc}) on {path}"
            log.warning("%s; memmap copies fall back to pageable memory", _unsupported)
            _clear_cuda_error()
            del view
            mm.close()
            return None
        _maps[path] = _Mapping(key, mm, view)
        return view


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a failed registration: left set, the next kernel launch
    of any code in the process reads it and fails ("CUDA error: invalid argument")."""
    get_last = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get_last is not None:
        get_last()
        return
    try:  # a launch check reads the last error, and reading it resets it
        torch.zeros(1, device="cuda").add_(1)
    except Exception as e:  # noqa: BLE001 - that was the error being cleared
        log.debug("cleared CUDA error: %s", e)


def flush(paths: list[str]) -> None:
    """msync the mappings of ``paths`` (needed on real filesystems; cheap on tmpfs)."""
    with _lock:
        for p in paths:
            m = _maps.get(p)
            if m is not None:
                m.mm.flush()


def release_all() -> None:
    """Unregister and unmap every mapping (tests; a process may also just exit)."""
    with _lock:
        for p in list(_maps):
            _release(p)


def _release(path: str) -> None:
    m = _maps.pop(path)
    try:
        torch.cuda.cudart().cudaHostUnregister(m.view.data_ptr())
    except Exception as e:  # pragma: no cover - only logged
        log.debug("cudaHostUnregister %s: %s", path, e)
    view = m.view
    m.view = None
    del view
    try:
        m.mm.close()
    except BufferError:  # a tensor still shares it: the mapping stays until that is freed
        log.debug("mapping of %s still in use; left mapped", path)
