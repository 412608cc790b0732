"""Trainer side of the broadcast: rank 0 of the group, one offer and one broadcast per version.

Runs in the trainer's process, driven by :class:`~rollq.weightsync.trainer.publisher.WeightPublisher`
(``sender=``). The protocol of one update is in :mod:`rollq.weightsync.nccl`.

The group (who is in it, and when it is formed anew) is
:class:`~rollq.weightsync.trainer.group.SenderGroup`'s, held as :attr:`BroadcastSender.group`.

A member that dies during a broadcast breaks it (gloo: at once, the connection closes; NCCL:
within ``timeout``): :meth:`BroadcastSender.send` drops the group, which ends the other
receivers' pending receives, and raises :class:`GroupBroken`; the publisher then offers the
same version again over a group formed anew (the dead member does not answer its call). A
member that takes the whole broadcast but never acks (or fails it) costs ``timeout`` while the
acks are awaited; the version is then committed for the workers that acked, and the record
says how many did not (``timings["missing"]``; the publisher adds a memmap copy for them where
it has a store), and the next send forms a new group.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import traceback
from datetime import timedelta
from typing import Any

import msgspec
import torch

from ...errors import WeightSyncError, WeightSyncTimeout
from ...protocol import Control, control_message
from ..checksum import state_checksum
from ..layout import Layout, flat_bytes, groups_of
from ..process_group import in_daemon_thread, wait_stream
from ..versions import TensorMeta, VersionRecord
from ...connection import text
from .group import SenderGroup
from ..wire import Ack, FlatLayout, Mode, Offer, decode_ack, manifest_digest

log = logging.getLogger(__name__)


class GroupBroken(WeightSyncError):
    """A broadcast failed part way (a member died or left); the group is dropped, and the
    same version can be offered again over a group formed anew."""


class BroadcastSender:
    """Rank 0 of the weight broadcast group (use with WeightPublisher(sender=...)).

    The group's members are the replicas that answer its call
    (:mod:`rollq.weightsync.trainer.group`), not a number fixed here.

    Args:
        num_workers: the fewest workers a group may have (0: any, at least one). When given,
            forming a group waits up to ``timeout`` until that many workers answered (the
            replicas expected at start); when fewer answer, the send fails and the publisher
            falls back to memmap. Leave it 0 for the group to follow the live replicas as they
            come and go.
        join_window: seconds a group's call waits for registered replicas that have not
            answered (it ends as soon as all did); the silent ones are left out.
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
        num_workers: int = 0,
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
        join_window: float = 3.0,
    ):
        if backend not in ("nccl", "gloo"):
            raise ValueError("backend must be 'nccl' or 'gloo'")
        self.mode = Mode(mode) if mode else (Mode.DIRECT if backend == "nccl" else Mode.PACKED)
        self.verify = verify
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_bytes = group_bytes if backend == "nccl" else 0
        self.shadow_layout = shadow_layout
        self.timeout = timeout
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        #: The group and its members (rollq.weightsync.trainer.group).
        self.group = SenderGroup(
            num_workers=num_workers, backend=backend, host=host, port=port, timeout=timeout, min_ctas=min_ctas,
            join_window=join_window, device=self.device,
        )
        self._bufs: list[torch.Tensor] = []
        self.last_timings: dict[str, float] = {}

    # -- the group ---------------------------------------------------------------------------
    @property
    def workers(self) -> int:
        """Workers in the current group (ranks other than this one)."""
        return self.group.workers

    async def reset(self) -> None:
        """Drop the group (after a failure); the next send forms a new one."""
        await self.group.reset()

    def close(self) -> None:
        self.group.close()
        self._bufs = []

    # -- one version ---------------------------------------------------------------------------
    async def send(
        self, version: int, items: list[tuple[str, torch.Tensor]], client: Any, keys: Any, *, manifest: list[TensorMeta] | None = None
    ) -> VersionRecord:
        """Broadcast ``items`` as ``version`` (forming the group anew first when its members
        changed); returns the record to commit: all workers acked, or some did and
        ``timings["missing"]`` counts the others. Raises :class:`GroupBroken` when the
        broadcast itself failed, :class:`~rollq.errors.WeightSyncError` when no worker acked.

        ``items`` may instead be a streamed source described by ``manifest`` (the
        tensors of a trainer with parameter shards, gathered bucket by bucket as they are read:
        :class:`~rollq.weightsync.trainer.param_shards.StreamedItems`); it is read in manifest order only."""
        group = self.group
        why = await group.regroup_reason(client, keys)
        if why is not None:
            if group.pg is not None:
                log.info("forming a new broadcast group: %s", why)
            await group.reset()
            await group.open(client, keys)
        assert group.info is not None
        from ..memmap import manifest_of

        t0 = time.perf_counter()
        streamed, manifest = manifest is not None, manifest if manifest is not None else manifest_of(items)
        checksum = state_checksum(items) if self.verify else ""
        t_ck = time.perf_counter() - t0
        offer = await self._offer(version, manifest, checksum, client, keys, in_order=streamed)
        await self._announce(offer, client, keys)
        t1 = time.perf_counter()
        await self._broadcast(offer, items, manifest)
        t2 = time.perf_counter()
        acks, failed = await self._wait_acks(client, offer)
        t3 = time.perf_counter()
        if not acks:
            raise WeightSyncError(f"no receiver staged version {version}: {_describe(failed)}")
        if failed:
            group.stale = True
            log.warning("version %d reached %d of %d workers over group %s (not: %s); committed for those, the group "
                        "is formed anew before the next send", version, len(acks), self.workers, offer.group, _describe(failed))
        self.last_timings = {"checksum_s": t_ck, "broadcast_s": t2 - t1, "acks_s": t3 - t2, "send_s": t3 - t0,
                             "layout_mode": float(offer.mode is Mode.LAYOUT), **receiver_timings(list(acks.values()))}
        pipe = client.pipeline(transaction=False)
        pipe.expire(offer.acks, 3600)
        pipe.delete(offer.ack_signal)
        await pipe.execute()
        return VersionRecord(
            version=version, transport=self.backend, checksum=checksum, num_tensors=len(items), nbytes=sum(m.nbytes for m in manifest),
            group=group.info.id, timings=dict(self.last_timings, replicas=float(len(acks)), missing=float(len(failed))),
        )

    async def _broadcast(self, offer: Offer, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta]) -> None:
        """Send every byte of ``offer``; on a failure drop the group and raise :class:`GroupBroken`."""
        if offer.mode is Mode.DIRECT:
            send = self._broadcast_direct
        else:
            layout = Layout.explicit(offer.offsets, offer.total, self.bucket_bytes) if offer.mode is Mode.LAYOUT else None
            send = functools.partial(self._broadcast_all, layout=layout)
        failure = None
        try:
            await asyncio.wait_for(in_daemon_thread(send, items, manifest), self.timeout * 4)
        except (RuntimeError, WeightSyncTimeout, asyncio.TimeoutError) as e:
            failure = f"{type(e).__name__}: {str(e)[:500]}"
            # the failed works in its frames keep the group's connections open: free them, so
            # that dropping the group ends the other receivers' pending receives now
            traceback.clear_frames(e.__traceback__)
        if failure is not None:
            await self.reset()
            raise GroupBroken(f"broadcast of version {offer.version} over group {offer.group} failed: {failure}")

    async def _offer(
        self, version: int, manifest: list[TensorMeta], checksum: str, client: Any, keys: Any, in_order: bool = False
    ) -> Offer:
        assert self.group.info is not None
        mode, flat = self.mode, None
        if self.shadow_layout and mode is Mode.DIRECT:
            flat = await self._agreed_layout(client, keys, manifest)
            if flat is not None and in_order and any(b < a for a, b in zip(flat.offsets, flat.offsets[1:])):
                flat = None  # a streamed source is read in manifest order only
            if flat is not None:
                mode = Mode.LAYOUT
        return Offer(
            version=version, group=self.group.info.id, checksum=checksum, bucket_bytes=self.bucket_bytes,
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
        pg = self.group.pg
        assert pg is not None
        layout = layout or Layout.of(manifest, self.bucket_bytes)
        size = max(e - s for s, e in layout.buckets)
        if not self._bufs or self._bufs[0].numel() < size or self._bufs[0].device != self.device:
            self._bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        flats = _flats(items)
        order = sorted(range(len(flats)), key=lambda i: layout.offsets[i])  # by position in the stream
        works: list[Any] = [None, None]
        idx = 0  # first tensor (in stream order) not fully packed yet
        for bi, (bstart, bend) in enumerate(layout.buckets):
            slot = bi % 2
            if works[slot] is not None:
                self._finish(works[slot])  # the buffer's previous broadcast has finished reading it
            buf = self._bufs[slot][: bend - bstart]
            idx = _pack(buf, bstart, bend, flats, order, layout.offsets, idx)
            works[slot] = pg.broadcast(buf, self.timeout, wait=False)
        for w in works:
            if w is not None:
                self._finish(w)
        if self.device.type == "cuda":
            wait_stream(self.device, self.timeout * 2, "weight broadcast")

    def _broadcast_direct(self, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta]) -> None:
        """One broadcast per tensor, straight from the trainer's (contiguous) tensors, in
        coalesced groups of ``group_bytes`` on NCCL."""
        pg = self.group.pg
        assert pg is not None
        flats = _flats(items)
        last = None
        if self.device.type == "cuda":
            for lo, hi in groups_of(manifest, self.group_bytes):
                last = pg.broadcast_many(flats[lo:hi], self.timeout, coalesce=self.group_bytes > 0) or last
        else:  # gloo: all enqueued, the last one waited for below
            for f in flats:
                last = pg.broadcast(f, self.timeout, wait=False)
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
        if len(raw) < self.workers:
            return None
        try:
            got = [msgspec.msgpack.decode(v, type=FlatLayout) for v in raw.values()]
        except msgspec.DecodeError:
            return None
        first, sig = got[0], manifest_digest(manifest)
        if first.sig != sig or len(first.offsets) != len(manifest) or any(g != first for g in got[1:]):
            return None
        return first

    async def _wait_acks(self, client: Any, offer: Offer) -> tuple[dict[str, Ack], dict[str, str]]:
        """Every worker's answer, within ``timeout``: ``(ok acks, {worker: why not})``; a
        worker silent at the deadline counts as failed. Each ack wakes a BLPOP on the
        offer's signal (no polling delay on the update's path); the hash is reread now and
        then in case a push was lost. Acks over another group (an earlier offer of the same
        version) are ignored."""
        deadline = time.monotonic() + self.timeout
        want = {f"{r}/{i}" for r, n in self.group.members.items() for i in range(n)}
        acks: dict[str, Ack] = {}

        def take(ack: Ack | None) -> None:
            if ack is not None and ack.group == offer.group and ack.version == offer.version:
                acks[ack.worker] = ack

        async def read() -> None:
            for k, v in (await client.hgetall(offer.acks)).items():
                take(decode_ack(v, text(k)))

        await read()
        while not want <= acks.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = await client.blpop([offer.ack_signal], timeout=min(left, 0.5))
            if got is None:
                await read()
            else:
                take(decode_ack(got[1]))
        ok = {w: a for w, a in acks.items() if a.ok}
        failed = {w: str(a.error) for w, a in acks.items() if not a.ok}
        failed.update({w: f"no ack within {self.timeout}s (timeout)" for w in sorted(want - acks.keys())})
        return ok, failed


def _describe(failed: dict[str, str]) -> str:
    items = sorted(failed.items())
    return "; ".join(f"{w[:64]}: {why[:200]}" for w, why in items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _flats(items: Any) -> Any:
    """Each tensor's bytes (flat ``uint8``) by position: a list, or a streamed source itself
    (it makes them as they are asked for)."""
    if not isinstance(items, list):
        return items
    return [flat_bytes(t) for _, t in items]


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
