"""How long a publisher exposes a version over IPC, and its release.

Each publisher exposes one IPC version at a time (:data:`EXPOSED`, written by
:class:`~rollq.weightsync.transports.ipc.IpcSend`); :func:`release` ends it at once, and
:func:`release_when_copied` (``WeightPublisher.release_weights``) once every live replica on the
host that follows versions has copied it: its follower's record in ``QueueKeys.weights_ipc_copied``,
its watching workers' statuses in ``QueueKeys.weights_ipc_staged`` or the version it serves say
so. A leased version's direct swaps claim it (``QueueKeys.weights_ipc_claims``) and cannot be
refused once they copy: its release refuses new claims (:data:`IPC_RELEASE`) and waits for
those made before.

>>> await pub.release_weights(timeout=10)   # calls release_when_copied   # doctest: +SKIP
{'replica-0': 3}
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import msgspec

from ...connection import Script, text
from ..wire import StageStatus, State
from .base import PublisherSide

if TYPE_CHECKING:
    from ...keys import QueueKeys
    from ..trainer.ipc_export import Exposure, ShareTable

log = logging.getLogger(__name__)

#: A publisher's start of a leased version's release (``QueueKeys.weights_ipc_claims``): no
#: replica claims the version for a direct swap from then on.
IPC_RELEASE = Script("ipc_release")

#: The version each publisher exposes now (released when it exposes the next one).
EXPOSED: weakref.WeakKeyDictionary[PublisherSide, Exposure] = weakref.WeakKeyDictionary()
#: The messages of the storages each publisher's last IPC version shared, for its next one
#: (:class:`~rollq.weightsync.trainer.ipc_export.ShareTable`; kept across releases).
SHARES: weakref.WeakKeyDictionary[PublisherSide, ShareTable] = weakref.WeakKeyDictionary()


def release(publisher: PublisherSide, forget: bool = False) -> bool:
    """Stop exposing ``publisher``'s current IPC version (a replica copying it refuses it) and
    free its snapshot; False when it exposes none. ``forget``: also drop the messages kept for
    its next version, and the trainer's storages they hold (``WeightPublisher.close`` does)."""
    if forget:
        SHARES.pop(publisher, None)
    x = EXPOSED.pop(publisher, None)
    if x is None:
        return False
    x.release()
    return True


async def release_when_copied(publisher: PublisherSide, timeout: float, poll: float = 0.002) -> dict[str, int]:
    """Wait (``timeout`` seconds at most) until every live replica on this host that follows
    versions (its follower registered) has finished copying the version ``publisher``
    exposes, then release it (:func:`release`). Returns ``{replica: version}`` of those
    replicas: the newest version each has copied or serves. A replica still copying at the
    timeout is named in a warning; releasing the version makes it refuse its copy, so nothing
    it serves mixes two versions. A leased version is then marked released in Redis, and the
    direct swaps that claimed it before are waited for (:func:`_end_claims`): those cannot be
    refused once they copy."""
    x = EXPOSED.get(publisher)
    if x is None:
        return {}
    version, host = x.handles.version, x.handles.host
    deadline = time.monotonic() + timeout
    client = await publisher.redis()
    try:
        while True:
            got = await _copies(client, publisher.keys, host)
            behind = sorted(r for r, v in got.items() if v < version)
            if not behind:
                break
            if time.monotonic() > deadline:
                log.warning("version %d released after %.1fs with %d replica(s) on this host still copying it: %s",
                            version, timeout, len(behind), ", ".join(r[:64] for r in behind[:5]))
                break
            await asyncio.sleep(poll)
            poll = min(poll * 2, 0.02)
        if x.handles.lease:
            await _end_claims(client, publisher.keys, version)
        return got
    finally:
        if EXPOSED.get(publisher) is x:
            release(publisher)


async def _end_claims(client: Any, keys: QueueKeys, version: int, poll: float = 0.001) -> None:
    """Start releasing leased ``version`` (no replica claims it from now on) and wait until
    every direct swap that claimed it has ended: its claim removed, past its deadline, or held
    by a replica no longer alive. The claims' deadlines bound the wait (trainer and replicas
    share the host's clock)."""
    from ...replicas import live_replicas

    flat = await IPC_RELEASE(client, [keys.weights_ipc_claims], [version])
    held = _claims(dict(zip(flat[::2], flat[1::2])), version)
    if not held:
        return
    alive = set(await live_replicas(client, keys))
    t0 = checked = time.monotonic()
    warned = False
    while held := {r: d for r, d in held.items() if r in alive and d > time.time() * 1000}:
        if not warned and time.monotonic() - t0 > 5.0:
            warned = True
            log.warning("releasing version %d waits for the direct swap of %s", version, ", ".join(r[:64] for r in list(held)[:5]))
        await asyncio.sleep(poll)
        poll = min(poll * 2, 0.01)
        held = _claims(await client.hgetall(keys.weights_ipc_claims), version)
        if time.monotonic() - checked > 1.0:  # a replica that died holding its claim
            alive, checked = set(await live_replicas(client, keys)), time.monotonic()


def _claims(raw: dict[Any, Any], version: int) -> dict[str, float]:
    """``{replica: deadline ms}`` of the claims of ``version`` or older in ``raw`` (the claims
    hash, as HGETALL gives it)."""
    out: dict[str, float] = {}
    for k, v in raw.items():
        name = text(k)
        if not name.startswith("c:"):
            continue
        try:
            claimed, deadline = text(v).split()
            if int(claimed) <= version:
                out[name[2:]] = float(deadline)
        except ValueError:  # not a claim this build writes
            continue
    return out


async def _copies(client: Any, keys: QueueKeys, host: str) -> dict[str, int]:
    """``{replica: version}`` of the live replicas on ``host`` that follow versions (their
    followers registered in ``weights_ipc_copied``): the newest version each has finished
    copying over IPC (its follower's record, its watching workers' statuses) or serves."""
    from ...replicas import live_replicas

    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.weights_ipc_copied)
    pipe.hgetall(keys.weights_ipc_staged)
    registered, watched = await pipe.execute()
    following = {text(k): _int(v) for k, v in registered.items()}
    replicas = {r: info.version for r, info in (await live_replicas(client, keys)).items()
                if info.host == host and r in following}
    if not replicas:
        return {}
    by_worker: dict[str, list[int]] = {}
    for k, raw in watched.items():
        st = watcher_status(raw)
        if st is not None:  # a copy under way, left to a direct swap, or left to the follower (BUSY)
            by_worker.setdefault(text(k).rpartition("/")[0], []).append(  # counts as the version before it
                st.version - (st.state in (State.STAGING, State.BUSY) or bool(st.direct)))
    for r, v in replicas.items():
        replicas[r] = max(v, following[r], min(by_worker.get(r, [0])))
    return replicas


def _int(raw: bytes | None) -> int:
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0


def watcher_status(raw: bytes | None) -> StageStatus | None:
    """A watcher's status as it wrote it (None: none, or not a status)."""
    try:
        return msgspec.msgpack.decode(raw, type=StageStatus) if raw else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
