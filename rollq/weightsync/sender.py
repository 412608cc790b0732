"""Trainer side of the broadcast: rank 0 of the group, one offer and one broadcast per version.

Runs in the trainer's process, driven by :class:`~rollq.weightsync.publisher.WeightPublisher`
(``sender=``). The protocol of one update is in :mod:`rollq.weightsync.nccl`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

import msgspec
import torch

from ..errors import WeightSyncError, WeightSyncTimeout
from ..protocol import Control, control_message
from .checksum import state_checksum
from .layout import Layout, groups_of
from .transport import Group, free_port, in_daemon_thread, make_group, wait_stream
from .versions import TensorMeta, VersionRecord
from .wire import Ack, FlatLayout, GroupInfo, Mode, Offer, decode_ack, manifest_digest

log = logging.getLogger(__name__)


class BroadcastSender:
    """Rank 0 of the weight broadcast group (use with WeightPublisher(sender=...)).

    Args:
        num_workers: vLLM workers that will join (sum of tensor-parallel sizes of replicas).
        backend: ``nccl`` (GPU tensors) or ``gloo`` (CPU).
        host: address replicas connect to (this machine's, reachable from them).
        bucket_bytes: bytes per broadcast in ``packed`` mode (two buffers of it are allocated).
        group_bytes: ``direct`` mode on NCCL: tensors sent as one coalesced NCCL group, up to
            this many bytes (0: one launch per tensor; see :class:`~rollq.weightsync.wire.Offer`).
        timeout: seconds for group formation, each broadcast and the acks.
        mode: a :class:`~rollq.weightsync.wire.Mode`; default ``direct`` on NCCL (no packing
            copy), ``packed`` on gloo.
        verify: checksum the tensors on both sides (two extra passes over the weights).
        min_ctas: NCCL CTAs (channels) per collective on every rank (see
            :class:`~rollq.weightsync.wire.GroupInfo`).
        shadow_layout: in ``direct`` mode, once every receiver has reported the same flat
            layout of its shadow weights for the manifest, send ``layout`` offers instead (a
            few bucket transfers per version). It costs one Redis read per send, and falls
            back to ``direct`` while the reports are missing or disagree.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        backend: str = "nccl",
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = 1 << 30,
        timeout: float = 60.0,
        device: str | torch.device | None = None,
        mode: str | None = None,
        verify: bool = False,
        group_bytes: int = 4 << 30,
        min_ctas: int = 0,
        shadow_layout: bool = True,
    ):
        if backend not in ("nccl", "gloo"):
            raise ValueError("backend must be 'nccl' or 'gloo'")
        self.mode = Mode(mode) if mode else (Mode.DIRECT if backend == "nccl" else Mode.PACKED)
        self.verify = verify
        self.num_workers = num_workers
        self.backend = backend
        self.host = host
        self.port = port
        self.bucket_bytes = bucket_bytes
        self.group_bytes = group_bytes if backend == "nccl" else 0
        self.min_ctas = min_ctas
        self.shadow_layout = shadow_layout
        self.timeout = timeout
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self.info: GroupInfo | None = None
        self.pg: Group | None = None
        self._bufs: list[torch.Tensor] = []
        self.last_timings: dict[str, float] = {}

    # -- the group ---------------------------------------------------------------------------
    async def open(self, client: Any, keys: Any) -> GroupInfo:
        """Create the group and wait (``timeout``) until every worker has joined."""
        info = GroupInfo(
            id=uuid.uuid4().hex[:12], host=self.host, port=self.port or free_port(self.host),
            world_size=self.num_workers + 1, backend=self.backend, timeout=self.timeout, min_ctas=self.min_ctas,
        )
        await client.delete(keys.weights_group, keys.weights_layouts)  # new ranks report anew
        await client.hset(keys.weights_group, mapping={"d": msgspec.msgpack.encode(info), "next_rank": 1})
        await client.publish(keys.control, control_message(Control.WGROUP, info.id))
        try:
            self.pg = await asyncio.wait_for(in_daemon_thread(self._form, info), self.timeout + 5)
        except (asyncio.TimeoutError, RuntimeError) as e:
            await client.delete(keys.weights_group)
            raise WeightSyncTimeout(
                f"{self.num_workers} workers did not all join broadcast group {info.id} within {self.timeout}s (timeout)"
            ) from e
        self.info = info
        log.info("broadcast group %s ready: %d workers over %s", info.id, self.num_workers, self.backend)
        return info

    def _form(self, info: GroupInfo) -> Group:
        pg = make_group(info, 0, self.device)
        pg.prove(self.device, info.timeout)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return pg

    async def reset(self) -> None:
        """Drop the group (after a failure); the next send forms a new one."""
        pg, self.pg, self.info = self.pg, None, None
        if pg is not None:
            await in_daemon_thread(pg.abort)

    def close(self) -> None:
        self.pg = None
        self._bufs = []

    # -- one version ---------------------------------------------------------------------------
    async def send(self, version: int, items: list[tuple[str, torch.Tensor]], client: Any, keys: Any) -> VersionRecord:
        """Broadcast ``items`` as ``version``; returns the record to commit once all acked."""
        if self.pg is None:
            await self.open(client, keys)
        assert self.info is not None
        from .memmap import manifest_of

        t0 = time.perf_counter()
        manifest = manifest_of(items)
        checksum = state_checksum(items) if self.verify else ""
        t_ck = time.perf_counter() - t0
        offer = await self._offer(version, manifest, checksum, client, keys)
        await self._announce(offer, client, keys)
        t1 = time.perf_counter()
        if offer.mode is Mode.DIRECT:
            send = self._broadcast_direct
        else:
            layout = Layout.explicit(offer.offsets, offer.total, self.bucket_bytes) if offer.mode is Mode.LAYOUT else None
            send = functools.partial(self._broadcast_all, layout=layout)
        await asyncio.wait_for(in_daemon_thread(send, items, manifest), self.timeout * 4)
        t2 = time.perf_counter()
        acks = await self._wait_acks(client, offer.acks, offer.ack_signal, version)
        t3 = time.perf_counter()
        self.last_timings = {"checksum_s": t_ck, "broadcast_s": t2 - t1, "acks_s": t3 - t2, "send_s": t3 - t0,
                             "layout_mode": float(offer.mode is Mode.LAYOUT), **receiver_timings(list(acks.values()))}
        pipe = client.pipeline(transaction=False)
        pipe.expire(offer.acks, 3600)
        pipe.delete(offer.ack_signal)
        await pipe.execute()
        return VersionRecord(
            version=version, transport="nccl", checksum=checksum, num_tensors=len(items), nbytes=sum(m.nbytes for m in manifest),
            group=self.info.id, timings=dict(self.last_timings, replicas=float(len(acks))),
        )

    async def _offer(self, version: int, manifest: list[TensorMeta], checksum: str, client: Any, keys: Any) -> Offer:
        assert self.info is not None
        mode, flat = self.mode, None
        if self.shadow_layout and mode is Mode.DIRECT:
            flat = await self._agreed_layout(client, keys, manifest)
            if flat is not None:
                mode = Mode.LAYOUT
        return Offer(
            version=version, group=self.info.id, checksum=checksum, bucket_bytes=self.bucket_bytes,
            manifest=manifest, timeout=self.timeout, mode=mode, acks=keys.weights_acks(version),
            ack_signal=keys.weights_ack_signal(version), group_bytes=self.group_bytes,
            offsets=flat.offsets if flat else [], total=flat.total if flat else 0,
        )

    async def _announce(self, offer: Offer, client: Any, keys: Any) -> None:
        """Write the offer (no acks left from an earlier try) and hint it on pub/sub."""
        pipe = client.pipeline(transaction=False)
        pipe.delete(offer.acks, offer.ack_signal)
        pipe.hset(keys.weights_offer, mapping={"v": offer.version, "d": msgspec.msgpack.encode(offer)})
        # cluster pipelines refuse pipe.publish
        pipe.execute_command("PUBLISH", keys.control, control_message(Control.WOFFER, offer.version))
        await pipe.execute()

    def _broadcast_all(
        self, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta], layout: Layout | None = None
    ) -> None:
        """Pack into two alternating bucket buffers and broadcast each bucket, at the offsets
        of ``layout`` (default: the manifest's own, :meth:`Layout.of`).

        On GPUs everything is stream-ordered: packing bucket i+1 overlaps the broadcast of
        bucket i, and a buffer is repacked only after its previous broadcast completed.
        """
        assert self.pg is not None
        layout = layout or Layout.of(manifest, self.bucket_bytes)
        size = max(e - s for s, e in layout.buckets)
        if not self._bufs or self._bufs[0].numel() < size or self._bufs[0].device != self.device:
            self._bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in items]
        order = sorted(range(len(flats)), key=lambda i: layout.offsets[i])  # by position in the stream
        works: list[Any] = [None, None]
        idx = 0  # first tensor (in stream order) not fully packed yet
        for bi, (bstart, bend) in enumerate(layout.buckets):
            slot = bi % 2
            if works[slot] is not None:
                self._finish(works[slot])  # the buffer's previous broadcast has finished reading it
            buf = self._bufs[slot][: bend - bstart]
            idx = _pack(buf, bstart, bend, flats, order, layout.offsets, idx)
            works[slot] = self.pg.broadcast(buf, self.timeout, wait=False)
        for w in works:
            if w is not None:
                self._finish(w)
        if self.device.type == "cuda":
            wait_stream(self.device, self.timeout * 2, "weight broadcast")

    def _broadcast_direct(self, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta]) -> None:
        """One broadcast per tensor, straight from the trainer's (contiguous) tensors, in
        coalesced groups of ``group_bytes`` on NCCL."""
        assert self.pg is not None
        flats = []
        for _, t in items:
            t = t.detach()
            flats.append((t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8))
        last = None
        if self.device.type == "cuda":
            for lo, hi in groups_of(manifest, self.group_bytes):
                last = self.pg.broadcast_many(flats[lo:hi], self.timeout, coalesce=self.group_bytes > 0) or last
        else:  # gloo: all enqueued, the last one waited for below
            for f in flats:
                last = self.pg.broadcast(f, self.timeout, wait=False)
        if last is not None:
            self._finish(last)
        if self.device.type == "cuda":
            wait_stream(self.device, self.timeout * 2, "weight broadcast")

    def _finish(self, work: Any) -> None:
        """GPU: order the current stream after ``work``. CPU: block until it is done (bounded)."""
        if self.device.type == "cuda":
            work.wait()
        elif not work.wait(timedelta(seconds=self.timeout)):
            raise WeightSyncTimeout(f"a weight broadcast did not finish within {self.timeout}s (timeout)")

    # -- what the receivers report -------------------------------------------------------------
    async def _agreed_layout(self, client: Any, keys: Any, manifest: list[TensorMeta]) -> FlatLayout | None:
        """The flat layout every receiver reported for this manifest, if they all agree."""
        raw = await client.hgetall(keys.weights_layouts)
        if len(raw) < self.num_workers:
            return None
        try:
            got = [msgspec.msgpack.decode(v, type=FlatLayout) for v in raw.values()]
        except msgspec.DecodeError:
            return None
        first, sig = got[0], manifest_digest(manifest)
        if first.sig != sig or len(first.offsets) != len(manifest) or any(g != first for g in got[1:]):
            return None
        return first

    async def _wait_acks(self, client: Any, key: str, signal: str, version: int) -> dict[str, Ack]:
        """Every worker's ack (``timeout``): each one wakes a BLPOP on ``signal`` (no polling
        delay on the update's path); the hash is reread now and then in case a push was lost."""
        deadline = time.monotonic() + self.timeout
        want = self.num_workers

        async def read() -> dict[str, Ack]:
            got = {k.decode(): decode_ack(v, k.decode()) for k, v in (await client.hgetall(key)).items()}
            return {k: a for k, a in got.items() if a is not None}

        acks = await read()
        while True:
            bad = {k: str(a.error) for k, a in acks.items() if not a.ok}
            if bad:
                raise WeightSyncError(f"receivers failed to stage version {version}: {bad}")
            if len(acks) >= want:
                return acks
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeout(
                    f"only {len(acks)}/{want} workers acknowledged version {version} within {self.timeout}s (timeout)"
                )
            got = await client.blpop([signal], timeout=min(left, 0.5))
            if got is None:
                acks = await read()
                continue
            ack = decode_ack(got[1])
            if ack is not None:
                acks[ack.worker] = ack


