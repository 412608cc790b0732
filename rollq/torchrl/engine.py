"""TorchRL's vLLM engine interface on rollq replicas: :class:`AsyncVLLM`.

The one-line change for a TorchRL user::

    from torchrl.modules.llm import AsyncVLLM      # before
    from rollq.torchrl import AsyncVLLM            # after

``AsyncVLLM.from_pretrained(model, num_replicas=2)`` starts local replicas (and an embedded
Redis) as TorchRL's does; ``AsyncVLLM(url, queue=...)`` talks to replicas served elsewhere
(``rollq consume --engine vllm --weights-root ...``).

How TorchRL recognises it. TorchRL 0.14.1's ``vLLMWrapper`` accepts an engine by the name
and module of its class, not by its methods: ``type(m).__name__ == "AsyncVLLM"`` and
``type(m).__module__`` under ``torchrl.modules.llm.backends.vllm``. This class is named
``AsyncVLLM`` and declares its module as :data:`WRAPPER_MODULE` for that check; it pickles
by :meth:`AsyncVLLM.__reduce__` (through this module), so ``pickle``, ``cloudpickle`` and
Ray never look that module up. It subclasses TorchRL's ``RLvLLMEngine`` (what
``vLLMUpdaterV2`` checks with ``isinstance``), not TorchRL's ``AsyncVLLM``, whose Ray-actor
methods would not work here. ``tests/torchrl/test_engine.py`` fails when a TorchRL release
changes the check.

What differs from TorchRL's ``AsyncVLLM``: there is no ``actor_index`` (replicas pull from
the queue; ``replica=`` pins a request to one replica); ``timeout_seconds`` cancels the jobs,
which aborts their vLLM requests; each ``RequestOutput`` carries ``policy_version``,
``replica`` and ``rollq_result``; ``update_weights`` publishes a rollq policy version
(memmap, or a NCCL/gloo broadcast with ``transport=``) and returns once every live replica
serves it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import torch
from torchrl.modules.llm.backends.vllm import RLvLLMEngine

from ..errors import InvalidJob, WeightSyncError
from ..keys import QueueKeys
from ..producer.generate import RollqLLM
from ..protocol import Control, ReplicaInfo, control_message
from ..replicas import live_replicas
from ..settings import DEFAULT_QUEUE, RedisSettings
from .outputs import request_output

log = logging.getLogger(__name__)

__all__ = ["AsyncVLLM", "EngineConfig", "WRAPPER_MODULE"]

#: The module this engine's class declares (see the module docstring).
WRAPPER_MODULE = "torchrl.modules.llm.backends.vllm.rollq"
_TRANSPORTS = ("memmap", "nccl", "gloo")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`AsyncVLLM` is made from; what a pickled copy carries."""

    #: Redis URL of the queue (``redis://``, ``rediss://``, ``redis+cluster://``).
    url: str
    queue: str = DEFAULT_QUEUE
    #: memmap root the replicas follow (``rollq consume --weights-root``); needed by
    #: ``update_weights`` with ``transport="memmap"`` and as the fallback of a broadcast.
    weights_root: str | None = None
    #: ``memmap``, ``nccl`` (GPU tensors) or ``gloo`` (CPU) broadcast to replicas that run
    #: with ``--broadcast``.
    transport: str = "memmap"
    #: Tokenizer folder for :meth:`AsyncVLLM.get_tokenizer` (default: the replicas' model).
    tokenizer: str | None = None
    #: Seconds ``update_weights`` waits for every live replica to serve the new version.
    update_timeout: float = 120.0
    #: ``update_weights`` returns only once the replicas serve the version (False: once it is
    #: published; results say which version made them either way).
    wait_for_replicas: bool = True
    #: Broadcast group address replicas connect to (this machine's, reachable from them).
    broadcast_host: str = "127.0.0.1"
    broadcast_port: int = 0
    #: Extra :class:`~rollq.producer.client.Producer` keyword arguments.
    producer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {_TRANSPORTS}, got {self.transport!r}")


