"""Fixtures of the weight-sync tests."""

from __future__ import annotations

import os
from typing import Callable, Iterator

import pytest
import torch


@pytest.fixture
def counter_file() -> Iterator[Callable[[int], tuple[bytes, torch.Tensor]]]:
    """Makes a torch reference-counted shared-memory file of 10,000 int64 counters, all
    ``value`` (as torch's CUDA IPC counter files are laid out: a 64-byte header, then the
    counters): returns its name and the tensor over it."""
    import torch.multiprocessing as mp

    from rollq.weightsync.ipc_counters import COUNTER_HEADER

    made: list[torch.Tensor] = []

    def make(value: int) -> tuple[bytes, torch.Tensor]:
        strategy = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            t = torch.full((10000,), value, dtype=torch.int64).share_memory_()
            _, name, size = t.untyped_storage()._share_filename_cpu_()
        finally:
            mp.set_sharing_strategy(strategy)
        assert os.path.getsize(f"/dev/shm{name.decode()}") == size + COUNTER_HEADER  # torch's layout
        made.append(t)
        return name, t

    yield make
    made.clear()
