"""The trainer's weight-update group as ``rollq serve`` joins it, and vLLM's packed wire format.

A TRL trainer (``VLLMClient.init_communicator``) is rank 0 of a group it forms with vLLM's
``StatelessProcessGroup`` rendezvous (a TCPStore the trainer hosts at
``master_address:master_port``); the receiving ranks join at ``rank_offset``. ``rollq serve``
is one receiving rank. Two backends carry the tensors:

- ``nccl``: vLLM's ``PyNcclCommunicator`` over the same rendezvous, exactly what vLLM's
  ``NCCLWeightTransferEngine`` builds (needs a CUDA device in this process);
- ``gloo``: a ``ProcessGroupGloo`` over the same TCPStore, for CPU trainers and tests.

Either object has ``broadcast(tensor, src=...)`` and ``group`` (the ``StatelessProcessGroup``),
the two things vLLM's packed producer and TRL's ``close_communicator`` use.

The packed format is vLLM's (``vllm.distributed.weight_transfer.packed_tensor``): tensors in
the order of the update's metadata, flattened to bytes and concatenated into chunks; a chunk
ends after the tensor that takes it past ``packed_buffer_size_bytes``; one broadcast per
chunk. :func:`chunk_plan` computes those boundaries from the metadata alone.

>>> import torch
>>> [[n for n, _, _ in c] for c in chunk_plan([("a", [4], torch.float32), ("b", [4], torch.float32),
...                                           ("c", [1], torch.float32)], buffer_size_bytes=16)]
[['a', 'b'], ['c']]
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Iterator, Protocol, Sequence

import msgspec
import torch

#: vLLM's default packed chunk size and buffer count (``DEFAULT_PACKED_*``).
DEFAULT_BUFFER_BYTES = 1 << 30
DEFAULT_NUM_BUFFERS = 2
#: Bounds of an ``init_info``: the packed chunk is allocated whole on the receiving side.
MAX_BUFFER_BYTES = 16 << 30
MAX_WORLD_SIZE = 1 << 16
#: The weight-transfer backends ``rollq serve`` joins a trainer's group with.
BACKENDS = ("nccl", "gloo")


class InitInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """``init_info`` of ``POST /init_weight_transfer_engine`` (vLLM's
    ``NCCLWeightTransferInitInfo``; the ``nccl_unique_id_b64`` rendezvous is not served)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    nccl_unique_id_b64: str | None = None

    def check(self, ranks: int) -> None:
        """ValueError unless ``ranks`` receiving ranks fit: rank_offset + ranks <= world_size."""
        if self.nccl_unique_id_b64:
            raise ValueError("init_info.nccl_unique_id_b64: rollq serve joins by master_address/master_port only")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"init_info.master_port {self.master_port} is not a TCP port")
        if self.rank_offset < 1 or self.rank_offset + ranks > self.world_size:
            raise ValueError(f"init_info: rank_offset {self.rank_offset} + {ranks} receiving rank(s) does not fit "
                             f"world_size {self.world_size} (the trainer is rank 0)")
        if not 1 <= self.packed_buffer_size_bytes <= MAX_BUFFER_BYTES:
            raise ValueError(f"init_info.packed_buffer_size_bytes must be 1-{MAX_BUFFER_BYTES} (a chunk is allocated whole)")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"init_info.world_size {self.world_size} is above {MAX_WORLD_SIZE}")


class Group(Protocol):
    """What the packed broadcast needs of a group (vLLM's ``PyNcclCommunicator`` has it)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any: ...


class GlooGroup:
    """A gloo process group over vLLM's ``StatelessProcessGroup`` rendezvous.

    ``timeout`` bounds every collective (and the rendezvous): a peer that stops sending makes
    :meth:`broadcast` raise instead of waiting forever.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float):
        from torch.distributed import PrefixStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                                  store_timeout=max(1, math.ceil(timeout)))
        self.rank = rank
        self._pg = ProcessGroupGloo(PrefixStore("rollq-gloo/", self.group.store), rank, world_size,
                                    timedelta(seconds=timeout))

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast ``tensor`` (a CPU tensor) from rank ``src``, in place; raises on timeout."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()
        return tensor


def open_group(backend: str, info: InitInfo, rank: int, timeout: float, device: str | None = None) -> Group:
    """Join the trainer's group as ``rank`` over ``backend`` (``nccl`` or ``gloo``); blocks
    until every rank joined (the trainer too), at most ``timeout`` seconds for gloo.

    >>> open_group("mpi", InitInfo(master_address="h", master_port=1, rank_offset=1, world_size=2), 1, 1.0)
    Traceback (most recent call last):
    ...
    ValueError: weight transfer backend 'mpi' is not one of ('nccl', 'gloo')
    """
    if backend == "gloo":
        return GlooGroup(info.master_address, info.master_port, rank, info.world_size, timeout)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        dev = torch.device(device or "cuda")
        if dev.type != "cuda":
            raise ValueError(f"the nccl weight transfer needs a CUDA device, got {dev}")
        return stateless_init_process_group(info.master_address, info.master_port, rank, info.world_size,
                                            device=dev.index if dev.index is not None else torch.cuda.current_device())
    raise ValueError(f"weight transfer backend {backend!r} is not one of {BACKENDS}")


#: One tensor of an update: (name, shape, dtype).
Meta = tuple[str, list[int], torch.dtype]


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def chunk_plan(metas: Sequence[Meta], buffer_size_bytes: int) -> Iterator[list[Meta]]:
    """The chunks of a packed broadcast, as vLLM's ``packed_nccl_broadcast_consumer`` and
    ``pack_tensors`` split it: a chunk closes after the tensor that takes it past
    ``buffer_size_bytes``."""
    chunk: list[Meta] = []
    size = 0
    for m in metas:
        chunk.append(m)
        size += nbytes(m[1], m[2])
        if size > buffer_size_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
