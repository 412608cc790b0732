"""The trainer's storages a worker keeps mapped from one IPC version to the next.

A trainer that steps its optimizer in place exposes the same storages every version, so the
handles of version N+1 name memory this worker already mapped for version N. Opening a CUDA
IPC handle costs a driver call (``cudaIpcOpenMemHandle``) and an IPC event per storage, tens
of milliseconds for a few hundred tensors beside a busy engine; a mapping kept from the last
version costs a dictionary lookup. :class:`MappedStorages`
keeps the storages the last version used, keyed by what identifies their memory in the trainer
process (a CUDA handle and offset, or a shared-memory file's descriptor and inode), and maps
only storages it does not hold, each after taking a reference to it
(:func:`~rollq.weightsync.ipc_counters.take`), which its mapping gives back when it goes.
What the last version held and the next one does not name is unmapped when the next one has
been opened.

Why a kept mapping is the trainer's current memory: while it is mapped here, the trainer's
allocation cannot be freed or reused (the CUDA IPC reference this worker took when it mapped
the storage keeps the block allocated; a mapped shared-memory file keeps its inode),
so equal handles name the same memory. The copy's checksum still verifies every byte.

Holding a dead trainer's memory would keep it from being freed: every mapping goes when a
version comes from another trainer process, when the staging fails, and, within
``watch_interval`` seconds, when the trainer process that exposed them exits.

>>> import os, torch
>>> from rollq.weightsync.trainer.ipc_export import Exposure
>>> from rollq.weightsync.worker._ipc import _open_cpu
>>> w = torch.zeros(4).share_memory_()
>>> maps = MappedStorages()
>>> x = Exposure(1, [("w", w)])
>>> len(maps.open(x.handles, lambda i, s: _open_cpu(x.handles.pid, s, "w"))), maps.reused
(1, 0)
>>> x.release(); x = Exposure(2, [("w", w)])  # the next version: the same storage
>>> len(maps.open(x.handles, lambda i, s: _open_cpu(x.handles.pid, s, "w"))), maps.reused
(1, 1)
>>> x.release(); maps.clear(); len(maps)
0
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Hashable, TypeVar

import torch

from ..ipc_counters import give_back, take
from ..ipc_wire import IpcHandles, IpcStorage, IpcTensor, StorageKind

log = logging.getLogger(__name__)

Opener = Callable[[int, IpcStorage], torch.UntypedStorage]
T = TypeVar("T")


def storage_key(pid: int, s: IpcStorage) -> Hashable:
    """What identifies ``s``'s memory in trainer process ``pid``."""
    if s.kind is StorageKind.CUDA:
        return ("cuda", s.device_uuid, s.handle, s.offset, s.nbytes)
    return ("cpu", pid, s.fd, s.inode, s.nbytes)


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when there is none: a
    pid reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces; start time is field 22.
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


