"""The trainer's side of ``rollq serve --weight-transfer gloo``: a CPU trainer (or a test)
joins as rank 0 and broadcasts in vLLM's packed format.

The two functions have the signatures of the vLLM helpers TRL's ``VLLMClient`` calls for
NCCL (``nccl_common.trainer_init`` and ``packed_tensor.packed_nccl_broadcast_producer``,
which need CUDA), so a CPU trainer speaks the same HTTP sequence with gloo underneath.

>>> info = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2,
...         "packed": True}
>>> # POST /init_weight_transfer_engine {"init_info": info} in a thread, then:
>>> group = trainer_init(info)                                                      # doctest: +SKIP
>>> # POST /update_weights {"update_info": {names, dtype_names, shapes}} in a thread, then:
>>> packed_broadcast_producer(iter(model.named_parameters()), group, 0, lambda it: it[1].data)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from .weight_group import DEFAULT_BUFFER_BYTES, GlooGroup

#: Seconds a trainer's rendezvous or broadcast may take (as the server's default).
DEFAULT_TIMEOUT_S = 300.0


def trainer_init(init_info: dict[str, Any], rank: int = 0, timeout: float = DEFAULT_TIMEOUT_S) -> GlooGroup:
    """Host the rendezvous at ``master_address:master_port`` and join the gloo group as ``rank``."""
    return GlooGroup(init_info["master_address"], int(init_info["master_port"]), rank, int(init_info["world_size"]), timeout)


def packed_broadcast_producer(iterator: Iterator[tuple[str, torch.Tensor]], group: Any, src: int,
                              post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
                              buffer_size_bytes: int = DEFAULT_BUFFER_BYTES, num_buffers: int = 2) -> None:
    """Broadcast the tensors of ``iterator`` from ``src`` in vLLM's packed chunks (vLLM's own
    ``pack_tensors`` forms them; ``num_buffers`` is accepted for the signature: gloo sends one
    chunk at a time)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    while True:
        chunk = pack_tensors(iterator, lambda item: post_iter_func(item).cpu(), buffer_size_bytes)
        if chunk is None:
            return
        group.broadcast(chunk.packed_tensor, src=src)
