"""A trainer's weight updates, received by ``rollq serve`` and published as rollq versions.

TRL's ``VLLMClient`` drives vLLM's development-mode weight transfer: init (the trainer forms a
group; the server joins it), start, one or more ``update_weights`` (the server receives a
packed broadcast, :mod:`rollq.serve.weight_group`), finish. :class:`WeightReceiver` is the
server's side of that sequence. It is the one receiving rank (``/get_world_size`` says 1),
keeps the full state of the served model on the CPU (read from the model folder's safetensors
at startup), merges each update into it (an update may name a subset of the tensors) and, on
finish, publishes the merged state as ONE rollq version through
:class:`~rollq.weightsync.trainer.publisher.WeightPublisher` (memmap transport into the store
the replicas read), so every replica behind the queue loads it by rollq's normal path and the
version is recorded durably.

What is refused, as vLLM's server refuses it (a message and a status, no state changed):
update or finish without start (500, vLLM's messages), start twice (500), an ``update_info``
that does not describe its bytes (400; the group is dropped, since the trainer's broadcast
cannot be matched), names the model does not have, or a shape or dtype the model does not
serve (400 after the bytes were received, so the group stays usable; the update is dropped).
A receive that fails or outlasts ``timeout`` (a trainer that died or stalled) ends the update
with 500 or 504 and drops the group; the server keeps serving completions meanwhile.

>>> cfg = WeightTransferConfig(backend="gloo", root="/dev/shm/rollq-weights", model="/models/tiny")  # doctest: +SKIP
>>> rx = WeightReceiver(cfg, publisher)                                                          # doctest: +SKIP
>>> await rx.load_base()                                                                         # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from ..errors import StaleVersion, WeightMismatch
from ..weightsync.manifest import Manifest, model_dir, normalize
from ..weightsync.versions import TensorMeta, VersionRecord
from .errors import WeightTransferError, WeightTransferTimeout, WeightUpdateRefused
from .weight_group import BACKENDS, Group, InitInfo, Meta, chunk_plan, nbytes, open_group

log = logging.getLogger(__name__)

@dataclass
class WeightTransferConfig:
    """``rollq serve --weight-transfer BACKEND``.

    Args:
        backend: ``nccl`` (the trainer's CUDA NCCL group; TRL's client) or ``gloo`` (CPU).
        root: the memmap store the replicas read (their ``WeightSyncSettings.root``).
        model: the served model's folder (safetensors): the full state updates merge into.
            None: the first update is published as it comes (the publisher still checks it
            against the replicas' checkpoint manifests) and becomes the state later ones merge into.
        timeout: seconds a rendezvous or one update's receive may take.
        device: the CUDA device the nccl backend receives on (default: the current one).
    """

    backend: str
    root: str
    model: str | None = None
    timeout: float = 300.0
    device: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight transfer backend {self.backend!r} is not one of {BACKENDS}")


#: Bounds of one ``update_info`` (checked before anything is received or allocated).
MAX_UPDATE_TENSORS = 100_000
MAX_DIMS = 8
#: Without the served model's state, the most one update may carry.
MAX_UPDATE_BYTES = 1 << 40


class UpdateInfo(msgspec.Struct, kw_only=True):
    """``update_info`` of ``POST /update_weights`` (vLLM's ``NCCLWeightTransferUpdateInfo``;
    ``packed`` here is how vLLM before 0.28 said it, per update)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None

    def metas(self) -> list[Meta]:
        """``(name, shape, dtype)`` per tensor; ValueError names what does not describe bytes.

        >>> UpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]]).metas()
        [('a', [2], torch.float32)]
        >>> UpdateInfo(names=["a"], dtype_names=["nope"], shapes=[[2]]).metas()
        Traceback (most recent call last):
        ...
        ValueError: update_info.dtype_names[0]: 'nope' is not a torch dtype
        """
        n = len(self.names)
        if n > MAX_UPDATE_TENSORS:
            raise ValueError(f"update_info.names: {n} tensors in one update (at most {MAX_UPDATE_TENSORS})")
        if len(self.dtype_names) != n:
            raise ValueError(f"`dtype_names` should be of the same size as `names`: got {len(self.dtype_names)} and {n}")
        if len(self.shapes) != n:
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(self.shapes)} and {n}")
        out: list[Meta] = []
        for i, (name, dn, shape) in enumerate(zip(self.names, self.dtype_names, self.shapes)):
            dtype = getattr(torch, dn, None) if dn.isidentifier() else None
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"update_info.dtype_names[{i}]: {dn[:40]!r} is not a torch dtype")
            if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
                raise ValueError(f"update_info.shapes[{i}]: {shape[:MAX_DIMS + 1]} has a negative dimension or more "
                                 f"than {MAX_DIMS}")
            out.append((name, list(shape), dtype))
        if len(set(self.names)) != n:
            raise ValueError("update_info.names: a name appears twice")
        return out