class AsyncVLLM(RLvLLMEngine):
    """rollq replicas behind TorchRL's engine interface (see the module docstring).

    >>> engine = AsyncVLLM("redis://127.0.0.1:6379/0", queue="grpo", weights_root="/dev/shm/w")  # doctest: +SKIP
    >>> policy = vLLMWrapper(engine, input_mode="text", num_samples=4)                       # doctest: +SKIP
    >>> vLLMUpdaterV2(engine).push_weights_from_transformers(model)  # a new policy version    # doctest: +SKIP
    """

    def __init__(
        self,
        url: str | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        weights_root: str | None = None,
        transport: str = "memmap",
        tokenizer: Any = None,
        update_timeout: float = 120.0,
        wait_for_replicas: bool = True,
        broadcast_host: str = "127.0.0.1",
        broadcast_port: int = 0,
        **producer_kwargs: Any,
    ):
        tok_path = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else None
        if transport in ("nccl", "gloo") and not broadcast_port:
            from ..weightsync.process_group import free_port

            broadcast_port = free_port(broadcast_host)  # vLLMUpdaterV2 asks for it before init
        self._init(EngineConfig(
            url=RedisSettings.from_url(url).full_url, queue=queue, weights_root=weights_root, transport=transport,
            tokenizer=str(tok_path) if tok_path else None, update_timeout=update_timeout,
            wait_for_replicas=wait_for_replicas, broadcast_host=broadcast_host, broadcast_port=broadcast_port,
            producer=dict(producer_kwargs),
        ))
        if tokenizer is not None and tok_path is None:
            self._tokenizer = tokenizer

    def _init(self, config: EngineConfig) -> None:
        self.config = config
        self._llm: RollqLLM | None = None
        self._publisher: Any = None
        self._tokenizer: Any = None
        self._local: Any = None  # LocalReplicas started by from_pretrained (not pickled)
        self._group_open = False
        self._client: Any = None
        self._keys = QueueKeys(config.queue)
        self._output_hooks: list[Callable[[list[Any]], Any]] = []
        #: The policy version the last ``update_weights`` published (0: none yet).
        self.version = 0

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model_name: str,
        num_devices: int | None = None,
        num_replicas: int = 1,
        verbose: bool = True,
        compile: bool = True,
        *,
        url: str | None = None,
        queue: str = "torchrl",
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        startup_timeout: float = 600.0,
        **kwargs: Any,
    ) -> AsyncVLLM:
        """Start ``num_replicas`` local replicas of ``model_name`` (a model folder: rollq never
        downloads) as ``rollq consume`` processes, and an embedded redis-server unless
        ``url`` is given; :meth:`shutdown` stops what this started.

        ``num_devices`` is each replica's tensor-parallel size. ``compile`` and ``verbose``
        are accepted for TorchRL's signature (vLLM compiles as configured; progress goes to
        logging). Other keyword arguments go to :class:`AsyncVLLM`.
        """
        from .local import LocalReplicas

        local = LocalReplicas(
            model_name, num_replicas=num_replicas, url=url, queue=queue, tensor_parallel_size=num_devices or 1,
            max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, broadcast=kwargs.get("transport", "memmap") != "memmap",
        )
        local.start(timeout=startup_timeout)
        try:
            kwargs.setdefault("tokenizer", model_name)
            engine = cls(local.url, queue, weights_root=local.weights_root, **kwargs)
        except BaseException:
            local.stop()
            raise
        engine._local = local
        return engine

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """A copy in another process (a Ray actor) reconnects to the same queue; the replicas
        this engine started stay owned by this one."""
        return (_rebuild, (self.config,))

    # -- the connection, made lazily (so a copy connects in its own process) --------------
    @property
    def llm(self) -> RollqLLM:
        """The blocking rollq client that jobs go through."""
        if self._llm is None:
            self._llm = RollqLLM(self.config.url, self.config.queue, **self.config.producer)
        return self._llm

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return self.llm.producer.call(coro, timeout)

    async def _redis(self) -> Any:
        if self._client is None:
            from ..connection import connect

            self._client = connect(RedisSettings.from_url(self.config.url))
        return self._client

    # -- generation ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Any = None,
        sampling_params: Any = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        guided_options_request: Any = None,
        timeout_seconds: float | None = None,
        actor_index: int | None = None,
        replica: str | None = None,
        min_version: int | None = None,
    ) -> Any:
        """TorchRL's ``AsyncVLLM.generate``: one ``vllm.RequestOutput`` per prompt (a list for a
        batch), blocking until all are in.

        Prompts: ``str``, ``TokensPrompt`` / ``TextPrompt`` dicts, token-id lists, or a list
        of those. Every ``vllm.SamplingParams`` field is carried to the replicas or refused
        with :class:`~rollq.errors.InvalidJob` (see
        :func:`rollq.producer.generate.sampling_to_dict`); so are the options below that rollq
        has no counterpart for. ``replica`` pins the requests to one replica; ``min_version``
        waits for a replica serving that policy version.
        """
        for name, value in (("lora_request", lora_request), ("prompt_adapter_request", prompt_adapter_request),
                            ("guided_options_request", guided_options_request)):
            if value is not None:
                raise InvalidJob(f"generate({name}=...) is not supported by rollq replicas")
        if actor_index is not None:
            raise InvalidJob(
                "generate(actor_index=...): rollq replicas pull from the queue, there is no actor index; "
                "pass replica='<replica id>' to pin a request to one replica (AsyncVLLM.replicas() lists them)"
            )
        batch, done = self.llm.run(prompts, sampling_params, prompt_token_ids=prompt_token_ids,
                                   timeout_seconds=timeout_seconds, replica=replica, min_version=min_version)
        outs = [request_output(r, text, ids) for r, text, ids in done]
        for hook in self._output_hooks:
            hook(outs)
        return outs if batch else outs[0]

    def add_output_hook(self, hook: Callable[[list[Any]], Any]) -> None:
        """Call ``hook(outputs)`` with every ``generate`` call's ``RequestOutput`` list, in this
        process: ``vLLMWrapper`` keeps tokens and logprobs and drops rollq's
        ``policy_version`` and ``replica``, which a hook can keep (copies made by pickling
        start without hooks).

        >>> versions = []                                                              # doctest: +SKIP
        >>> engine.add_output_hook(lambda outs: versions.append([o.policy_version for o in outs]))  # doctest: +SKIP
        """
        self._output_hooks.append(hook)

    def get_tokenizer(self) -> Any:
        """The replicas' tokenizer (``tokenizer=`` given at construction, else the model
        folder the live replicas serve, loaded with ``transformers.AutoTokenizer``)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = self.config.tokenizer or self._served_model()
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer

    def _served_model(self) -> str:
        models = {r.model for r in self.replicas().values() if r.model}
        if not models:
            raise WeightSyncError(
                f"no live replica of queue {self.config.queue!r} to take the tokenizer from; pass tokenizer="
            )
        if len(models) > 1:
            raise WeightSyncError(f"replicas of queue {self.config.queue!r} serve different models: {sorted(models)}")
        return models.pop()

    def replicas(self) -> dict[str, ReplicaInfo]:
        """``{replica id: ReplicaInfo}`` of the live replicas of the queue."""
        return self._run(self._live())

    async def _live(self) -> dict[str, ReplicaInfo]:
        return await live_replicas(await self._redis(), self._keys)

    @property
    def num_replicas(self) -> int:
        """Live replicas of the queue now (they come and go; rollq balances by pull)."""
        return len(self.replicas())

    # -- RLvLLMEngine: weight sync ---------------------------------------------------------------
    def publisher(self) -> Any:
        """The :class:`~rollq.weightsync.trainer.publisher.WeightPublisher` behind ``update_weights``."""
        if self._publisher is None:
            from ..weightsync.trainer.publisher import WeightPublisher

            c = self.config
            sender = None
            if c.transport in ("nccl", "gloo"):
                from ..weightsync.nccl import BroadcastSender

                sender = BroadcastSender(max(1, self.get_tp_size() * self.num_replicas), backend=c.transport,
                                         host=c.broadcast_host, port=c.broadcast_port, timeout=c.update_timeout)
            self._publisher = WeightPublisher(c.url, c.queue, root=c.weights_root, sender=sender, trainer_id="torchrl")
        return self._publisher

    def get_tp_size(self) -> int:
        """Tensor-parallel size of the replicas (the largest among live ones; 1 when none)."""
        return max((r.tp_size for r in self.replicas().values()), default=1)

    def get_model_metadata(self) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """``{name: (dtype, shape)}`` of the served checkpoint, from the manifests the live
        replicas published (``update_weights`` checks state dicts against them)."""
        manifests = self._run(self.publisher().served_manifests())
        if not manifests:
            log.warning("no live replica of queue %r published its checkpoint manifest; no model metadata", self.config.queue)
            return {}
        m = next(iter(manifests.values()))
        return {t.name: (getattr(torch, t.dtype), torch.Size(t.shape)) for t in m.tensors}

    def get_master_address(self) -> str:
        """The broadcast group's address (``transport`` nccl/gloo); with memmap, the Redis
        host that records versions (no process group is formed)."""
        if self.config.transport == "memmap":
            return urlsplit(self.config.url).hostname or "127.0.0.1"
        return self.config.broadcast_host

    def get_master_port(self) -> int:
        """The broadcast group's port; with memmap, the Redis port (see :meth:`get_master_address`)."""
        if self.config.transport == "memmap":
            return urlsplit(self.config.url).port or 6379
        return self.config.broadcast_port

    def init_weight_update_group(self) -> None:
        """Broadcast: form the group with every worker of the live replicas (they join it
        through Redis). memmap: check that ``weights_root`` is set and create it."""
        c = self.config
        if c.transport == "memmap":
            if not c.weights_root:
                raise WeightSyncError(
                    "update_weights over memmap needs weights_root= (the folder the replicas follow: "
                    "rollq consume --weights-root)"
                )
            os.makedirs(c.weights_root, exist_ok=True)
            return
        pub = self.publisher()
        self._run(pub.sender.group.open(self._run(pub.redis()), pub.keys))
        self._group_open = True

    def update_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish ``weights`` as the next policy version; with ``wait_for_replicas`` (the
        default) return once every live replica serves it.

        A state dict that does not match the served model raises
        :class:`~rollq.errors.WeightMismatch` before anything is written; a replica that
        cannot load the version raises :class:`~rollq.errors.WeightLoadFailed`.
        """
        c = self.config
        items = [(name, t.detach()) for name, t in weights]
        pub = self.publisher()
        rec = self._run(pub.publish_weights(items, transport=c.transport))
        log.info("published policy version %d of queue %r (%s)", rec.version, c.queue, rec.transport)
        if c.wait_for_replicas:
            self._run(pub.wait_for_replicas(rec.version, timeout=c.update_timeout))
        self.version = rec.version

    def set_staleness_bound(self, max_lag: int | None, batch: int | None = None) -> None:
        """Bound off-policy lag at submission: at most ``(max_lag + version + 1) * batch`` jobs
        of the queue are ever admitted (``batch``: jobs trained on per version; ``None``
        removes the bound). See :meth:`rollq.producer.client.Producer.set_staleness_bound`."""
        self._run(self.llm.producer.producer.set_staleness_bound(max_lag, batch))

    def current_version(self) -> int:
        """The queue's recorded policy version."""
        return self._run(self.publisher().current_version())

    def reset_prefix_cache(self) -> int:
        """Ask every replica to drop its prefix cache (a pub/sub hint; loading a version
        drops it anyway, so results never mix prefixes of two versions). Returns how many
        replica connections received the hint."""
        async def publish() -> int:
            return int(await (await self._redis()).publish(self._keys.control, control_message(Control.RESET_PREFIX_CACHE)))

        return self._run(publish())

    # -- lifetime ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the connection; stop the replicas and Redis that :meth:`from_pretrained` started."""
        try:
            if self._publisher is not None and self._llm is not None:
                pub, self._publisher = self._publisher, None
                self._run(pub.close(), timeout=10)
                if pub.sender is not None:
                    pub.sender.close()
            if self._client is not None and self._llm is not None:
                client, self._client = self._client, None
                self._run(client.aclose(), timeout=10)
            if self._llm is not None:
                llm, self._llm = self._llm, None
                llm.close()
        finally:
            if self._local is not None:
                local, self._local = self._local, None
                local.stop()

    def with_config(self, **changes: Any) -> AsyncVLLM:
        """A new engine on the same queue with some :class:`EngineConfig` fields changed."""
        return _rebuild(replace(self.config, **changes))

    def __enter__(self) -> AsyncVLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"rollq.torchrl.AsyncVLLM(queue={self.config.queue!r}, transport={self.config.transport!r})"


AsyncVLLM.__module__ = WRAPPER_MODULE


def _rebuild(config: EngineConfig) -> AsyncVLLM:
    engine = AsyncVLLM.__new__(AsyncVLLM)
    engine._init(config)
    return engine