class MappedStorages:
    """The storages of the last IPC version a worker copied, kept mapped for the next."""

    def __init__(self, watch_interval: float = 1.0):
        #: Seconds between checks that the trainer process still runs (while mappings are held).
        self.watch_interval = watch_interval
        #: Of the last :meth:`open`: storages opened, and storages taken from the last version.
        self.opened = self.reused = 0
        self._lock = threading.Lock()
        self._maps: dict[Hashable, torch.UntypedStorage] = {}
        self._owner: tuple[int, int | None] | None = None  # (pid, start time) of their trainer
        #: The last :meth:`tensors`: (its storages, its tensor table, what ``build`` made of them).
        self._views: tuple[list[torch.UntypedStorage], list[IpcTensor], Any] | None = None
        #: What callers built from those views (:meth:`derived`), dropped with them.
        self._derived: dict[str, tuple[Hashable, Any]] = {}
        self._watcher: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._maps)

    def open(self, h: IpcHandles, open_one: Opener) -> list[torch.UntypedStorage]:
        """The storages of ``h``, in order: those the last version mapped as they are, the
        others through ``open_one(index, storage)`` once a reference to each is taken
        (:func:`~rollq.weightsync.ipc_counters.take`). Raises what ``take`` or ``open_one``
        raises, having unmapped everything and given back the references it took for storages
        it did not map."""
        owner = (h.pid, process_start(h.pid))
        with self._lock:
            if self._owner != owner:
                self._maps, self._owner = {}, owner
            kept = self._maps
        keys = [storage_key(h.pid, s) for s in h.storages]
        missing: dict[Hashable, int] = {}  # key -> the first storage of h that names it
        for i, key in enumerate(keys):
            if key not in kept and key not in missing:
                missing[key] = i
        now: dict[Hashable, torch.UntypedStorage] = {k: kept[k] for k in keys if k in kept}
        try:
            take(h.storages[i] for i in missing.values())
        except BaseException:
            self.clear()
            raise
        pending = dict(missing)
        try:
            for key, i in missing.items():
                now[key] = open_one(i, h.storages[i])
                del pending[key]
        except BaseException:
            give_back(h.storages[i] for i in pending.values())
            del now
            self.clear()
            raise
        out = [now[k] for k in keys]
        with self._lock:
            kept, self._maps = self._maps, now
            if missing or len(now) != len(kept):
                self._views, self._derived = None, {}  # built on storages this version does not hold
        del kept  # what the last version held and this one does not is unmapped here
        self.opened, self.reused = len(missing), len(now) - len(missing)
        self._watch()
        return out

    def tensors(self, h: IpcHandles, open_one: Opener, build: Callable[[list[torch.UntypedStorage]], Any]) -> Any:
        """``build(storages)`` of :meth:`open`'s storages; when the storages are the last
        version's and it laid its tensors out the same way, what ``build`` made of them then
        (a few hundred tensor views cost a millisecond of Python beside a busy engine)."""
        storages = self.open(h, open_one)
        with self._lock:
            last = self._views
        if (last is not None and len(last[0]) == len(storages) and all(a is b for a, b in zip(last[0], storages))
                and last[1] == h.tensors):
            return last[2]
        made = build(storages)
        with self._lock:
            if self._maps:  # not unmapped meanwhile (a failure, the trainer's exit)
                self._views, self._derived = (storages, h.tensors, made), {}
        return made

    def derived(self, views: Any, name: str, ident: Hashable, make: Callable[[], T]) -> T:
        """What ``make()`` builds from ``views`` (what :meth:`tensors` returned) and from what
        ``ident`` identifies: built once while those views are kept, and dropped with them
        (so it holds none of the trainer's memory longer than the mappings do). Views that
        are not the kept ones (mappings not kept, or dropped since) are built for each call.

        >>> maps = MappedStorages()
        >>> maps.derived([], "x", 1, lambda: "built")  # nothing kept: built every time
        'built'
        """
        with self._lock:
            kept = self._views
            got = self._derived.get(name) if kept is not None and kept[2] is views else None
        if got is not None and got[0] == ident:
            out: T = got[1]
            return out
        out = make()
        with self._lock:
            if kept is not None and self._views is kept:
                self._derived[name] = (ident, out)
        return out

    def clear(self) -> None:
        """Unmap everything (the next version opens every storage)."""
        with self._lock:
            old = self._detach()
        del old  # unmapped here, outside the lock

    def _detach(self) -> dict[Hashable, torch.UntypedStorage]:
        """Forget every mapping and the views over them (under the lock); the caller unmaps
        what this returns by dropping it outside the lock."""
        old, self._maps, self._owner, self._views, self._derived = self._maps, {}, None, None, {}
        return old

    def _watch(self) -> None:
        with self._lock:
            if not self._maps or self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._watch_loop, name="rollq-ipc-maps", daemon=True)
            self._watcher.start()

    def _watch_loop(self) -> None:
        pause = threading.Event()
        while True:
            pause.wait(self.watch_interval)
            with self._lock:
                if not self._maps or self._owner is None:
                    self._watcher = None
                    return
                pid, start = self._owner
                if process_start(pid) == start:
                    continue
                old, self._watcher = self._detach(), None
            log.info("trainer process %d exited: unmapped the %d storages kept from its last version", pid, len(old))
            del old
            return