def receive(group: Group, metas: list[Meta], packed: bool, buffer_size_bytes: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one update, received from rank 0 of ``group`` (blocking), on the CPU.

    Packed: one broadcast per chunk of :func:`~rollq.serve.weight_group.chunk_plan` into a
    uint8 buffer, unpacked with vLLM's ``unpack_tensor``; else one broadcast per tensor, as
    vLLM's NCCL engine receives without packing.
    """
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    out: list[tuple[str, torch.Tensor]] = []
    if not packed:
        for name, shape, dtype in metas:
            t = torch.empty(shape, dtype=dtype, device=device)
            group.broadcast(t, src=0)
            out.append((name, t.cpu()))
        return out
    for chunk in chunk_plan(metas, buffer_size_bytes):
        sizes = [nbytes(s, d) for _, s, d in chunk]
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        group.broadcast(buf, src=0)
        buf = buf.cpu()
        out += unpack_tensor(buf, [n for n, _, _ in chunk], [s for _, s, _ in chunk], [d for _, _, d in chunk], sizes)
    return out


def load_state(model: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of ``model`` (a folder or a cached hub name).

    >>> load_state("/no/such/model")
    Traceback (most recent call last):
    ...
    ValueError: --weight-model /no/such/model: no local folder with safetensors files
    """
    import json

    from safetensors.torch import load_file

    d = model_dir(model)
    files: list[Path] = []
    if d is not None:
        index = d / "model.safetensors.index.json"
        if index.is_file():  # sharded: the shards the index names (not consolidated.* copies), as read_manifest
            files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--weight-model {model}: no local folder with safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            state.setdefault(name, t)
    return state


class WeightReceiver:
    """The server side of one trainer's weight updates (see the module docstring).

    ``publisher``: a :class:`~rollq.weightsync.trainer.publisher.WeightPublisher` of the
    queue with ``root=config.root``.
    """

    def __init__(self, config: WeightTransferConfig, publisher: Any):
        self.config = config
        self.publisher = publisher
        self.state: dict[str, torch.Tensor] = {}
        self.manifest: Manifest | None = None
        self.info: InitInfo | None = None
        self.group: Group | None = None
        self.active = False
        self.pending: dict[str, torch.Tensor] = {}
        #: The last version this receiver published (0: none); later jobs need it.
        self.version = 0
        self._busy = asyncio.Lock()
        self._joining = False

    async def load_base(self) -> None:
        """Read the full state from ``config.model`` (nothing to read without one)."""
        if self.config.model is None:
            return
        self.state = await asyncio.to_thread(load_state, self.config.model)
        self._set_manifest()
        log.info("weight transfer: holding %d tensors of %s (%.1f MB) for partial updates", len(self.state),
                 self.config.model[:200], sum(t.nbytes for t in self.state.values()) / 1e6)

    def _set_manifest(self) -> None:
        metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in sorted(self.state.items())]
        self.manifest = Manifest(model=self.config.model or "the last published state", tensors=metas)

    def _drop_group(self) -> None:
        self.group, self.info = None, None

    def _end_update(self) -> None:
        self.active = False
        self.pending = {}

    async def _bounded(self, fn: Any, *args: Any, what: str) -> Any:
        """``fn(*args)`` in a thread, at most ``config.timeout`` seconds (the thread of a hung
        NCCL call cannot be stopped; the group is dropped and the error says so)."""
        t = self.config.timeout
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), t + 5.0)
        except asyncio.TimeoutError as e:
            raise WeightTransferTimeout(f"{what} timed out after {t:.0f}s (rollq serve --weight-timeout); "
                                        "the trainer's group is dropped: call /init_weight_transfer_engine again") from e

    # -- the routes ------------------------------------------------------------------------
    async def init(self, raw: Any) -> None:
        """Join the trainer's group (blocks until the trainer joined, at most the timeout)."""
        try:
            info = msgspec.convert(raw, InitInfo)
            info.check(ranks=1)
        except (msgspec.ValidationError, ValueError) as e:
            raise WeightUpdateRefused(f"init_info: {e}") from e
        if self._joining:
            raise WeightUpdateRefused("an /init_weight_transfer_engine is already waiting for the trainer")
        if self.active:
            raise WeightUpdateRefused("a weight update is in progress: call /finish_weight_update before joining a new group")
        self._joining = True
        self._drop_group()  # a trainer that initialises again replaces its old group
        t0 = time.perf_counter()
        try:
            group = await self._bounded(open_group, self.config.backend, info, info.rank_offset, self.config.timeout,
                                        self.config.device, what=f"joining the trainer's {self.config.backend} group "
                                        f"at {info.master_address[:100]}:{info.master_port}")
        except WeightTransferError:
            raise
        except Exception as e:  # noqa: BLE001 - any rendezvous failure is the route's 500
            if time.perf_counter() - t0 >= self.config.timeout:  # the store's or gloo's own bound
                raise WeightTransferTimeout(f"joining the trainer's group timed out after {self.config.timeout:.0f}s "
                                            f"(rollq serve --weight-timeout): {type(e).__name__}: {str(e)[:300]}") from e
            raise WeightTransferError(f"joining the trainer's {self.config.backend} group failed: {type(e).__name__}: {e}") from e
        finally:
            self._joining = False
        self.group, self.info = group, info
        log.info("weight transfer: joined the trainer's %s group as rank %d of %d", self.config.backend, info.rank_offset,
                 info.world_size)

    async def start(self) -> None:
        if self.active:
            raise WeightTransferError("start_weight_update called while a weight update is already active. "
                                      "Call finish_weight_update first.")
        self.active, self.pending = True, {}

    async def update(self, raw: Any) -> int:
        """Receive one update into the pending state; returns the tensors received."""
        if not self.active:
            raise WeightTransferError("start_weight_update must be called before update_weights.")
        if self.group is None or self.info is None:
            self._end_update()
            raise WeightTransferError("Weight transfer not initialized: call /init_weight_transfer_engine first.")
        async with self._busy:
            group, info = self.group, self.info
            try:
                upd = msgspec.convert(raw, UpdateInfo)
                metas = upd.metas()
            except (msgspec.ValidationError, ValueError) as e:
                self._end_update()
                self._drop_group()
                raise WeightUpdateRefused(f"update_info: {e} (the trainer's broadcast cannot be matched: the group is "
                                          "dropped, call /init_weight_transfer_engine again)") from e
            size = sum(nbytes(shape, dtype) for _, shape, dtype in metas)
            bound = self._max_update_bytes()
            if size > bound:
                self._end_update()
                self._drop_group()
                raise WeightUpdateRefused(f"update_info describes {size} bytes, more than {bound} (twice the served model's "
                                          "state, or 1 TiB without one): nothing is received, the group is dropped, call "
                                          "/init_weight_transfer_engine again")
            packed = info.packed if upd.packed is None else upd.packed
            device = torch.device(self.config.device or "cuda") if self.config.backend == "nccl" else torch.device("cpu")
            t0 = time.perf_counter()
            try:
                items = await self._bounded(receive, group, metas, packed, info.packed_buffer_size_bytes, device,
                                            what=f"receiving {len(metas)} tensors")
            except WeightTransferError:
                self._end_update()
                self._drop_group()
                raise
            except Exception as e:  # noqa: BLE001 - a broken peer: the group is unusable
                self._end_update()
                self._drop_group()
                if time.perf_counter() - t0 >= self.config.timeout:  # gloo's own bound
                    raise WeightTransferTimeout(f"receiving {len(metas)} tensors timed out after {self.config.timeout:.0f}s "
                                                "(rollq serve --weight-timeout); the trainer's group is dropped: call "
                                                "/init_weight_transfer_engine again") from e
                raise WeightTransferError(f"receiving the update failed ({type(e).__name__}: {str(e)[:300]}); the "
                                          "trainer's group is dropped: call /init_weight_transfer_engine again") from e
            self._check(items)
            log.info("weight transfer: received %d tensors (%.1f MB) in %.3fs", len(items),
                     sum(t.nbytes for _, t in items) / 1e6, time.perf_counter() - t0)
            return len(items)

    def _max_update_bytes(self) -> int:
        """The most one update may carry: twice the held state (a full update in a wider
        dtype is received, then refused by name), else :data:`MAX_UPDATE_BYTES`."""
        if not self.state:
            return MAX_UPDATE_BYTES
        return 2 * sum(t.nbytes for t in self.state.values()) + (1 << 20)

    def _check(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Rename ``items`` to the model's names into ``pending``, or refuse the whole update."""
        if self.manifest is None:
            self.pending.update(items)
            return
        renamed, problems = normalize(items, self.manifest)
        problems.missing = []  # an update may carry a subset
        if problems:
            self._end_update()
            raise WeightUpdateRefused(problems.describe("update_weights", self.manifest.model) + "; the update is dropped")
        self.pending.update(renamed)

    async def finish(self, weight_version: str | None = None) -> VersionRecord | None:
        """Publish the merged state as one rollq version (None: nothing was received)."""
        if not self.active:
            raise WeightTransferError("finish_weight_update called without a matching start_weight_update.")
        async with self._busy:
            pending = self.pending
            self._end_update()
            if not pending:
                return None
            version = None
            if weight_version is not None:
                if not weight_version.isdigit():
                    raise WeightUpdateRefused(f"weight_version {weight_version[:40]!r}: rollq versions are integers")
                version = int(weight_version)
            merged = {**self.state, **pending}
            try:
                rec: VersionRecord = await self.publisher.publish_weights(merged, version=version)
            except (WeightMismatch, StaleVersion) as e:
                raise WeightUpdateRefused(f"{e}; the update is dropped") from e
            except Exception as e:  # noqa: BLE001 - storage or Redis: the route's 500, with the cause
                raise WeightTransferError(f"publishing the update failed ({type(e).__name__}: {str(e)[:300]}); "
                                          "the update is dropped: send it again") from e
            self.state, self.version = merged, rec.version
            if self.manifest is None:
                self._set_manifest()
            return rec
