"""N replicas as Ray actors, one placement group per replica.

The driver only starts, watches and stops replicas; it never touches a request. Each actor
runs a full :class:`~rollq.consumer.loop.Consumer` (engine included) and pulls from Redis
itself, so adding replicas adds throughput without a central router.

>>> launcher = RayLauncher(                                                    # doctest: +SKIP
...     url="redis://10.0.0.5:6379/0", queue="grpo",
...     engine=EngineSpec(kind="vllm", options={"model": "/models/qwen", "tensor_parallel_size": 2}),
...     num_replicas=4)
>>> launcher.start(); launcher.watch()     # restarts dead replicas until stop()  # doctest: +SKIP

Placement: each replica gets a placement group of ``tensor_parallel_size`` bundles
(``{"GPU": 1, "CPU": 1}`` each, ``{"CPU": 1}`` without GPUs), packed on one node
(``STRICT_PACK``) so tensor-parallel workers share NVLink. vLLM, started inside the actor,
sees the placement group and places its workers in its bundles.

Choosing nodes: ``replica_resources`` adds custom resources to each replica's first bundle
(replica ``i`` takes entry ``i % len``), so a replica goes only where a node offers them.
Give each node a resource at ``ray start`` (``--resources='{"node_a": 1}'``; in KubeRay,
``rayStartParams.resources`` of a worker group) and ask for a small share of it:

>>> RayLauncher("redis://10.0.0.5:6379/0", "grpo", EngineSpec(), num_replicas=2,   # doctest: +SKIP
...             replica_resources=[{"node_a": 0.01}, {"node_b": 0.01}])

A replica restarted by :meth:`RayLauncher.check` asks for the same resources, so it comes
back on the same node (or a node started in its place), waiting at most ``placement_timeout``.

Weights: with ``weights=WeightSyncSettings(root=..., broadcast=...)`` every replica runs a
:class:`~rollq.weightsync.replica.follower.WeightFollower` beside its consumer (as ``rollq consume
--weights-root ... --broadcast`` does): ``root`` must be storage every replica's node sees
at the same path (a shared filesystem; ``/dev/shm`` is per node).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..settings import ConsumerSettings, WeightSyncSettings

log = logging.getLogger(__name__)


@dataclass
class EngineSpec:
    """What engine a replica builds: ``kind`` ("echo" | "vllm") and its options.

    ``options`` go to :class:`~rollq.consumer.engine.EchoEngine` (``delay_per_token``) or to
    ``VllmEngineConfig`` (``model``, ``tensor_parallel_size``, ...).
    """

    kind: str = "echo"
    options: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        if self.kind == "echo":
            from .engine import EchoEngine

            return EchoEngine(**self.options)
        if self.kind == "vllm":
            from .vllm_config import VllmEngineConfig
            from .vllm_engine import VllmEngine

            return VllmEngine(VllmEngineConfig(**self.options))
        raise ValueError(f"unknown engine kind {self.kind!r} (echo, vllm)")

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.options.get("tensor_parallel_size", 1)) if self.kind == "vllm" else 1


#: The worker extension vLLM replicas load when they follow weights.
WORKER_EXTENSION = "rollq.weightsync.worker.ext.RollqWorkerExtension"


class ReplicaActor:
    """Body of one replica actor (wrapped with ``ray.remote`` by the launcher)."""

    def __init__(
        self, url: str, queue: str, replica_id: str, engine: dict[str, Any], settings: dict[str, Any],
        weights: dict[str, Any] | None = None,
    ):
        import os

        self.url, self.queue, self.replica_id = url, queue, replica_id
        self.spec = EngineSpec(**engine)
        self.settings = ConsumerSettings(**settings)
        self.weights = WeightSyncSettings(**weights) if weights is not None else None
        self.consumer: Any = None
        self.engine: Any = None
        self.follower: Any = None
        if self.spec.kind == "vllm" and self.spec.tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_DISTRIBUTED_EXECUTOR_BACKEND", "ray")
        if self.spec.kind == "vllm" and self.weights is not None:
            self.spec.options.setdefault("worker_extension_cls", WORKER_EXTENSION)
        logging.basicConfig(level=logging.INFO, format=f"[{replica_id}] %(name)s: %(message)s")

    async def run(self) -> int:
        """Build the engine, catch up with the committed weights (with ``weights``) and serve
        until stopped (:class:`~rollq.consumer.replica.Replica`). Returns the consumer's exit code."""
        from .replica import Replica

        replica = Replica(self.spec.build(), self.url, self.queue, consumer_id=self.replica_id, settings=self.settings,
                          weights=self.weights)
        self.engine, self.follower = replica.engine, replica.follower
        self.consumer = replica.consumer
        return await replica.run()

    async def ready(self) -> bool:
        while self.consumer is None or self.consumer.state == "starting":
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()

    async def info(self) -> dict[str, Any]:
        if self.consumer is None:
            return {"id": self.replica_id, "state": "starting"}
        import msgspec

        return msgspec.structs.asdict(self.consumer.info())

    async def node(self) -> dict[str, Any]:
        """Where this actor runs: ``node_id`` (Ray's), ``ip`` and ``pid``."""
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    async def updates(self) -> list[dict[str, Any]]:
        """Weight updates applied so far: ``version``, ``transport``, ``update_s`` each."""
        if self.follower is None:
            return []
        return [{"version": u.version, "transport": u.transport, "update_s": u.update_s} for u in self.follower.history]


