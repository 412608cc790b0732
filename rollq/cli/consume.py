"""``rollq consume``: run one replica (:class:`~rollq.consumer.replica.Replica`)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..settings import ConsumerSettings
from .common import common_options


#: AsyncEngineArgs fields rollq consume sets from its own options (or must own, to label
#: results): ``--engine-arg`` refuses them, naming the option.
OWN_ENGINE_ARGS = {
    "model": "--model", "tensor_parallel_size": "--tensor-parallel-size", "dtype": "--dtype",
    "max_model_len": "--max-model-len", "enforce_eager": "--enforce-eager",
    "gpu_memory_utilization": "--gpu-memory-utilization", "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "worker_extension_cls": "--worker-extension", "logprobs_mode": "VllmEngineConfig.logprobs_mode (results are labelled with it)",
}


def engine_arg(text: str) -> tuple[str, Any]:
    """One ``--engine-arg KEY=VALUE``: any other field of vLLM's ``AsyncEngineArgs``, as vLLM's
    own CLI takes it, the value read as JSON where it parses (numbers, true/false, objects)
    and as a string otherwise; ``-`` in the key reads as ``_``. The engine refuses a field the
    installed vLLM lacks when it starts.

    >>> engine_arg("load-format=dummy"), engine_arg("max_num_seqs=512"), engine_arg("enable_prefix_caching=false")
    (('load_format', 'dummy'), ('max_num_seqs', 512), ('enable_prefix_caching', False))
    >>> engine_arg("dtype=float16")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: dtype is set by --dtype, not --engine-arg
    """
    import json

    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier() or len(text) > 4096:
        raise argparse.ArgumentTypeError(f"--engine-arg takes KEY=VALUE with KEY a field name, got {text[:100]!r}")
    if key in OWN_ENGINE_ARGS:
        raise argparse.ArgumentTypeError(f"{key} is set by {OWN_ENGINE_ARGS[key]}, not --engine-arg")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def make_engine(a: argparse.Namespace) -> Any:
    from ..consumer.engine import EchoEngine

    if a.engine == "echo":
        return EchoEngine(delay_per_token=a.echo_delay_ms / 1000.0)
    from ..consumer.vllm_config import VllmEngineConfig
    from ..consumer.vllm_engine import VllmEngine

    model = a.model
    if not model:
        from ..testing.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model())
    return VllmEngine(
        VllmEngineConfig(
            model=model, tensor_parallel_size=a.tensor_parallel_size, dtype=a.dtype,
            max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=getattr(a, "enforce_eager", None),
            kv_cache_memory_bytes=a.kv_cache_memory_bytes,
            # Following weight versions needs rollq's worker extension inside vLLM's workers.
            worker_extension_cls=a.worker_extension
            or ("rollq.weightsync.worker.ext.RollqWorkerExtension" if (a.weights_root or a.broadcast) else None),
            engine_kwargs=dict(getattr(a, "engine_arg", None) or []),
        )
    )


def consumer_settings(a: argparse.Namespace) -> ConsumerSettings:
    return ConsumerSettings(
        max_inflight=a.max_inflight, initial_inflight=a.initial_inflight,
        batch=a.batch, lease_ttl=a.lease_ttl, heartbeat_interval=min(1.0, a.lease_ttl / 4),
        max_deliveries=a.max_deliveries, drain_timeout=a.drain_timeout, shards=a.shards,
    )


def weight_settings(a: argparse.Namespace) -> Any:
    """The replica's :class:`~rollq.settings.WeightSyncSettings` from ``rollq consume``'s options."""
    from ..settings import WeightSyncSettings

    return WeightSyncSettings(root=a.weights_root, broadcast=a.broadcast, swap_overlap=a.swap_overlap, ipc_prestage=a.ipc_prestage,
                              ipc_high_priority=a.ipc_high_priority, ipc_direct=a.ipc_direct)


async def _consume(a: argparse.Namespace) -> int:
    from ..consumer.replica import Replica

    replica = Replica(make_engine(a), a.url, a.queue, consumer_id=a.id, settings=consumer_settings(a), weights=weight_settings(a))
    return await replica.run(burst=a.burst, install_signal_handlers=True)


def cmd_consume(a: argparse.Namespace) -> int:
    return asyncio.run(_consume(a))

def register(sub: Any) -> None:
    """Add consume to the ``rollq`` subcommands."""
    s = sub.add_parser("consume", help="run one replica")
    common_options(s)
    s.add_argument("--engine", choices=["echo", "vllm"], default="echo")
    s.add_argument("--id", default=None, help="replica id (default: host-random)")
    s.add_argument("--echo-delay-ms", type=float, default=0.0, help="echo engine: delay per generated token")
    s.add_argument("--model", default=None, help="vllm: model path (default: the locally built tiny model)")
    s.add_argument("--tensor-parallel-size", type=int, default=1)
    s.add_argument("--dtype", default="auto",
                   help="vllm: dtype to serve the weights in (auto: float32 on CPU, the checkpoint's own on GPU; "
                        "naming one also accepts policy versions of a wider dtype, rounded to it)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--enforce-eager", action="store_true", default=None,
                   help="vllm: no torch.compile or CUDA graphs (starts faster, decodes slower; the default on CPU)")
    s.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory for vLLM (default 0.9; 0.1, a start check only, with --kv-cache-memory-bytes)")
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vllm: KV cache size in bytes (instead of a share of device memory)")
    s.add_argument("--worker-extension", default=None, help="vllm worker_extension_cls (weight sync)")
    s.add_argument("--engine-arg", type=engine_arg, action="append", metavar="KEY=VALUE",
                   help="vllm: any other AsyncEngineArgs field (repeatable), e.g. load_format=dummy or max_num_seqs=512; "
                        "values read as JSON where they parse")
    s.add_argument("--weights-root", default=None, help="follow policy versions published under this memmap root")
    s.add_argument("--broadcast", action="store_true", help="also join the trainer's NCCL/gloo weight broadcasts")
    s.add_argument("--swap-overlap", action="store_true",
                   help="with --broadcast and the keep policy: swap a version in part by part while its last parts "
                        "arrive (shorter end to end, longer pause; see WeightSyncSettings(swap_overlap=True))")
    s.add_argument("--ipc-prestage", action="store_true",
                   help="the engine's workers start copying each version a trainer on this host exposes over IPC when it "
                        "is announced, without waiting for an engine call (see WeightSyncSettings(ipc_prestage=True))")
    s.add_argument("--ipc-high-priority", action="store_true",
                   help="IPC copies on a GPU run on a high-priority CUDA stream: the copy ends sooner while the engine's "
                        "steps during it slow down (see WeightSyncSettings(ipc_high_priority=True))")
    s.add_argument("--ipc-direct", action="store_true",
                   help="a version a trainer on this host leases over IPC is copied straight into the live weights at the "
                        "swap, not into the shadow first (see WeightSyncSettings(ipc_direct=True))")
    d = ConsumerSettings()  # the defaults below are the settings' own
    s.add_argument("--max-inflight", type=int, default=d.max_inflight, help="cap on running jobs (default: from the engine)")
    s.add_argument("--initial-inflight", type=int, default=d.initial_inflight)
    s.add_argument("--batch", type=int, default=d.batch, help="most jobs taken in one read (default: %(default)s)")
    s.add_argument("--lease-ttl", type=float, default=d.lease_ttl,
                   help="seconds before a silent replica's jobs are reclaimed (default: %(default)s)")
    s.add_argument("--max-deliveries", type=int, default=d.max_deliveries)
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="SIGTERM: seconds to finish running jobs (default: %(default)s)")
    s.add_argument("--burst", action="store_true", help="drain the queue, then exit")
    s.add_argument("--shards", type=int, default=None,
                   help="the queue's shard count (default: follow its record; see `rollq queue create`)")
    s.set_defaults(fn=cmd_consume)