def _pack(
    buf: torch.Tensor, bstart: int, bend: int, flats: list[torch.Tensor], order: list[int], offsets: list[int], idx: int,
) -> int:
    """Copy the bytes of bucket ``[bstart, bend)`` into ``buf`` from the tensors in stream
    ``order`` from ``idx`` on; returns the first tensor not fully packed yet."""
    j = idx
    while j < len(order) and offsets[order[j]] < bend:
        off, src = offsets[order[j]], flats[order[j]]
        lo, hi = max(off, bstart), min(off + src.numel(), bend)
        if hi > lo:
            buf[lo - bstart : hi - bstart].copy_(src[lo - off : hi - off], non_blocking=True)
        if off + src.numel() <= bend:
            j += 1
        else:
            break
    return j


def receiver_timings(acks: list[Ack]) -> dict[str, float]:
    """The slowest receiver's own view of a version's receive, and the share that wrote it
    in place (into their shadow weights)."""
    if not acks:
        return {}
    return {
        "receiver_receive_s": max(a.receive_s for a in acks),
        "receiver_verify_s": max(a.verify_s for a in acks),
        "receivers_in_place": sum(a.in_place for a in acks) / len(acks),
        "receiver_setup_s": max(a.setup_s for a in acks),  # until its first broadcast was enqueued
        "receiver_enqueued_s": max(a.enqueued_s for a in acks),  # and its last
    }
