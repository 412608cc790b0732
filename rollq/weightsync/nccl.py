"""Broadcast weight transport: NCCL on GPUs, gloo on CPU-only machines, same protocol.

The trainer is rank 0; every vLLM worker of every replica is a rank (tensor-parallel
workers included). Nothing needs ``torch.distributed.init_process_group``: the group is a
stateless ``ProcessGroupNCCL``/``ProcessGroupGloo`` over its own ``TCPStore``, so it never
disturbs the trainer's own groups.

Protocol of one update (one control message, never one RPC per tensor):

1. The trainer writes the *offer* (version, tensor manifest, optional checksum, mode) to Redis
   and announces it (``woffer <v>``).
2. Every worker that joined the group listens for offers itself (a thread in the worker
   process with its own Redis connection: no engine RPC, which would queue behind generation
   steps) and receives the tensors straight into a persistent flat staging buffer (tensors
   are views into it: no unpacking copy), on its own CUDA stream, while the engine keeps
   generating; then it writes its ack (``ok`` or the error) into the offer's ack hash.
3. The trainer broadcasts (one broadcast per tensor on NCCL, packed buckets on gloo), then
   waits for every worker's ack.
4. All acked: the version is committed (durable record, pub/sub). Each replica then swaps the
   staged tensors in with one ``collective_rpc`` (``rollq_apply_staged``), which vLLM runs
   between two engine steps.

Verification: with ``verify=True`` both sides compute the device-side checksum of the
tensors and the receivers refuse a mismatch. It is off by default for broadcasts (NCCL and
gloo deliver what was sent, and the checksum adds two full passes over the weights to the
update); storage (memmap) is always verified.

Every phase has a timeout (group formation, each broadcast, the acks). On a failure the trainer
drops the group (rebuilt on the next update) and the publisher falls back to memmap for the
same version; receivers that staged nothing load that memmap copy.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch

from ..errors import WeightSyncError, WeightSyncTimeout
from ..protocol import Control, control_message, parse_control
from .checksum import state_checksum
from .versions import TensorMeta, VersionRecord

log = logging.getLogger(__name__)

ALIGN = 256


# ----------------------------------------------------------------------------------------
# layout: the same on both sides, computed from the manifest alone
# ----------------------------------------------------------------------------------------
@dataclass
class Layout:
    """Where each tensor lives in the flat buffer, and the bucket boundaries."""

    offsets: list[int]  # byte offset of each tensor in the flat buffer
    total: int  # flat buffer size
    buckets: list[tuple[int, int]]  # (start, end) byte ranges, each broadcast once

    @classmethod
    def of(cls, manifest: list[TensorMeta], bucket_bytes: int) -> Layout:
        offsets, pos = [], 0
        for m in manifest:
            pos = (pos + ALIGN - 1) // ALIGN * ALIGN
            offsets.append(pos)
            pos += m.nbytes
        total = (pos + ALIGN - 1) // ALIGN * ALIGN
        buckets, start = [], 0
        while start < total:
            end = min(total, start + bucket_bytes)
            buckets.append((start, end))
            start = end
        return cls(offsets, total, buckets)

    @classmethod
    def explicit(cls, offsets: list[int], total: int, bucket_bytes: int) -> Layout:
        """Given offsets (a receiver's :class:`FlatLayout`), cut into buckets."""
        buckets, start = [], 0
        while start < total:
            end = min(total, start + bucket_bytes)
            buckets.append((start, end))
            start = end
        return cls(list(offsets), total, buckets)

    def views(self, flat: torch.Tensor, manifest: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        return typed_views(manifest, [flat[off : off + m.nbytes] for m, off in zip(manifest, self.offsets)])


def typed_views(manifest: list[TensorMeta], raw: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` per manifest entry, viewing its raw ``uint8`` bytes in ``raw``."""
    return [(m.name, r.view(getattr(torch, m.dtype)).view(m.shape)) for m, r in zip(manifest, raw)]


class FlatLayout(msgspec.Struct, kw_only=True):
    """Where a receiver's shadow weights hold each tensor of a manifest, in one flat buffer
    (Redis ``wlayouts``; see :meth:`rollq.weightsync.shadow.ShadowWeights.flat_offsets`)."""

    sig: str  # manifest_digest of the manifest it is for
    offsets: list[int]
    total: int


def manifest_digest(manifest: list[TensorMeta]) -> str:
    """A short digest of a manifest's names, dtypes and shapes, in order."""
    import hashlib

    return hashlib.blake2b(msgspec.msgpack.encode(manifest), digest_size=12).hexdigest()


class Offer(msgspec.Struct, kw_only=True):
    """A version being broadcast (Redis ``woffer``).

    ``mode``: ``packed`` (tensors packed into ``bucket_bytes`` buckets: few large messages,
    best for gloo), ``direct`` (one broadcast per tensor straight from the trainer's tensors
    into the receivers' staging views or shadow bytes: no copy on either side) or ``layout``
    (buckets packed by the trainer at ``offsets``, the layout every receiver reported for its
    shadow weights: each bucket lands in place, a few collective calls per version instead of
    one per tensor).
    """

    version: int
    group: str
    #: state_checksum of the tensors; "" when the sender does not verify.
    checksum: str
    bucket_bytes: int
    manifest: list[TensorMeta]
    timeout: float
    mode: str = "packed"
    #: Hash receivers write their ack into, as ``replica/worker -> ok | error: ...``.
    acks: str = ""
    #: List receivers also push ``field\tvalue`` onto (the trainer blocks on it); "": none.
    ack_signal: str = ""
    #: ``direct`` mode on NCCL: consecutive tensors up to this many bytes go as one coalesced
    #: NCCL group (one kernel launch: per-tensor launches wait for SMs a busy engine holds,
    #: 200 vs 45 ms for 15.2 GB in benchmarks/gpu_copy_paths.py). 0: one launch per tensor.
    group_bytes: int = 0
    #: ``layout`` mode: each tensor's byte offset in the flat stream, and the stream's size.
    offsets: list[int] = []
    total: int = 0

    @property
    def verify(self) -> bool:
        return bool(self.checksum)


class Listen(msgspec.Struct, kw_only=True):
    """Where a worker listens for offers and writes its ack (given when it joins)."""

    url: str  # Redis URL (a ``redis+cluster://`` URL goes through the cluster client)
    channel: str  # the queue's control channel (``woffer <v>`` hints)
    offer_key: str  # hash holding the current offer
    field: str  # this worker's ack field, ``replica/rank-in-replica``
    poll: float = 1.0  # seconds between checks of the offer record (pub/sub is only a hint)
    layouts_key: str = ""  # hash to report this worker's FlatLayout in (same field)
    version_key: str = ""  # the committed version record (a swap overlapped with the receive waits for it)


class GroupInfo(msgspec.Struct, kw_only=True):
    """The trainer's broadcast group (Redis ``wgroup``)."""

    id: str
    host: str
    port: int
    world_size: int
    backend: str
    timeout: float
    #: NCCL: at least this many channels (CTAs) per collective (0: NCCL's default). Given to
    #: NCCL as ``NCCL_MIN_NCHANNELS`` (unless already set), which NCCL reads once per process,
    #: at its first communicator, so it changes the whole process: off by default. Beside a
    #: synthetic memory-bound load, 32 moved 15.2 GB in 43.5 ms against 52.0 ms
    #: (benchmarks/results/nccl_settings/); beside a real vLLM engine it did not shorten the
    #: update (87 vs 83 ms median, results/gpu_vllm_min_channels.md). Setting ``min_ctas`` in
    #: the communicator config instead was refused by NCCL 2.28.9 ("Invalid config").
    min_ctas: int = 0


def groups_of(manifest: list[TensorMeta], group_bytes: int) -> list[tuple[int, int]]:
    """Index ranges of consecutive tensors up to ``group_bytes`` each (0: one per tensor)."""
    out, start, size = [], 0, 0
    for i, m in enumerate(manifest):
        size += m.nbytes
        if group_bytes <= 0 or size >= group_bytes:
            out.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(manifest):
        out.append((start, len(manifest)))
    return out


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Group:
    """A process group and the store it lives on (the store must outlive the group)."""

    pg: Any
    store: Any

    def broadcast(self, buf: torch.Tensor, timeout: float, *, wait: bool = True) -> Any:
        """Broadcast ``buf`` from rank 0.

        CPU (gloo): blocks until done or ``timeout``. GPU (NCCL): enqueues and makes the current
        stream wait for it (no host block; use :func:`wait_stream` for a bounded host wait).
        """
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([buf], opts)
        if buf.device.type == "cuda":
            if wait:
                work.wait()  # stream-level: later work on this stream sees the data
        elif wait and not work.wait(timedelta(seconds=timeout)):
            raise WeightSyncTimeout(f"broadcast of {buf.numel()} bytes did not finish within {timeout}s (timeout)")
        return work

    def broadcast_many(self, bufs: list[torch.Tensor], timeout: float, *, coalesce: bool) -> Any:
        """Broadcast each of ``bufs`` from rank 0, as one coalesced NCCL group when
        ``coalesce`` (every rank must group the same tensors the same way).

        GPU: enqueued; returns the work to wait on (stream-level). CPU: each finishes (bounded)
        before this returns.
        """
        if not bufs:
            return None
        if bufs[0].device.type != "cuda":
            for b in bufs:
                self.broadcast(b, timeout)
            return None
        # As little Python per tensor as possible: every collective call releases the GIL and
        # must win it back from the engine's busy thread (one options object, bound method).
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        bcast = self.pg.broadcast
        if not coalesce or len(bufs) == 1:
            work = None
            for b in bufs:
                work = bcast([b], opts)
            return work
        self.pg._start_coalescing()
        try:
            for b in bufs:
                bcast([b], opts)
        finally:
            work = self.pg._end_coalescing()
        return work

    def abort(self, timeout: float = 10.0) -> None:
        """Abort the group's communicators (unblocks peers stuck in a collective), at most
        ``timeout`` seconds: it runs in a daemon thread, so it can never hang the caller."""
        fn = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if fn is not None:
            t = threading.Thread(target=_quiet, args=(fn,), daemon=True, name="rollq-group-abort")
            t.start()
            t.join(timeout)


_gil_users = 0
_gil_lock = threading.Lock()
_gil_saved = 0.005


@contextlib.contextmanager
def responsive_gil(interval: float | None = None) -> Any:
    """Shorten the interpreter's GIL switch interval while a weight-sync thread works.

    The thread shares its process with vLLM's busy engine loop; at the default 5 ms every
    one of its hundreds of small steps (one per tensor) can wait that long for the GIL.
    Restored when the last user leaves. ``interval`` defaults to ``ROLLQ_GIL_SWITCH_INTERVAL``
    (seconds), else 0.2 ms (benchmarks/gil_roundtrips.py: 339 GIL round trips beside a busy
    thread cost 119 ms at 0.2 ms and 51 ms at 1 us on a 2-core machine; on a GPU host beside
    vLLM not measured yet).
    """
    import sys

    if interval is None:
        interval = float(os.environ.get("ROLLQ_GIL_SWITCH_INTERVAL", "0.0002"))

    global _gil_users, _gil_saved
    with _gil_lock:
        if _gil_users == 0:
            _gil_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, _gil_saved))
        _gil_users += 1
    try:
        yield
    finally:
        with _gil_lock:
            _gil_users -= 1
            if _gil_users == 0:
                sys.setswitchinterval(_gil_saved)


def _quiet(fn: Any) -> None:
    try:
        fn()
    except Exception as e:
        log.debug("aborting a weight broadcast group: %s", e)


def in_daemon_thread(fn: Any, *args: Any) -> asyncio.Future:
    """Run ``fn(*args)`` in a daemon thread; an awaitable of its result.

    Unlike ``asyncio.to_thread`` the thread is not in the loop's executor, so a call stuck
    inside a collective (bounded by our own timeouts, but a native call may still block)
    can never hold up the event loop's shutdown.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def done(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def run() -> None:
        try:
            r = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
                loop.call_soon_threadsafe(done, False, e)
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done, True, r)

    threading.Thread(target=run, daemon=True, name="rollq-broadcast").start()
    return fut


def make_group(info: GroupInfo, rank: int, device: torch.device | None = None) -> Group:
    """A stateless process group of ``info`` (rank 0 hosts the TCPStore)."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=info.timeout)
    store = TCPStore(info.host, info.port, info.world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    pstore = PrefixStore(f"rollq/{info.id}", store)
    if info.backend == "gloo":
        pg = torch.distributed.ProcessGroupGloo(pstore, rank, info.world_size, timeout)
    else:
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # The receivers share their GPU with a busy engine: a high-priority stream gets the
        # broadcast's blocks scheduled ahead of the engine's queued kernels as SMs free up,
        # and more channels keep the transfer at NVLink speed while decoding loads HBM.
        opts.is_high_priority_stream = True
        if info.min_ctas > 0 and not any(k in os.environ for k in ("NCCL_MIN_NCHANNELS", "NCCL_MIN_CTAS")):
            os.environ["NCCL_MIN_NCHANNELS"] = str(info.min_ctas)
        pg = torch.distributed.ProcessGroupNCCL(pstore, rank, info.world_size, opts)
    return Group(pg, store)


def _broadcast(group: Group, buf: torch.Tensor, timeout: float) -> None:
    group.broadcast(buf, timeout)
    if buf.device.type == "cuda":
        wait_stream(buf.device, timeout)


def wait_stream(device: torch.device, timeout: float, what: str = "broadcast") -> None:
    """Wait for the current CUDA stream, at most ``timeout`` seconds (never hang forever)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout
    while not ev.query():
        if time.monotonic() > deadline:
            raise WeightSyncTimeout(f"{what} did not finish within {timeout}s (timeout)")
        time.sleep(0.0002)


# ----------------------------------------------------------------------------------------
# trainer side
# ----------------------------------------------------------------------------------------
class BroadcastSender:
    """Rank 0 of the weight broadcast group (use with WeightPublisher(sender=...)).

    Args:
        num_workers: vLLM workers that will join (sum of tensor-parallel sizes of replicas).
        backend: ``nccl`` (GPU tensors) or ``gloo`` (CPU).
        host: address replicas connect to (this machine's, reachable from them).
        bucket_bytes: bytes per broadcast in ``packed`` mode (two buffers of it are allocated).
        group_bytes: ``direct`` mode on NCCL: tensors sent as one coalesced NCCL group, up to
            this many bytes (0: one launch per tensor; see :class:`Offer`).
        timeout: seconds for group formation, each broadcast and the acks.
        verify: checksum the tensors on both sides (two extra passes over the weights).
        min_ctas: NCCL CTAs (channels) per collective on every rank (see :class:`GroupInfo`).
        shadow_layout: in ``direct`` mode, once every receiver has reported the same flat
            layout of its shadow weights for the manifest, send ``layout`` offers instead (a
            few bucket transfers per version; see :class:`Offer`). On by default: 70 against
            74 ms end to end on 2 H200s (benchmarks/README.md); it costs one Redis read per
            send, and falls back to ``direct`` while the reports are missing or disagree.
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
        #: ``direct`` on NCCL (no packing copy), ``packed`` on gloo; see :class:`Offer`.
        self.mode = mode or ("direct" if backend == "nccl" else "packed")
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
        self.pg: Any = None
        self._bufs: list[torch.Tensor] = []
        self.last_timings: dict[str, float] = {}

    async def open(self, client: Any, keys: Any) -> GroupInfo:
        """Create the group and wait (``timeout``) until every worker has joined."""
        info = GroupInfo(
            id=uuid.uuid4().hex[:12], host=self.host, port=self.port or _free_port(self.host),
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

    def _form(self, info: GroupInfo) -> Any:
        pg = make_group(info, 0, self.device)
        # One tiny collective proves every rank is there (NCCL connects lazily).
        _broadcast(pg, torch.zeros(1, dtype=torch.uint8, device=self.device), info.timeout)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return pg

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
        acks_key, signal = keys.weights_acks(version), keys.weights_ack_signal(version)
        mode, flat = self.mode, None
        if self.shadow_layout and mode == "direct":
            flat = await self._agreed_layout(client, keys, manifest)
            if flat is not None:
                mode = "layout"
        offer = Offer(
            version=version, group=self.info.id, checksum=checksum, bucket_bytes=self.bucket_bytes,
            manifest=manifest, timeout=self.timeout, mode=mode, acks=acks_key, ack_signal=signal, group_bytes=self.group_bytes,
            offsets=flat.offsets if flat else [], total=flat.total if flat else 0,
        )
        pipe = client.pipeline(transaction=False)
        pipe.delete(acks_key, signal)
        pipe.hset(keys.weights_offer, mapping={"v": version, "d": msgspec.msgpack.encode(offer)})
        pipe.execute_command("PUBLISH", keys.control, control_message(Control.WOFFER, version))  # cluster pipelines refuse pipe.publish
        await pipe.execute()
        t1 = time.perf_counter()
        if mode == "direct":
            send = self._broadcast_direct
        else:
            layout = Layout.explicit(offer.offsets, offer.total, self.bucket_bytes) if mode == "layout" else None
            send = functools.partial(self._broadcast_all, layout=layout)
        await asyncio.wait_for(in_daemon_thread(send, items, manifest), self.timeout * 4)
        t2 = time.perf_counter()
        acks = await self._wait_acks(client, acks_key, signal, version)
        t3 = time.perf_counter()
        self.last_timings = {"checksum_s": t_ck, "broadcast_s": t2 - t1, "acks_s": t3 - t2, "send_s": t3 - t0,
                             "layout_mode": float(mode == "layout")}
        parts = [v.split() for v in acks.values() if len(v.split()) >= 3]
        if parts:  # the slowest receiver's own view: receive and verify times
            self.last_timings["receiver_receive_s"] = max(float(p[1]) for p in parts)
            self.last_timings["receiver_verify_s"] = max(float(p[2]) for p in parts)
            # share of receivers that wrote the version in place (into their shadow weights)
            self.last_timings["receivers_in_place"] = sum(p[3:4] == ["in-place"] for p in parts) / len(parts)
            timed = [p for p in parts if len(p) >= 6]
            if timed:  # until its first broadcast was enqueued, and its last
                self.last_timings["receiver_setup_s"] = max(float(p[4]) for p in timed)
                self.last_timings["receiver_enqueued_s"] = max(float(p[5]) for p in timed)
        pipe = client.pipeline(transaction=False)
        pipe.expire(acks_key, 3600)
        pipe.delete(signal)
        await pipe.execute()
        nbytes = sum(m.nbytes for m in manifest)
        return VersionRecord(
            version=version, transport="nccl", checksum=checksum, num_tensors=len(items), nbytes=nbytes,
            group=self.info.id, timings=dict(self.last_timings, replicas=float(len(acks))),
        )

    def _broadcast_all(
        self, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta], layout: Layout | None = None
    ) -> None:
        """Pack into two alternating bucket buffers and broadcast each bucket, at the offsets
        of ``layout`` (default: the manifest's own, :meth:`Layout.of`).

        On GPUs everything is stream-ordered: packing bucket i+1 overlaps the broadcast of
        bucket i, and a buffer is repacked only after its previous broadcast completed.
        """
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
            j = idx
            while j < len(order) and layout.offsets[order[j]] < bend:
                off, src = layout.offsets[order[j]], flats[order[j]]
                lo, hi = max(off, bstart), min(off + src.numel(), bend)
                if hi > lo:
                    buf[lo - bstart : hi - bstart].copy_(src[lo - off : hi - off], non_blocking=True)
                if off + src.numel() <= bend:
                    j += 1
                else:
                    break
            idx = j
            works[slot] = self.pg.broadcast(buf, self.timeout, wait=False)
        for w in works:
            if w is not None:
                self._finish(w)
        if self.device.type == "cuda":
            wait_stream(self.device, self.timeout * 2, "weight broadcast")

    def _broadcast_direct(self, items: list[tuple[str, torch.Tensor]], manifest: list[TensorMeta]) -> None:
        """One broadcast per tensor, straight from the trainer's (contiguous) tensors, in
        coalesced groups of ``group_bytes`` on NCCL."""
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

    async def _wait_acks(self, client: Any, key: str, signal: str, version: int) -> dict[str, str]:
        """Every worker's ack (``timeout``): each one wakes a BLPOP on ``signal`` (no polling
        delay on the update's path); the hash is reread now and then in case a push was lost."""
        deadline = time.monotonic() + self.timeout
        want = self.num_workers

        async def read() -> dict[str, str]:
            return {k.decode(): v.decode() for k, v in (await client.hgetall(key)).items()}

        acks = await read()
        while True:
            bad = {k: v for k, v in acks.items() if not v.startswith("ok")}
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
            field, _, value = got[1].decode().partition("\t")
            acks[field] = value

    async def reset(self) -> None:
        """Drop the group (after a failure); the next send forms a new one."""
        pg, self.pg, self.info = self.pg, None, None
        if pg is not None:
            await in_daemon_thread(pg.abort)

    def close(self) -> None:
        self.pg = None
        self._bufs = []


def sync_client(url: str) -> Any:
    """A blocking redis-py client for ``url`` (cluster URLs through the cluster client)."""
    from ..settings import RedisSettings

    st = RedisSettings.from_url(url)
    if st.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(st.url)
    import redis

    return redis.Redis.from_url(st.url)


# ----------------------------------------------------------------------------------------
# worker side (inside each vLLM worker, driven by RollqWorkerExtension)
# ----------------------------------------------------------------------------------------
class ReceiveProgress:
    """An in-place receive, part by part (a bucket or a coalesced group of tensors).

    ``part_of[j]``: the part holding the last bytes of manifest tensor ``j``. ``parts``
    grows as parts are enqueued, each with a CUDA event recorded after it (None on CPU,
    where a part is received when it is listed). ``rollq_swap_overlapped`` swaps each
    part's parameters in as soon as the part is complete, stream-ordered after its event.
    """

    def __init__(self, version: int, manifest: list[TensorMeta], part_of: list[int], cond: threading.Condition):
        self.version, self.manifest, self.part_of = version, manifest, part_of
        self.parts: list[Any] = []
        self.state = "receiving"  # then "staged" or "failed"
        self._cond = cond

    @classmethod
    def of(cls, offer: Offer, layout: Layout, groups: list[tuple[int, int]], cond: threading.Condition) -> ReceiveProgress:
        if offer.mode == "layout":
            ends = [e for _, e in layout.buckets]
            part_of = [bisect.bisect_left(ends, off + m.nbytes) for m, off in zip(offer.manifest, layout.offsets)]
        else:
            part_of = [k for k, (lo, hi) in enumerate(groups) for _ in range(lo, hi)]
        return cls(offer.version, offer.manifest, part_of, cond)

    def add(self, event: Any) -> None:
        with self._cond:
            self.parts.append(event)
            self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        with self._cond:
            self.state = "staged" if ok else "failed"
            self._cond.notify_all()

    def wait_part(self, k: int, timeout: float) -> tuple[bool, Any]:
        """``(True, event)`` once part ``k`` is enqueued; ``(False, None)`` if the receive
        failed first or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.parts) > k or self.state == "failed", timeout)
            if len(self.parts) > k and self.state != "failed":
                return True, self.parts[k]
            return False, None

    def wait_done(self, timeout: float) -> bool:
        """Whether every byte arrived (the receive ended well) within ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self.state != "receiving", timeout)
            return self.state == "staged"


class WorkerReceiver:
    """Joins the trainer's group and receives versions into a persistent staging buffer.

    :meth:`listen` starts a thread that follows the offer record itself (pub/sub hint plus a
    periodic check) and receives each new offer of this group once, while the engine serves.
    """

    def __init__(
        self, info: GroupInfo, rank: int, device: torch.device, sink: Any = None, sink_invalidate: Any = None,
        direct: Any = None, layout: Any = None,
    ):
        self.info, self.rank, self.device = info, rank, device
        #: ``sink(version, items, stream, manifest) -> bool`` consumes the received
        #: ``(name, tensor)`` pairs as they arrive, in the receiving thread (the worker
        #: extension loads them into its shadow weights); True when it holds the whole version.
        #: ``sink_invalidate()`` drops what it loaded when the version turns out bad.
        self.sink = sink
        self.sink_invalidate = sink_invalidate
        #: ``direct(version, manifest, stream) -> DirectTarget | None``: where to receive each
        #: tensor in place (the shadow weights' own bytes, by their load plan), so that there
        #: is neither a staging buffer nor a load step; None: stage and hand to ``sink``.
        self.direct = direct
        #: ``layout(manifest) -> FlatLayout | None``: this worker's shadow layout for a manifest,
        #: reported in Redis after each version so the trainer can pack buckets that way.
        self.layout = layout
        self.pg = make_group(info, rank, device)
        _broadcast(self.pg, torch.zeros(1, dtype=torch.uint8, device=device), info.timeout)
        self._init_state()

    def _init_state(self) -> None:
        """Everything but the group (tests script the group and call this)."""
        self._reported: bytes | None = None
        self.flat: torch.Tensor | None = None
        self.staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.status: dict[str, Any] = {"state": "idle"}
        self.attempted = 0  # newest offered version this receiver took part in (or skipped)
        #: Held while receiving into, or swapping from, the staging buffer.
        self.lock = threading.Lock()
        #: The in-place receive in progress or last done (see :class:`ReceiveProgress`).
        self.progress: ReceiveProgress | None = None
        #: Newest version seen committed (``version <v>`` announcements; the record is the truth).
        self.committed = 0
        self._events = threading.Condition()
        self._listen_cfg: Listen | None = None
        self._rpc_client: Any = None
        self._decided = 0  # newest version whose receive started (in place or staged)
        self._abandoned = 0  # a version whose receive must fail even if its kernels end
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # -- following offers ------------------------------------------------------------------
    def listen(self, listen: Listen, loaded: Any = lambda: 0) -> None:
        """Follow offers in a daemon thread; ``loaded()`` gives the worker's loaded version."""
        self._thread = threading.Thread(target=self._listen, args=(listen, loaded), name="rollq-offers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop following offers (a newer group replaced this one); the group is aborted."""
        self._closed.set()
        self.pg.abort()
        with self._events:
            self._events.notify_all()

    def abandon(self, version: int) -> None:
        """Give up the receive of ``version``: the group is aborted (its pending kernels end,
        so nothing queued behind them waits for NCCL's own timeout) and the receive fails."""
        self._abandoned = version
        self.pg.abort()

    # -- what a swap overlapped with the receive waits for ---------------------------------
    def _note(self, data: str) -> None:
        """A control message: ``version <v>`` says ``v`` was committed."""
        verb, arg = parse_control(data)
        if verb is Control.VERSION:
            try:
                v = int(arg.split()[0])
            except (ValueError, IndexError):
                return
            with self._events:
                if v > self.committed:
                    self.committed = v
                    self._events.notify_all()

    def progress_for(self, version: int, timeout: float) -> ReceiveProgress | None:
        """The in-place receive of ``version``, waiting up to ``timeout`` for it to start;
        None when it does not (not offered yet, or staged instead of in place)."""
        with self._events:
            self._events.wait_for(lambda: self._closed.is_set() or self._decided >= version, timeout)
            p = self.progress
        return p if p is not None and p.version == version else None

    def wait_committed(self, version: int, timeout: float) -> bool:
        """Whether ``version`` is committed within ``timeout``: its announcement, or else the
        version record (read every 20 ms: the announcement is only a hint)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._events:
                self._events.wait_for(lambda: self.committed >= version or self._closed.is_set(),
                                      max(0.0, min(0.02, deadline - time.monotonic())))
                if self.committed >= version:
                    return self.committed == version or self._recorded() == version
            rec = self._recorded()
            if rec >= version:
                return rec == version
            if time.monotonic() >= deadline or self._closed.is_set():
                return False

    def _recorded(self) -> int:
        """The committed version in Redis (0: unknown)."""
        cfg = self._listen_cfg
        if cfg is None or not cfg.version_key:
            return 0
        try:
            if self._rpc_client is None:
                self._rpc_client = sync_client(cfg.url)
            v = self._rpc_client.hget(cfg.version_key, "v")
            return int(v) if v is not None else 0
        except Exception as e:  # Redis away: the swap gives up and the follower's path applies it
            log.warning("reading the version record failed: %s: %s", type(e).__name__, e)
            self._rpc_client = None
            return 0

    def _listen(self, listen: Listen, loaded: Any) -> None:
        self._listen_cfg = listen
        delay = 0.2
        while not self._closed.is_set():
            client = pubsub = None
            try:
                client = sync_client(listen.url)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(listen.channel)
                while not self._closed.is_set():
                    self.poll(client, listen, loaded)
                    delay = 0.2
                    msg = pubsub.get_message(timeout=listen.poll)
                    while msg is not None and parse_control(str(msg.get("data", b""), "latin-1"))[0] is not Control.WOFFER:
                        self._note(str(msg.get("data", b""), "latin-1"))
                        msg = pubsub.get_message(timeout=0)  # other control traffic: drain it
            except Exception as e:  # Redis down or restarting: back off and resubscribe
                if not self._closed.is_set():
                    log.warning("offer listener of rank %d: %s: %s (retrying in %.1fs)", self.rank, type(e).__name__, e, delay)
                    self._closed.wait(delay)
                    delay = min(delay * 2, 5.0)
            finally:
                for c in (pubsub, client):
                    with contextlib.suppress(Exception):
                        c is not None and c.close()

    def poll(self, client: Any, listen: Listen, loaded: Any) -> bool:
        """Receive the current offer if it is new for this group; returns whether it did."""
        raw = client.hget(listen.offer_key, "d")
        if raw is None:
            return False
        offer = msgspec.msgpack.decode(raw, type=Offer)
        if offer.group != self.info.id or offer.version <= max(self.attempted, int(loaded())):
            return False
        self.attempted = offer.version  # once per offer: the trainer moves on after a failure
        self.receive(offer)
        value = (f"ok {self.status.get('receive_s', 0):.4f} {self.status.get('verify_s', 0):.4f} "
                 f"{'in-place' if self.status.get('in_place') else 'staged'} "
                 f"{self.status.get('setup_s', 0):.4f} {self.status.get('enqueued_s', 0):.4f}"
                 if self.status.get("state") == "staged" else f"error: {self.status.get('error')}")
        report = None
        # The layout only changes when a version is loaded (not written in place): in steady
        # state nothing is computed here, between the receive and the ack.
        if (self.layout is not None and listen.layouts_key and self.status.get("state") == "staged"
                and (self._reported is None or not self.status.get("in_place"))):
            fl = self.layout(offer.manifest)
            report = msgspec.msgpack.encode(fl) if fl is not None else None
        pipe = client.pipeline(transaction=False)
        if report is not None and report != self._reported:
            pipe.hset(listen.layouts_key, listen.field, report)  # before the ack: seen by the next offer
            self._reported = report
        if offer.acks:
            pipe.hset(offer.acks, listen.field, value)
        if offer.ack_signal:
            pipe.rpush(offer.ack_signal, f"{listen.field}\t{value}")
        pipe.execute()
        return True

    # -- receiving ----------------------------------------------------------------------
    def receive(self, offer: Offer) -> None:
        """Receive ``offer`` into the staging buffer (blocking, bounded by its timeouts)."""
        with self.lock, responsive_gil():
            self._receive(offer)

    def _receive(self, offer: Offer) -> None:
        self.status = {"state": "receiving", "version": offer.version}
        self.staged = None
        t0 = time.perf_counter()
        sink_ok: Any = None
        target: Any = None
        try:
            cuda = self.device.type == "cuda"
            stream = torch.cuda.Stream(self.device) if cuda else None  # off the engine's stream
            t_verify = 0.0
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                explicit = offer.mode == "layout"
                layout = (Layout.explicit(offer.offsets, offer.total, offer.bucket_bytes) if explicit
                          else Layout.of(offer.manifest, offer.bucket_bytes))
                if offer.mode in ("direct", "layout") and self.direct is not None:
                    target = self.direct(offer.version, offer.manifest, stream)
                    if explicit and target is not None and (target.flat is None or target.flat_offsets != (offer.offsets, offer.total)):
                        target.done(offer.version, False)  # our shadow is laid out otherwise: stage
                        target = None
                groups = groups_of(offer.manifest, offer.group_bytes if cuda else 0)
                with self._events:
                    self.progress = ReceiveProgress.of(offer, layout, groups, self._events) if target is not None else None
                    self._decided = offer.version
                    self._events.notify_all()
                progress = self.progress
                if target is not None:
                    # In place: each tensor lands in the bytes the shadow weights load it to.
                    self.flat = None  # the staging buffer is not needed any more
                    dests = target.views
                    t_setup = time.perf_counter() - t0
                    ranges = ([target.flat[s:e] for s, e in layout.buckets] if explicit  # straight into the flat shadow
                              else [dests[lo:hi] for lo, hi in groups])
                    for part in ranges:
                        if explicit:
                            self.pg.broadcast(part, offer.timeout)
                        else:
                            self._recv_group(offer, part)
                        ev = None
                        if cuda:
                            ev = torch.cuda.Event()
                            ev.record(stream)
                        progress.add(ev)
                    # typed views only to checksum them (each tensor call gives the GIL away)
                    items = typed_views(offer.manifest, dests) if offer.verify else []
                else:
                    if self.flat is None or self.flat.numel() < layout.total:
                        self.flat = None  # free the old buffer before allocating the larger one
                        self.flat = torch.empty(layout.total, dtype=torch.uint8, device=self.device)
                    items = layout.views(self.flat, offer.manifest)
                    t_setup = time.perf_counter() - t0
                    if offer.mode == "direct":
                        dests = [self.flat[off : off + m.nbytes] for m, off in zip(offer.manifest, layout.offsets)]
                        received = self._direct(offer, dests, items, groups)
                    else:
                        for s, e in layout.buckets:
                            self.pg.broadcast(self.flat[s:e], offer.timeout)
                        received = iter(items)
                    if self.sink is not None:
                        # Each tensor is loaded as soon as its broadcast is enqueued (stream-ordered
                        # after it), so loading overlaps the transfer. (A separate loader thread
                        # was measured slower: three threads then fight for the GIL.)
                        sink_ok = self._feed(offer, received, stream)
                    else:
                        for _ in received:
                            pass
                t_enqueued = time.perf_counter() - t0
                if cuda:
                    wait_stream(self.device, offer.timeout * 2, f"receiving version {offer.version}")
                if self._abandoned == offer.version:  # aborted mid-way: whatever arrived is not it
                    raise WeightSyncError(f"receive of version {offer.version} abandoned (group aborted)")
                t_recv = time.perf_counter() - t0
                if offer.verify:
                    got = state_checksum(items)  # on the receive stream, one host sync
                    t_verify = time.perf_counter() - t0 - t_recv
                    if got != offer.checksum:
                        raise WeightSyncError(f"staged version {offer.version} has checksum {got}, expected {offer.checksum}")
            if target is not None:
                target.done(offer.version, True)
                target = None
                self.staged = (offer.version, None)  # in the shadow weights, not in a buffer here
            else:
                self.staged = (offer.version, items)
            self.status = {"state": "staged", "version": offer.version, "receive_s": t_recv, "verify_s": t_verify,
                           "setup_s": t_setup, "enqueued_s": t_enqueued,
                           "loaded_while_receiving": bool(sink_ok), "in_place": self.staged[1] is None}
            if progress is not None:
                progress.finish(True)
        except Exception as e:
            self.staged = None
            with self._events:
                self._decided = max(self._decided, offer.version)
                self._events.notify_all()
            if self.progress is not None and self.progress.version == offer.version:
                self.progress.finish(False)
            if target is not None:
                target.done(offer.version, False)
            elif sink_ok and self.sink_invalidate is not None:
                self.sink_invalidate()
            self.status = {"state": "failed", "version": offer.version, "error": f"{type(e).__name__}: {e}"}
            log.error("receiving version %d failed: %s", offer.version, e)

    def _direct(
        self, offer: Offer, dests: list[torch.Tensor], items: list[tuple[str, torch.Tensor]], groups: list[tuple[int, int]],
    ) -> Any:
        """One broadcast per tensor into ``dests``, by ``groups`` (:func:`groups_of`),
        yielding each tensor's view once its group is enqueued."""
        for lo, hi in groups:
            self._recv_group(offer, dests[lo:hi])
            yield from items[lo:hi]

    def _recv_group(self, offer: Offer, bufs: list[torch.Tensor]) -> None:
        """One group of a ``direct`` offer's tensors (a coalesced NCCL group when the offer
        says so); on NCCL, what the caller enqueues next on its stream sees the data."""
        work = self.pg.broadcast_many(bufs, offer.timeout, coalesce=offer.group_bytes > 0)
        if work is not None:
            work.wait()  # stream-level

    def _feed(self, offer: Offer, received: Any, stream: Any) -> bool:
        """Hand the received tensors to the sink; whatever it leaves (it failed or stopped
        early) is still received, since every rank must take part in every broadcast."""
        ok = False
        version = offer.version
        try:
            ok = bool(self.sink(version, received, stream, offer.manifest))
        except Exception as e:
            log.warning("loading version %d while receiving failed (%s: %s); it loads at the swap", version, type(e).__name__, e)
            if self.sink_invalidate is not None:
                self.sink_invalidate()
        for _ in received:  # drain: the rest of the broadcasts
            pass
        return ok

    def take(self, version: int) -> list[tuple[str, torch.Tensor]]:
        if self.staged is None or self.staged[0] != version:
            raise WeightSyncError(f"version {version} is not staged here (staged: {self.staged[0] if self.staged else None})")
        if self.staged[1] is None:
            raise WeightSyncError(f"version {version} was received into the shadow weights, which no longer hold it")
        return self.staged[1]


# ----------------------------------------------------------------------------------------
# replica side (in the consumer process): drives its workers, acks to the trainer
# ----------------------------------------------------------------------------------------
class ReplicaReceiver:
    """Gets this replica's workers into the trainer's broadcast group and tells the follower
    which versions they staged.

    Used as ``WeightFollower.receiver``. It reacts to ``wgroup`` hints and also checks the
    group record every ``poll_interval`` seconds; offers are followed by the workers
    themselves (:meth:`WorkerReceiver.listen`), so no engine RPC sits on the update path
    before the swap.
    """

    def __init__(self, follower: Any, poll_interval: float = 1.0):
        self.follower = follower
        self.consumer = follower.consumer
        self.engine = follower.engine
        self.keys = self.consumer.keys
        self.poll_interval = poll_interval
        self.group: str | None = None
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._client: Any = None

    @property
    def num_workers(self) -> int:
        return int(getattr(self.engine, "num_workers", 1))

    def fields(self) -> list[str]:
        """This replica's workers' fields in an offer's ack hash."""
        return [f"{self.consumer.id}/{i}" for i in range(self.num_workers)]

    async def start(self, client: Any) -> None:
        self._client = client
        self.consumer.add_control_handler(self._on_control)
        self._task = asyncio.create_task(self._loop(), name="rollq-broadcast-receiver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.group is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.call_workers("rollq_leave_group"), 30)

    def _on_control(self, verb: Control, arg: str) -> None:
        if verb is Control.WGROUP:
            self._kick.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("broadcast receiver: %s: %s", type(e).__name__, e)
            try:
                await asyncio.wait_for(self._kick.wait(), self.poll_interval)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()

    async def check(self) -> None:
        g = await self._client.hget(self.keys.weights_group, "d")
        if g is None:
            return
        info = msgspec.msgpack.decode(g, type=GroupInfo)
        if info.id != self.group:
            await self._join(info)

    async def _join(self, info: GroupInfo) -> None:
        n = self.num_workers
        end = await self._client.hincrby(self.keys.weights_group, "next_rank", n)
        offset = end - n
        if end > info.world_size:
            log.warning("broadcast group %s is full (world size %d); loading versions from memmap", info.id, info.world_size)
            self.group = info.id  # do not retry this group
            return
        self.group = None
        # full_url: a cluster URL stays one in the workers (url has the cluster flag stripped)
        listen = Listen(url=self.consumer.redis_settings.full_url, channel=self.keys.control,
                        offer_key=self.keys.weights_offer, field=f"{self.consumer.id}/",
                        layouts_key=self.keys.weights_layouts, version_key=self.keys.version)
        await self.engine.call_workers("rollq_join_group", msgspec.msgpack.encode(info), offset, msgspec.msgpack.encode(listen))
        await self._wait_workers(lambda s: s.get("group") == info.id and s.get("joined"), info.timeout + 5, "join")
        self.group = info.id
        log.info("replica %s joined broadcast group %s as ranks %d..%d", self.consumer.id, info.id, offset, end - 1)

    async def _wait_workers(self, done: Any, timeout: float, what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            states = await self.engine.call_workers("rollq_receive_status")
            if states and all(done(s) for s in states):
                return states
            failed = [s for s in states if s.get("state") == "failed"]
            if failed and what == "join":
                raise WeightSyncError(f"workers failed to join the broadcast group: {failed}")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"workers did not finish {what} within {timeout:.0f}s: {states}")
            await asyncio.sleep(0.01)

    async def staged_for(self, rec: VersionRecord, acks: list[Any] | None = None) -> int | None:
        """``rec.version`` if every worker of this replica staged it (its acks say ``ok``);
        ``acks``: the ack fields of this replica, already read."""
        if rec.group is None or rec.group != self.group:
            return None
        if acks is None:
            acks = await self._client.hmget(self.keys.weights_acks(rec.version), self.fields())
        if all(a is not None and a.startswith(b"ok") for a in acks):
            return rec.version
        return None

    async def apply_staged(self, rec: VersionRecord, staged: int, timeout: float) -> dict[str, Any]:
        try:
            res = await asyncio.wait_for(self.engine.call_workers("rollq_apply_staged", staged), timeout)
        except asyncio.TimeoutError as e:
            raise WeightSyncTimeout(f"swapping in staged version {staged} took longer than {timeout}s") from e
        return res[0] if res else {}
