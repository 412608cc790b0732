"""TorchRL on rollq: TorchRL's ``vLLMWrapper``, ``vLLMUpdaterV2`` and collectors over rollq
replicas (extra ``rollq[torchrl]``, TorchRL 0.14.1).

>>> from rollq.torchrl import AsyncVLLM                       # was: from torchrl.modules.llm import AsyncVLLM
>>> engine = AsyncVLLM.from_pretrained(model_dir, num_replicas=2)   # doctest: +SKIP
>>> policy = vLLMWrapper(engine, input_mode="text", num_samples=4)  # doctest: +SKIP

- :class:`AsyncVLLM`: the engine (TorchRL's ``RLvLLMEngine``): ``generate`` through the
  queue, real ``vllm.RequestOutput`` objects back; ``update_weights`` publishes a rollq
  policy version; pickles into Ray actors, which reconnect.
- :func:`results_to_llm_tensordict`: rollq results in TorchRL's LLM layout (``tokens.*``,
  ``log_probs.*``, ``masks.*``), for losses such as ``GRPOLoss``.
- :class:`LocalReplicas`: the replica processes ``AsyncVLLM.from_pretrained`` starts.
"""

from .._torch_extras import hide_broken_torch_extras

hide_broken_torch_extras()  # before TorchRL imports vLLM and transformers (see rollq._torch_extras)

from .engine import WRAPPER_MODULE, AsyncVLLM, EngineConfig  # noqa: E402
from .layout import results_to_llm_tensordict  # noqa: E402
from .local import LocalReplicaFailed, LocalReplicas  # noqa: E402
from .outputs import request_output  # noqa: E402

__all__ = [
    # engine
    "AsyncVLLM", "EngineConfig", "WRAPPER_MODULE",
    # data
    "results_to_llm_tensordict", "request_output",
    # local replicas
    "LocalReplicas", "LocalReplicaFailed",
]