@dataclass
class _Replica:
    id: str
    index: int
    pg: Any
    actor: Any
    run_ref: Any
    restarts: int = 0


class RayLauncher:
    """Starts, watches (restarts) and stops N replica actors.

    ``replica_resources``: custom resources per replica, to pin replicas to nodes (see the
    module docstring); ``weights``: replicas follow policy versions (:class:`~rollq.settings.WeightSyncSettings`);
    ``placement_timeout``: seconds to wait for a replica's placement group.
    """

    def __init__(
        self,
        url: str,
        queue: str,
        engine: EngineSpec,
        num_replicas: int = 1,
        *,
        settings: ConsumerSettings | None = None,
        name_prefix: str = "replica",
        use_gpu: bool | None = None,
        cpus_per_bundle: float = 1.0,
        max_restarts: int = 10,
        ray_init_kwargs: dict[str, Any] | None = None,
        replica_resources: Sequence[Mapping[str, float]] = (),
        weights: WeightSyncSettings | None = None,
        placement_timeout: float = 600.0,
    ):
        self.url, self.queue, self.engine = url, queue, engine
        self.num_replicas = num_replicas
        self.settings = settings or ConsumerSettings()
        self.name_prefix = name_prefix
        self.use_gpu = use_gpu
        self.cpus_per_bundle = cpus_per_bundle
        self.max_restarts = max_restarts
        self.ray_init_kwargs = ray_init_kwargs or {}
        self.replica_resources = [dict(r) for r in replica_resources]
        self.weights = weights
        self.placement_timeout = placement_timeout
        self.replicas: dict[str, _Replica] = {}
        self._stopping = False

    # -- placement -----------------------------------------------------------------------
    def _bundles(self, index: int = 0) -> list[dict[str, float]]:
        """Bundles of replica ``index``'s placement group (its custom resources in the first)."""
        import ray

        gpu = self.use_gpu
        if gpu is None:
            gpu = ray.cluster_resources().get("GPU", 0) > 0
        b: dict[str, float] = {"CPU": self.cpus_per_bundle}
        if gpu:
            b["GPU"] = 1
        bundles = [dict(b) for _ in range(self.engine.tensor_parallel_size)]
        if self.replica_resources:
            bundles[0].update(self.replica_resources[index % len(self.replica_resources)])
        return bundles

    def _launch(self, rid: str, index: int, restarts: int = 0) -> _Replica:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = self._bundles(index)
        pg = placement_group(bundles, strategy="STRICT_PACK", name=f"rollq-{self.queue}-{rid}")
        try:
            ray.get(pg.ready(), timeout=self.placement_timeout)
        except GetTimeoutError as e:
            remove_placement_group(pg)
            raise TimeoutError(
                f"no node could place replica {rid} ({bundles}) within {self.placement_timeout}s (placement_timeout)"
            ) from e
        gpu0 = 1 if bundles[0].get("GPU") and self.engine.tensor_parallel_size == 1 else 0
        actor_cls = ray.remote(ReplicaActor)
        actor = actor_cls.options(
            name=f"rollq-{self.queue}-{rid}",
            num_cpus=0 if gpu0 == 0 and self.engine.tensor_parallel_size > 1 else self.cpus_per_bundle,
            num_gpus=gpu0,
            max_concurrency=16,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
        ).remote(
            self.url, self.queue, rid, dataclasses.asdict(self.engine), dataclasses.asdict(self.settings),
            dataclasses.asdict(self.weights) if self.weights is not None else None,
        )
        ref = actor.run.remote()
        return _Replica(rid, index, pg, actor, ref, restarts)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, wait_ready: bool = True, timeout: float = 900) -> RayLauncher:
        import ray

        if not ray.is_initialized():
            ray.init(**{"ignore_reinit_error": True, "log_to_driver": True, **self.ray_init_kwargs})
        for i in range(self.num_replicas):
            rid = f"{self.name_prefix}-{i}"
            self.replicas[rid] = self._launch(rid, i)
        if wait_ready:
            ray.get([r.actor.ready.remote() for r in self.replicas.values()], timeout=timeout)
        log.info("%d replica(s) serving queue %r", len(self.replicas), self.queue)
        return self

    def check(self) -> list[str]:
        """Restart replicas whose actor died or whose run() ended. Returns the restarted ids."""
        import ray

        if self._stopping:
            return []
        refs = {r.run_ref: r for r in self.replicas.values()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        restarted = []
        for ref in done:
            rep = refs[ref]
            try:
                code = ray.get(ref)
                why = f"exited with {code}"
            except Exception as e:  # actor died (RayActorError) or run() raised
                why = f"died: {type(e).__name__}: {str(e)[:200]}"
            if rep.restarts >= self.max_restarts:
                log.error("replica %s %s; not restarting (max_restarts=%d)", rep.id, why, self.max_restarts)
                continue
            log.warning("replica %s %s; restarting", rep.id, why)
            self._teardown(rep)
            try:
                self.replicas[rep.id] = self._launch(rep.id, rep.index, rep.restarts + 1)
            except TimeoutError as e:  # its node is gone and none took its place yet
                log.error("%s; trying again at the next check", e)
                continue
            restarted.append(rep.id)
        return restarted

    def watch(self, interval: float = 2.0) -> None:
        """Block, restarting dead replicas, until :meth:`stop` is called (from another thread)."""
        while not self._stopping:
            self.check()
            time.sleep(interval)

    def info(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([r.actor.info.remote() for r in self.replicas.values()], timeout=30)

    def _teardown(self, rep: _Replica) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.kill(rep.actor, no_restart=True)
        except Exception:
            pass
        try:
            remove_placement_group(rep.pg)
        except Exception:
            pass

    def stop(self, timeout: float = 60.0) -> None:
        """Drain every replica (bounded by ``timeout``), then remove actors and placement groups."""
        import ray

        self._stopping = True
        reps = list(self.replicas.values())
        for r in reps:
            try:
                r.actor.stop.remote()
            except Exception:
                pass
        try:
            ray.wait([r.run_ref for r in reps], num_returns=len(reps), timeout=timeout)
        except Exception:
            pass
        for r in reps:
            self._teardown(r)
        self.replicas.clear()
