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

With ``transport="nccl"`` the tensors are broadcast from this process (rank 0) to every
replica worker that joined the group (:class:`~rollq.weightsync.sender.BroadcastSender`); on
any failure or timeout the group is dropped (rebuilt next time) and the same version is
published through memmap instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable, Mapping, Sequence

import msgspec
import torch

from ..connection import connect
from ..errors import StaleVersion, WeightLoadFailed, WeightSyncError, WeightSyncTimeout
from ..keys import QueueKeys
from ..replicas import heartbeating
from ..settings import DEFAULT_QUEUE, RedisSettings
from .base import Sender
from .manifest import Manifest, check_state, decode_manifest, read_manifest
from .memmap import MemmapStore, named_tensors
from .versions import LoadError, TensorMeta, VersionRecord, commit_version, read_load_errors, read_version

log = logging.getLogger(__name__)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


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
    ):
        self.redis_settings = url if isinstance(url, RedisSettings) else RedisSettings.from_url(url)
        self.keys = QueueKeys(queue)
        self.store = MemmapStore(root, keep=keep) if root else None
        #: What carries transport="nccl" (a :class:`~rollq.weightsync.sender.BroadcastSender`).
        self.sender = sender
        self.trainer_id = trainer_id
        self.validate = validate
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

    async def _c(self) -> Any:
        if self._client is None:
            self._client = connect(self.redis_settings)
        return self._client

    async def current_version(self) -> int:
        rec = await read_version(await self._c(), self.keys)
        return rec.version if rec else 0

    async def publish_weights(
        self,
        state: Mapping[str, torch.Tensor] | torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        transport: str = "memmap",
    ) -> VersionRecord:
        """Publish ``state`` as ``version`` (default: the recorded version + 1).

        Raises :class:`~rollq.errors.WeightMismatch` (before anything is written or sent)
        when ``state`` does not match the served model; see the module docstring.
        """
        client = await self._c()
        items = await self._checked(named_tensors(state))
        current = await self.current_version()
        if version is None:
            version = max(current, self._last) + 1
        elif version <= current:
            raise StaleVersion(f"version {version} is not newer than the recorded version {current}")
        t0 = time.perf_counter()
        if transport == "nccl":
            rec = await self._publish_nccl(version, items)
        elif transport == "memmap":
            rec = await self._publish_memmap(version, items)
        else:
            raise ValueError(f"unknown transport {transport!r} (memmap, nccl)")
        rec.timings["total_s"] = time.perf_counter() - t0
        if not await commit_version(client, self.keys, rec):
            raise StaleVersion(f"version {version} lost a race: a newer version was recorded meanwhile")
        self._last = version
        log.info("published policy version %d via %s (%.1f MB, %.3fs)", version, rec.transport, rec.nbytes / 1e6, rec.timings["total_s"])
        return rec

    # -- checking against the served model -----------------------------------------------
    async def served_manifests(self) -> dict[str, Manifest]:
        """The checkpoint manifests published by live replicas, by replica id."""
        client = await self._c()
        raw = await client.hgetall(self.keys.manifests)
        if not raw:
            return {}
        names = [_s(k) for k in raw]
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
        client = await self._c()
        if version is None:
            version = self._last or await self.current_version()
        wanted = None if replicas is None else list(dict.fromkeys(replicas))
        deadline = time.monotonic() + timeout
        while True:
            registry = await client.hgetall(self.keys.consumers)
            errors = await read_load_errors(client, self.keys)
            names = [_s(k) for k in registry]
            alive = dict(zip(names, await heartbeating(client, self.keys, names)))
            served: dict[str, int] = {}
            for k, data in registry.items():
                try:
                    served[_s(k)] = int(msgspec.msgpack.decode(data).get("version", 0))
                except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
                    served[_s(k)] = 0
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

    async def _publish_memmap(self, version: int, items: list[tuple[str, torch.Tensor]], **extra: Any) -> VersionRecord:
        if self.store is None:
            raise WeightSyncError("memmap transport needs a root directory (WeightPublisher(root=...))")
        info = await asyncio.to_thread(self.store.write, version, items)
        return VersionRecord(
            version=version, transport="memmap", checksum=info.checksum, num_tensors=len(items),
            nbytes=info.nbytes, memmap_slot=info.slot, trainer=self.trainer_id,
            timings={"write_s": info.write_s, "checksum_s": info.checksum_s, "pinned": float(info.pinned)}, **extra,
        )

    async def _publish_nccl(self, version: int, items: list[tuple[str, torch.Tensor]]) -> VersionRecord:
        if self.sender is None:
            raise WeightSyncError("nccl transport needs a sender (WeightPublisher(sender=BroadcastSender(...)))")
        try:
            rec = await self.sender.send(version, items, await self._c(), self.keys)
            rec.trainer = self.trainer_id
            return rec
        except Exception as e:
            log.warning("broadcast of version %d failed (%s: %s); falling back to memmap", version, type(e).__name__, e)
            await self.sender.reset()
            if self.store is None:
                raise
            rec = await self._publish_memmap(version, items)
            rec.timings["nccl_failed"] = 1.0
            return rec

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _why(e: LoadError) -> str:
    return f"version {e.version}: {e.error}: {e.message[:300]}" + ("" if e.final else f"; retrying, attempt {e.attempts}")
