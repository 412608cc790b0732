"""Start and stop the replicas of an RL run in this process: engine, consumer, weight follower.

Used by ``rollq demo`` and ``benchmarks/rl_loop.py`` (the trainer shares the process and its
event loop; every replica's engine core runs in its own vLLM process).

>>> async with Replicas(url, "grpo", weights_root=root, count=2) as rs:   # doctest: +SKIP
...     print(rs.model, [c.id for c in rs.consumers])

``cpu_binds`` gives replica ``i`` its own ``VLLM_CPU_OMP_THREADS_BIND`` (``"1"``: core 1) on
vLLM's CPU backend. The variable is read when the engine-core process starts, so replicas
with binds start one after the other (the variable is set around each start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Self, Sequence

import msgspec

from ..consumer.loop import Consumer
from ..consumer.replica import Replica
from ..settings import ConsumerSettings, WeightSyncSettings
from ..weightsync.replica._stats import UpdateStats

if TYPE_CHECKING:
    from ..weightsync.replica.follower import WeightFollower

log = logging.getLogger(__name__)

__all__ = ["ReplicaSnapshot", "Replicas", "WORKER_EXTENSION"]

#: The worker extension that lets followers swap weights into vLLM.
WORKER_EXTENSION = "rollq.weightsync.worker.ext.RollqWorkerExtension"
_BIND = "VLLM_CPU_OMP_THREADS_BIND"


class ReplicaSnapshot(msgspec.Struct, kw_only=True):
    """What the replicas of a run have done so far, read at once (:meth:`Replicas.snapshot`;
    :class:`~rollq.rl.replica_host.ReplicasProcess` brings it from the process hosting them)."""

    #: The policy version each replica serves, in replica order.
    versions: list[int] = []
    #: Tokens the engines generated since they started (vLLM's own count).
    generated_tokens: int = 0
    #: :attr:`Replicas.served_dtype`.
    served_dtype: str = ""
    #: :meth:`Replicas.converted_from`.
    converted_from: list[str] = []
    #: :meth:`Replicas.update_history`: every follower's updates on the queue served now.
    updates: list[UpdateStats] = []
    #: Seconds the engines took to start.
    start_s: float = 0.0
    #: The model the engines serve ("echo" for the echo engine).
    model: str = ""


class StartedReplicas:
    """``async with``: :meth:`start` on entry (then :meth:`stop` if it failed), :meth:`stop` on exit."""

    async def start(self) -> Self:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class Replicas(StartedReplicas):
    """``count`` replicas of one queue (``engine="vllm"`` on ``model``, or ``"echo"``)."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        weights_root: str | None,
        count: int = 2,
        engine: str = "vllm",
        model: str | None = None,
        max_model_len: int = 256,
        kv_cache_memory_bytes: int | None = 64 << 20,
        broadcast: bool = False,
        cpu_binds: Sequence[str | None] | None = None,
        reconcile_interval: float = 1.0,
        gpu_memory_utilization: float | None = None,
        dtype: str = "auto",
        logprobs_mode: str = "raw_logprobs",
        ipc_prestage: bool = False,
        ipc_direct: bool = False,
    ):
        if engine not in ("vllm", "echo"):
            raise ValueError(f"engine must be 'vllm' or 'echo', got {engine!r}")
        self.url, self.queue, self.count, self.kind = url, queue, count, engine
        self.weights_root = weights_root
        self.model = model
        self.max_model_len = max_model_len
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.broadcast = broadcast
        self.cpu_binds = list(cpu_binds) if cpu_binds else []
        self.reconcile_interval = reconcile_interval
        #: GPU: each replica's share of device memory (the trainer and the other replicas share
        #: it); None: vLLM's start check only (:attr:`~rollq.consumer.vllm_config.VllmEngineConfig.gpu_memory_utilization`).
        self.gpu_memory_utilization = gpu_memory_utilization
        #: ``VllmEngineConfig.dtype`` of every replica ("auto": the checkpoint's own on GPU).
        self.dtype = dtype
        #: ``VllmEngineConfig.logprobs_mode`` of every replica (``"processed_logprobs"`` for
        #: jobs sampled at a temperature other than 1, whose ratio the trainer must reproduce).
        self.logprobs_mode = logprobs_mode
        #: ``WeightSyncSettings.ipc_prestage``: the workers start each IPC copy themselves.
        self.ipc_prestage = ipc_prestage
        #: ``WeightSyncSettings.ipc_direct``: a leased IPC version is copied straight into the
        #: live weights at the swap.
        self.ipc_direct = ipc_direct
        self.engines: list[Any] = []
        #: One :class:`~rollq.consumer.replica.Replica` per engine while a queue is served.
        self.replicas: list[Replica] = []
        #: Seconds the engines took to start.
        self.start_s = 0.0

    def _make_engines(self) -> list[Any]:
        from ..consumer.engine import EchoEngine

        if self.kind == "echo":
            return [EchoEngine(delay_per_token=0.0005) for _ in range(self.count)]
        from ..consumer.vllm_config import VllmEngineConfig
        from ..consumer.vllm_engine import VllmEngine
        from ..testing.tiny_model import ensure_tiny_model

        self.model = self.model or str(ensure_tiny_model())
        return [
            VllmEngine(VllmEngineConfig(
                model=self.model, seed=i, max_model_len=self.max_model_len,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes, worker_extension_cls=WORKER_EXTENSION,
                gpu_memory_utilization=self.gpu_memory_utilization, dtype=self.dtype,
                logprobs_mode=self.logprobs_mode,
            ))
            for i in range(self.count)
        ]

    async def _start_engines(self) -> None:
        binds = self.cpu_binds + [None] * (self.count - len(self.cpu_binds))
        if not any(binds):
            await asyncio.gather(*(e.start() for e in self.engines))
            return
        for e, bind in zip(self.engines, binds):
            with _env(_BIND, bind):
                await e.start()

    async def start(self) -> Self:
        """Start the engines, then serve :attr:`queue` (:meth:`attach`)."""
        t0 = time.perf_counter()
        self.engines = self._make_engines()
        await self._start_engines()
        self.start_s = time.perf_counter() - t0
        self.model = self.model or getattr(self.engines[0], "model", "echo")
        log.info("%d %s replica(s) up in %.1fs", self.count, self.kind, self.start_s)
        await self.attach(self.queue)
        return self

    async def attach(self, queue: str, weights_root: str | None = None, *, abort_resume: bool = False) -> None:
        """Serve ``queue`` (a consumer and a weight follower per engine), leaving the previous
        one. The engines keep the weights they hold; a follower loads the queue's committed
        version, if it has one, before its consumer pulls. ``abort_resume``: under the queue's
        ``abort`` update policy, aborted requests continue from their tokens
        (``WeightSyncSettings.abort_resume``)."""
        await self.detach()
        self.queue = queue
        if weights_root is not None:
            self.weights_root = weights_root
        weights = None
        if self.kind == "vllm":
            weights = WeightSyncSettings(root=self.weights_root, reconcile_interval=self.reconcile_interval, broadcast=self.broadcast,
                                         abort_resume=abort_resume, ipc_prestage=self.ipc_prestage,
                                         ipc_direct=self.ipc_direct)
        for i, e in enumerate(self.engines):
            replica = Replica(e, self.url, queue, consumer_id=f"replica-{i}", settings=ConsumerSettings(lease_ttl=10.0),
                              weights=weights, own_engine=False)
            await replica.start()
            self.replicas.append(replica)

    async def detach(self) -> None:
        """Stop serving the current queue (consumers drain, followers stop); engines stay up."""
        replicas, self.replicas = self.replicas, []
        await asyncio.gather(*(r.stop(timeout=30) for r in replicas))

    @property
    def consumers(self) -> list[Consumer]:
        return [r.consumer for r in self.replicas]

    @property
    def followers(self) -> list[WeightFollower]:
        return [r.follower for r in self.replicas if r.follower is not None]

    async def stop(self) -> None:
        await self.detach()
        await asyncio.gather(*(e.stop() for e in self.engines), return_exceptions=True)
        self.engines = []

    async def wait_version(self, version: int, timeout: float = 120.0) -> None:
        """Until every replica serves ``version`` or newer (TimeoutError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while any(c.version < version for c in self.consumers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas did not reach policy version {version} within {timeout:.0f}s")
            await asyncio.sleep(0.02)

    @property
    def served_dtype(self) -> str:
        """The dtype the replicas serve the weights in ("" for echo; joined if they differ)."""
        return "/".join(sorted({e.dtype for e in self.engines if getattr(e, "dtype", "")}))

    def converted_from(self) -> list[str]:
        """dtypes of the served version that some replica converts to its own."""
        return sorted({d for c in self.consumers for d in c.converted_from})

    def update_history(self) -> list[UpdateStats]:
        """Every follower's :class:`~rollq.weightsync.replica._stats.UpdateStats`, all replicas."""
        return [st for f in self.followers for st in f.history]

    async def snapshot(self) -> ReplicaSnapshot:
        """What the replicas did so far, in one value (the same call on a
        :class:`~rollq.rl.replica_host.ReplicasProcess`).

        >>> s = await replicas.snapshot()   # doctest: +SKIP
        >>> s.versions, s.generated_tokens   # doctest: +SKIP
        ([3], 5120)
        """
        return ReplicaSnapshot(
            versions=[c.version for c in self.consumers], generated_tokens=sum(e.stats().generated_tokens for e in self.engines),
            served_dtype=self.served_dtype, converted_from=self.converted_from(), updates=self.update_history(),
            start_s=self.start_s, model=str(self.model or ""),
        )


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
