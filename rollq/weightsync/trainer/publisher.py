"""Trainer side of weight sync: publish a new policy version.

>>> pub = WeightPublisher(url, queue="grpo", root="/dev/shm/rollq-weights")   # doctest: +SKIP
>>> rec = await pub.publish_weights(model.state_dict())                      # doctest: +SKIP
>>> rec.version                                                              # doctest: +SKIP
1
>>> await pub.wait_for_replicas(rec.version, timeout=60)   # {replica: version served}  # doctest: +SKIP
{'replica-0': 1}

Before anything is written, the state dict is checked against the checkpoint manifest the
live replicas published (:mod:`rollq.weightsync.manifest`): names, shapes and dtypes must
match (the ``model.``-less form and a tied ``lm_head.weight`` are accepted and renamed or
dropped), else :class:`~rollq.errors.WeightMismatch` names the first mismatches and no
replica is touched. ``validate=False`` skips it; ``expected=`` gives the manifest instead.

Order of operations (a version is visible only once complete): write the data into the
next memmap slot, write its commit marker with the checksum, then record the version in
Redis (durable), then announce it on pub/sub, then append it to the version log (the last
three in one Lua script, refused unless the version is newer than the recorded one).

With ``transport="nccl"`` (or ``"gloo"``, ``"broadcast"``: the sender's backend decides) the tensors are broadcast from this process (rank 0) to every
replica worker of the group (:class:`~rollq.weightsync.trainer.sender.BroadcastSender`: the group
follows the live replicas). A broadcast that breaks (a member died) is offered once more over
a group formed anew without it; a version that reached only some workers is committed for
those, with a memmap copy for the others when there is a store; on any other failure or
timeout the group is dropped (formed again next time) and the same version is published
through memmap instead. With ``transport="ipc"`` this process exposes the tensors to the
replicas on its host (CUDA IPC or CPU shared memory) until its next IPC version or
:meth:`WeightPublisher.close` (:mod:`rollq.weightsync.transports.ipc_lease`). The transports themselves
live in :mod:`rollq.weightsync.transports`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable, Mapping, Sequence

import msgspec
import torch

from ...connection import connect, text
from ...errors import StaleVersion, WeightLoadFailed, WeightSyncError, WeightSyncTimeout
from ...keys import QueueKeys
from ...replicas import heartbeating
from ...settings import DEFAULT_QUEUE, RedisSettings
from ..base import Sender
from ..manifest import Manifest, check_state, decode_manifest, float_dtypes, read_manifest
from . import param_shards  # parameter shards: the ranks of an FSDP2 trainer
from ..memmap import MemmapStore, SlotInfo, named_tensors
from ..transports import trainer_transport
from ..transports.broadcast import BroadcastSend
from ..versions import (
    LoadError, TensorMeta, VersionRecord, commit_version, decode_record, encode_record, read_load_errors, read_version,
)

log = logging.getLogger(__name__)


class WeightPublisher:
    """Publishes policy versions of one queue.

    Args:
        validate: check every state dict against the served model's checkpoint manifest
            before publishing (see the module docstring).
        expected: the manifest to check against (a :class:`~rollq.weightsync.manifest.Manifest`,
            a model folder, or ``TensorMeta`` rows) instead of the ones replicas published.
    """

    def __init__(
        self,
        url: str | RedisSettings | None = None,
        queue: str = DEFAULT_QUEUE,
        *,
        root: str | None = None,
        keep: int = 2,
        sender: Sender | None = None,
        trainer_id: str = "",
        validate: bool = True,
        expected: Manifest | str | Sequence[TensorMeta] | None = None,
        ipc_snapshot: bool = False,
        ipc_lease: bool = False,
    ):
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.keys = QueueKeys(queue)
        self.store = MemmapStore(root, keep=keep) if root else None
        #: What carries transport="nccl" (a :class:`~rollq.weightsync.trainer.sender.BroadcastSender`).
        self.sender = sender
        self.trainer_id = trainer_id
        self.validate = validate
        #: ``transport="ipc"`` exposes a copy of the tensors taken at publish (on their own
        #: device; extra memory: one copy of the version, which each later version of the
        #: same layout is copied into once the last is released), so the trainer may change
        #: its weights in place right after publishing; nothing else writes that copy, so no
        #: checksum is taken or verified. Without it the tensors themselves are exposed
        #: (zero-copy), must not change until the replicas copied them, and are checksummed
        #: here and verified by every replica.
        self.ipc_snapshot = ipc_snapshot
        #: ``transport="ipc"`` exposes the tensors themselves (zero-copy) without a checksum,
        #: on the trainer's promise to change none of them until :meth:`release_weights`
        #: returns, which waits for the replicas on this host to have copied the version.
        #: Neither a copy (as ``ipc_snapshot``) nor the checksums (as the default) are paid.
        self.ipc_lease = ipc_lease
        if ipc_snapshot and ipc_lease:
            raise ValueError("ipc_snapshot and ipc_lease are two ways of exposing a version: choose one")
        if isinstance(expected, str):
            got = read_manifest(expected)
            if got is None:
                raise WeightSyncError(f"expected={expected!r}: no safetensors checkpoint found there")
            expected = got
        elif expected is not None and not isinstance(expected, Manifest):
            expected = Manifest(model="expected", tensors=list(expected))
        self.expected: Manifest | None = expected
        self._client: Any = None
        self._last = 0
        self._unchecked_logged = False

    async def redis(self) -> Any:
        """The publisher's Redis client (connected on first use)."""
        if self._client is None:
            self._client = connect(self.redis_settings)
        return self._client

    async def current_version(self) -> int:
        rec = await read_version(await self.redis(), self.keys)
        return rec.version if rec else 0

    async def publish_weights(
        self,
        state: Mapping[str, torch.Tensor] | torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        transport: str = "memmap",
        *,
        group: Any = None,
    ) -> VersionRecord:
        """Publish ``state`` as ``version`` (default: the recorded version + 1).

        Raises :class:`~rollq.errors.WeightMismatch` (before anything is written or sent)
        when ``state`` does not match the served model; see the module docstring.

        ``group``: the ``torch.distributed`` process group of a sharded trainer (FSDP2
        ``fully_shard``, DTensor state dicts). Every rank of it calls this with its own state
        dict and gets the same record back; no rank gathers the whole model, and only the
        group's rank 0 talks to Redis (see :mod:`rollq.weightsync.trainer.param_shards` for what each
        transport costs per rank). Every rank needs the same ``root`` (shared storage
        across hosts); only rank 0 needs the ``sender``.

        >>> fully_shard(model)                                              # doctest: +SKIP
        >>> pub = WeightPublisher(url, queue="grpo", root="/dev/shm/rollq-weights")  # every rank  # doctest: +SKIP
        >>> rec = await pub.publish_weights(model.state_dict(), group=dist.group.WORLD)  # doctest: +SKIP
        """
        if group is not None:
            return await self._publish_sharded(named_tensors(state), version, transport, group)
        send = trainer_transport(transport)(self)  # UnknownTransport before anything is read or written
        client = await self.redis()
        items = await self._checked(named_tensors(state))
        version = await self._next_version(version)
        t0 = time.perf_counter()
        rec = await send.send(version, items)
        rec.timings["total_s"] = time.perf_counter() - t0
        rec.dtypes = float_dtypes(items)
        if not await commit_version(client, self.keys, rec):
            raise StaleVersion(f"version {version} lost a race: a newer version was recorded meanwhile")
        self._last = version
        log.info("published policy version %d via %s (%.1f MB, %.3fs)", version, rec.transport, rec.nbytes / 1e6, rec.timings["total_s"])
        return rec

    # -- checking against the served model -----------------------------------------------
    async def served_manifests(self) -> dict[str, Manifest]:
        """The checkpoint manifests published by live replicas, by replica id."""
        client = await self.redis()
        raw = await client.hgetall(self.keys.manifests)
        if not raw:
            return {}
        names = [text(k) for k in raw]
        out = {}
        for data, n, alive in zip(raw.values(), names, await heartbeating(client, self.keys, names)):
            if alive:
                try:
                    out[n] = decode_manifest(data)
                except (msgspec.DecodeError, WeightSyncError, ValueError) as e:
                    log.warning("replica %s published an unreadable manifest (%s); not checking against it", n[:128], e)
        return out

    async def _checked(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``items`` renamed to the served names, or WeightMismatch; unchanged when not validating
        or when no manifest is known."""
        if not self.validate:
            return items
        if self.expected is not None:
            return check_state(items, self.expected)
        groups: dict[bytes, tuple[Manifest, list[str]]] = {}
        for replica, m in (await self.served_manifests()).items():
            key = msgspec.msgpack.encode((m.tensors, m.served_dtype))
            groups.setdefault(key, (m, []))[1].append(replica)
        if not groups:
            if not self._unchecked_logged:
                log.debug("no live replica of queue %r published a checkpoint manifest; publishing unchecked", self.keys.queue)
                self._unchecked_logged = True
            return items
        out = items
        for i, (m, replicas) in enumerate(groups.values()):
            who = ", ".join(r[:64] for r in replicas[:3]) + (f" and {len(replicas) - 3} more" if len(replicas) > 3 else "")
            renamed = check_state(items, m, what=f"state dict (checked against replica {who})")
            if i == 0:
                out = renamed
        return out

    # -- waiting for replicas --------------------------------------------------------------
    async def wait_for_replicas(
        self, version: int | None = None, timeout: float = 60.0, replicas: Iterable[str] | None = None, *,
        min_replicas: int = 1, poll: float = 0.05,
    ) -> dict[str, int]:
        """Wait until every live replica (or each of ``replicas``) serves ``version`` or newer
        (default: the version this publisher published last), and at least ``min_replicas``
        live ones do (0: return at once when none is live). Returns ``{replica: version}``.

        Raises :class:`~rollq.errors.WeightLoadFailed` with each failing replica's reason as
        soon as one reports it will not load that version (it needs a newer one), and
        :class:`~rollq.errors.WeightSyncTimeout` naming the laggards after ``timeout`` seconds.

        >>> rec = await pub.publish_weights(model.state_dict())       # doctest: +SKIP
        >>> await pub.wait_for_replicas(rec.version, timeout=30)      # doctest: +SKIP
        {'replica-0': 4, 'replica-1': 4}
        """
        client = await self.redis()
        if version is None:
            version = self._last or await self.current_version()
        wanted = None if replicas is None else list(dict.fromkeys(replicas))
        deadline = time.monotonic() + timeout
        while True:
            registry = await client.hgetall(self.keys.consumers)
            errors = await read_load_errors(client, self.keys)
            names = [text(k) for k in registry]
            alive = dict(zip(names, await heartbeating(client, self.keys, names)))
            served: dict[str, int] = {}
            for k, data in registry.items():
                try:
                    served[text(k)] = int(msgspec.msgpack.decode(data).get("version", 0))
                except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
                    served[text(k)] = 0
            targets = wanted if wanted is not None else [n for n in names if alive.get(n)]
            behind = [n for n in targets if not (alive.get(n) and served.get(n, -1) >= version)]
            if not behind and len(targets) >= min_replicas:
                return {n: served[n] for n in targets}
            failed = {n: e for n, e in errors.items() if n in behind and e.final and e.version >= version}
            if failed:
                raise WeightLoadFailed(
                    f"{len(failed)} replica(s) cannot load policy version {version}: "
                    + "; ".join(f"{n[:64]} ({_why(e)})" for n, e in failed.items()),
                    failures=failed,
                )
            if time.monotonic() > deadline:
                parts = []
                for n in behind:
                    if n not in served:
                        parts.append(f"{n[:64]} (not registered)")
                    elif not alive.get(n):
                        parts.append(f"{n[:64]} (lease expired)")
                    else:
                        e = errors.get(n)
                        parts.append(f"{n[:64]} (at version {served[n]}{'; ' + _why(e) if e else ''})")
                if not parts:
                    parts.append(f"{len(targets)} live replica(s), fewer than min_replicas={min_replicas}")
                raise WeightSyncTimeout(
                    f"waiting for replicas to serve policy version {version} timed out after {timeout}s "
                    f"(wait_for_replicas timeout=): {', '.join(parts)}"
                )
            await asyncio.sleep(poll)

    async def release_weights(self, timeout: float = 30.0) -> dict[str, int]:
        """Wait until every live replica on this host that follows versions has copied the
        version this publisher exposes over IPC, ``timeout`` seconds at most, then stop exposing
        it; the tensors may then change. Returns ``{replica: newest version it copied or
        serves}`` for those replicas (``{}`` when no version is exposed). A replica still
        copying at the timeout refuses the version and takes the next one. With ``ipc_lease``
        call it before every in-place update of the published tensors. A replica swapping the
        version straight from the tensors (``WeightSyncSettings.ipc_direct``) claimed it: the
        release then waits for that swap however long the timeout, until the claim's deadline
        (the replica's ``load_timeout``) or the replica's death:

        >>> pub = WeightPublisher(url, queue="grpo", ipc_lease=True)               # doctest: +SKIP
        >>> await pub.publish_weights(model.state_dict(), transport="ipc")         # doctest: +SKIP
        >>> loss.backward()  # the replicas copy meanwhile                          # doctest: +SKIP
        >>> await pub.release_weights()                                             # doctest: +SKIP
        {'replica-0': 4}
        >>> optimizer.step()                                                        # doctest: +SKIP
        """
        from ..transports.ipc_lease import release_when_copied

        return await release_when_copied(self, timeout)

    async def _next_version(self, version: int | None) -> int:
        current = await self.current_version()
        if version is None:
            return max(current, self._last) + 1
        if version <= current:
            raise StaleVersion(f"version {version} is not newer than the recorded version {current}")
        return version

    def memmap_record(self, info: SlotInfo, **extra: Any) -> VersionRecord:
        return VersionRecord(
            version=info.version, transport="memmap", checksum=info.checksum, num_tensors=len(info.manifest),
            nbytes=info.nbytes, memmap_slot=info.slot, trainer=self.trainer_id,
            timings={"write_s": info.write_s, "checksum_s": info.checksum_s, "pinned": float(info.pinned)}, **extra,
        )

    # -- a sharded trainer: every rank of ``group`` calls publish_weights ---------------------
    async def _publish_sharded(self, items: list[tuple[str, torch.Tensor]], version: int | None, transport: str, group: Any) -> VersionRecord:
        """Rank 0 decides (names, version) and tells the others; every rank moves its part;
        rank 0 commits and hands every rank the record (rollq.weightsync.trainer.param_shards)."""
        import torch.distributed as dist

        first = dist.get_rank(group) == 0
        failure: BaseException | None = None
        plan = _Plan()
        if first:
            try:
                plan = await self._sharded_plan(items, version, transport)
            except Exception as e:  # noqa: BLE001 - told to every rank, then raised
                failure, plan = e, _Plan(error=type(e).__name__, message=str(e))
        plan = await _agree(plan, first, group)
        if plan.error:
            raise failure if failure is not None else _remote(plan.error, plan.message)
        items = [(n, items[i][1]) for n, i in zip(plan.names, plan.sources)]
        t0 = time.perf_counter()
        rec: VersionRecord | None = None
        memmap = plan.transport == "memmap"
        if not memmap:
            if first:
                rec, failure = await self._stream_broadcast(plan.version, items, plan.bucket_bytes)
            else:
                await param_shards.in_thread(param_shards.gather_all, items, plan.bucket_bytes)
            out = _Plan()
            if failure is not None:
                out = _Plan(error=type(failure).__name__, message=str(failure))
            elif rec is not None and rec.timings.get("missing") and plan.slot:
                out = _Plan(copy=True)  # some workers did not ack: a memmap copy for them
            out = await _agree(out, first, group)
            if out.error and not plan.slot:
                raise failure if failure is not None else _remote(out.error, out.message)
            memmap = bool(out.error) or out.copy  # failed: the same version through memmap
        if memmap:
            info = await param_shards.in_thread(param_shards.write_parts, self.store, plan.version, plan.slot, items, group)
            if info is not None and rec is not None:
                rec.memmap_slot, rec.checksum = info.slot, info.checksum
            elif info is not None:
                rec = self.memmap_record(info)
                if failure is not None:
                    rec.timings["nccl_failed"] = 1.0
        done = _Plan()
        if first:
            assert rec is not None
            rec.timings.update(total_s=time.perf_counter() - t0, ranks=float(dist.get_world_size(group)))
            rec.dtypes = float_dtypes(items)  # a parameter shard has its whole tensor's dtype
            try:
                if not await commit_version(await self.redis(), self.keys, rec):
                    raise StaleVersion(f"version {plan.version} lost a race: a newer version was recorded meanwhile")
                done = _Plan(record=encode_record(rec))
            except Exception as e:  # noqa: BLE001 - told to every rank, then raised
                failure, done = e, _Plan(error=type(e).__name__, message=str(e))
        done = await _agree(done, first, group)
        if done.error:
            raise failure if failure is not None and first else _remote(done.error, done.message)
        self._last = plan.version
        if first:
            log.info("published policy version %d from %d ranks via %s (%.1f MB, %.3fs)", plan.version,
                     dist.get_world_size(group), rec.transport, rec.nbytes / 1e6, rec.timings["total_s"])
        return decode_record(done.record)

    async def _sharded_plan(self, items: list[tuple[str, torch.Tensor]], version: int | None, transport: str) -> _Plan:
        """Rank 0: what every rank sends, in which order and under which names, as which version."""
        broadcast = trainer_transport(transport) is BroadcastSend  # UnknownTransport for an unknown name
        if not broadcast and transport != "memmap":
            raise WeightSyncError(f"a sharded trainer publishes over memmap or a broadcast, not {transport!r}")
        if not broadcast and self.store is None:
            raise WeightSyncError("memmap transport needs a root directory (WeightPublisher(root=...))")
        if broadcast:
            if self.sender is None:
                raise WeightSyncError("the broadcast needs a sender on rank 0 (WeightPublisher(sender=BroadcastSender(...)))")
            if getattr(self.sender, "verify", False):
                raise WeightSyncError("a sharded trainer's broadcast cannot be verified (BroadcastSender(verify=True)): "
                                      "the checksum would need the whole state first; use verify=False")
        stand_ins = param_shards.stand_ins(items)  # global shapes, no gathering
        at = {id(t): i for i, (_, t) in enumerate(stand_ins)}
        checked = await self._checked(stand_ins)
        version = await self._next_version(version)
        return _Plan(
            version=version, transport="broadcast" if broadcast else "memmap", names=[n for n, _ in checked], sources=[at[id(t)] for _, t in checked],
            bucket_bytes=int(getattr(self.sender, "bucket_bytes", 0)) if broadcast else 0,
            slot=self.store.slot_for(version) if self.store is not None else "",
        )

    async def _stream_broadcast(self, version: int, items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[VersionRecord | None, BaseException | None]:
        """Rank 0: broadcast the buckets all ranks gather; (record, None) or (None, why not)."""
        assert self.sender is not None
        src = param_shards.StreamedItems(items, bucket_bytes)
        try:
            rec = await self.sender.send(version, src, await self.redis(), self.keys, manifest=src.manifest)  # type: ignore[call-arg]
            rec.trainer = self.trainer_id
            rec.timings["gathered_peak_bytes"] = float(src.peak_bytes)
            return rec, None
        except Exception as e:  # noqa: BLE001 - the ranks fall back to memmap together
            log.warning("broadcast of version %d failed (%s: %s); falling back to memmap", version, type(e).__name__, e)
            await self.sender.reset()
            return None, e
        finally:
            await param_shards.in_thread(src.drain)  # the other ranks gather every bucket: match them

    async def close(self) -> None:
        from ..transports.ipc_lease import release

        release(self, forget=True)  # a version exposed over IPC is no longer
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class _Plan(msgspec.Struct, omit_defaults=True):
    """What rank 0 of a sharded trainer tells the other ranks (a plan, an outcome or a record)."""

    version: int = 0
    transport: str = ""
    #: Served names, in order, and each one's position in the rank's own state dict.
    names: list[str] = []
    sources: list[int] = []
    bucket_bytes: int = 0
    slot: str = ""  # the memmap slot of the version ("": no store, no memmap)
    copy: bool = False  # write a memmap copy of a broadcast version too
    record: bytes = b""  # the committed VersionRecord, encoded
    error: str = ""  # exception class name: rank 0 failed, every rank raises
    message: str = ""


async def _agree(msg: _Plan, first: bool, group: Any) -> _Plan:
    data = await param_shards.in_thread(param_shards.broadcast_bytes, msgspec.msgpack.encode(msg) if first else None, group)
    return msgspec.msgpack.decode(data, type=_Plan)


def _remote(error: str, message: str) -> WeightSyncError:
    """Rank 0's failure, as raised on the other ranks (the same class where it is rollq's)."""
    from ... import errors

    cls = getattr(errors, error, None)
    text = f"rank 0 of the trainer group failed: {message}"
    if isinstance(cls, type) and issubclass(cls, WeightSyncError):
        try:
            return cls(text)
        except TypeError:
            pass
    return WeightSyncError(f"rank 0 of the trainer group failed: {error}: {message}")


def _why(e: LoadError) -> str:
    return f"version {e.version}: {e.error}: {e.message[:300]}" + ("" if e.final else f"; retrying, attempt {e.attempts}")
