"""How to build one replica's vLLM ``AsyncLLM``: :class:`VllmEngineConfig`, read by the engine
adapter (:mod:`rollq.consumer.vllm_engine`) and turned into vLLM's engine arguments by
:mod:`rollq.consumer._vllm_api`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["VllmEngineConfig"]


@dataclass
class VllmEngineConfig:
    """How to build the ``AsyncLLM`` of one replica.

    >>> VllmEngineConfig(model="Qwen/Qwen2.5-7B", max_model_len=8192).tensor_parallel_size
    1
    """

    #: Model folder or hub name.
    model: str
    #: Tokenizer folder or name (default: the model's).
    tokenizer: str | None = None
    #: GPUs per replica (tensor parallel).
    tensor_parallel_size: int = 1
    #: dtype of the served weights. ``"auto"``: float32 on CPU (bf16 crashes vLLM's CPU
    #: attention); elsewhere the checkpoint's own dtype as its ``config.json`` gives it, so a
    #: float32 checkpoint is served in float32 on a GPU too (vLLM's own ``"auto"`` would serve
    #: it in bfloat16). Name ``"bfloat16"`` to serve a float32 checkpoint in bf16: the replica
    #: then accepts float32 versions and rounds them, and says so once in its log and in
    #: ``rollq status`` (``served_dtype``).
    dtype: str = "auto"
    #: Context window; None takes the model's.
    max_model_len: int | None = None
    #: GPU: fraction of device memory vLLM may use; with :attr:`kv_cache_memory_bytes` set,
    #: vLLM sizes nothing by it and only checks at start that this fraction of the device is
    #: free. None: 0.9, or :data:`KV_SIZED_START_CHECK` (0.1) when
    #: ``kv_cache_memory_bytes`` is set, so that a replica with a fixed KV size starts beside a
    #: trainer or another replica on the same GPU. CPU: fraction of RAM, only when no KV size
    #: is set (this adapter sets one on CPU).
    gpu_memory_utilization: float | None = None
    #: KV-cache size in bytes. None: vLLM's choice on GPU, :data:`~rollq.consumer._vllm_api.DEFAULT_CPU_KV_CACHE_BYTES`
    #: on CPU. vLLM versions without ``kv_cache_memory_bytes`` get ``VLLM_CPU_KVCACHE_SPACE``
    #: (GiB, rounded up) instead, unless that variable is already set; where it is set, vLLM
    #: 0.32's CPU backend lets it override this value.
    kv_cache_memory_bytes: int | None = None
    #: Skip CUDA graphs / torch.compile. None: True on CPU, where compiling costs more than it gains.
    enforce_eager: bool | None = None
    #: vLLM's global seed (per-request seeds come from the job's sampling params).
    seed: int = 0
    #: None keeps vLLM's default (on).
    enable_prefix_caching: bool | None = None
    #: Most sequences scheduled at once; None keeps the default ``vllm serve`` gets (the
    #: replica is built in its usage context): 1,024 on an H100 or H200, with 8,192 tokens a
    #: step (``engine_kwargs["max_num_batched_tokens"]`` sets that); 128 on CPU.
    max_num_seqs: int | None = None
    #: Dotted path of a class mixed into every vLLM worker (weight sync calls its methods by
    #: name through :meth:`~rollq.consumer.vllm_engine.VllmEngine.collective_rpc`).
    worker_extension_cls: str | None = None
    #: vLLM's default stat loggers. :meth:`~rollq.consumer.vllm_engine.VllmEngine.stats` works either way: its own stat
    #: logger switches statistics on.
    disable_log_stats: bool = False
    #: See the module docstring's length policy.
    truncate_generation: bool = False
    #: What the samples' logprobs are (vLLM's ``logprobs_mode``; each sample says which, see
    #: :class:`~rollq.protocol.LogprobSource`). ``"raw_logprobs"``: of the raw logits, the
    #: probabilities the tokens were sampled from only at temperature 1 with no top-p,
    #: top-k, min-p or penalties. ``"processed_logprobs"``: of the distribution the tokens
    #: were sampled from, after those; what a trainer needs at another temperature.
    logprobs_mode: str = "raw_logprobs"
    #: Any other ``AsyncEngineArgs`` field, passed as is (and checked against the installed
    #: vLLM's fields). The fields above that rollq resolves and relies on (``model``,
    #: ``tokenizer``, ``dtype``, ``tensor_parallel_size``, ``worker_extension_cls``,
    #: ``logprobs_mode``) are refused here: set them on this config.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


#: ``gpu_memory_utilization`` passed when the user sets ``kv_cache_memory_bytes`` and no
#: utilization: vLLM then uses it only for its start check (free memory >= this fraction of
#: the device), so it asks for a tenth rather than vLLM's 0.9, which would refuse to start
#: beside a trainer or another replica holding more than a tenth of the GPU.
KV_SIZED_START_CHECK = 0.1


def memory_utilization(cfg: VllmEngineConfig) -> float:
    """The ``gpu_memory_utilization`` vLLM gets for ``cfg``.

    >>> memory_utilization(VllmEngineConfig(model="m"))
    0.9
    >>> memory_utilization(VllmEngineConfig(model="m", kv_cache_memory_bytes=1 << 26))
    0.1
    >>> memory_utilization(VllmEngineConfig(model="m", kv_cache_memory_bytes=1 << 26, gpu_memory_utilization=0.5))
    0.5
    """
    if cfg.gpu_memory_utilization is not None:
        return cfg.gpu_memory_utilization
    return KV_SIZED_START_CHECK if cfg.kv_cache_memory_bytes is not None else 0.9
