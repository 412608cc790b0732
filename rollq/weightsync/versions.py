"""Durable policy versions: the record in Redis, its announcement, and reading it back.

A version becomes visible only once its data is complete. The order is always: data, commit
marker with checksum, then :func:`commit_version` (record + log entry + pub/sub hint, one Lua
script, refused unless newer than the current record). Replicas subscribe for speed but
reconcile with :func:`read_version` on start, on reconnect and periodically.

The record lives in shard 0 of a sharded queue (rollq/shards.py). Each other shard's
version hash holds a mirror of field ``v`` only, which its SUBMIT calls read for the
staleness bound: :func:`commit_version` writes it after each commit (never lowering it; the
shards live in other slots, so the two steps cannot be one script). A mirror can lag the
record (a publisher that dies between the two steps): a lagging shard admits less, never
more, than the bound allows, and :func:`heal_mirrors` finishes the step without a new
version. A producer runs it when a shard other than 0 refuses a call, before it waits or
raises, and the replica that holds shard 0's reclaimer role runs it every reclaim turn.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from redis.exceptions import NoScriptError

from ..connection import PUBLISH_VERSION, Client, Script
from ..keys import QueueKeys
from ..protocol import SCHEMA_VERSION


_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
}


def tensor_nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of ``dtype`` (torch's name without ``torch.``) and ``shape``.

    >>> tensor_nbytes("bfloat16", [3, 4])
    24
    """
    n = 1
    for d in shape:
        n *= d
    return n * _ITEMSIZE[dtype]


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    """Name, dtype (torch name without ``torch.``) and shape of one tensor."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


class VersionRecord(msgspec.Struct, kw_only=True):
    """What a replica needs to load one committed policy version."""

    v: int = SCHEMA_VERSION
    version: int
    transport: str  # a name of rollq.weightsync.transports.factory.REPLICA: "memmap", "nccl", "gloo", "ipc"
    checksum: str  # rollq.weightsync.checksum.state_checksum of the full state
    num_tensors: int
    nbytes: int
    published_at: float = msgspec.field(default_factory=time.time)
    #: memmap slot (a directory name under the store root) holding this version, if any.
    memmap_slot: str | None = None
    #: NCCL/gloo group that carried it (replicas in that group already staged it).
    group: str | None = None
    #: Publisher's own timings, for dashboards.
    timings: dict[str, float] = {}
    trainer: str = ""
    #: The floating-point dtypes of the published tensors (torch names, sorted): a replica
    #: serving another dtype converts them, and says so (``ReplicaInfo.served_dtype``).
    dtypes: list[str] = []


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(VersionRecord)


def encode_record(r: VersionRecord) -> bytes:
    return _enc.encode(r)


def decode_record(data: bytes) -> VersionRecord:
    r = _dec.decode(data)
    if r.v != SCHEMA_VERSION:
        from ..errors import SchemaVersionError

        raise SchemaVersionError(f"version record schema {r.v} is not supported (this build: {SCHEMA_VERSION})")
    return r


#: Sets one shard's mirror of the version (rollq/lua/mirror_version.lua).
MIRROR_VERSION = Script("mirror_version")


async def commit_version(client: Client, keys: QueueKeys, record: VersionRecord, log_maxlen: int = 10_000) -> bool:
    """Record ``record`` as the current version if it is newer; log and announce it; on a
    sharded queue, mirror it into every other shard (:func:`mirror_version`).

    The commit script also returns the queue's shard count, so a queue of one shard costs
    no command more than the commit."""
    base = keys.base
    shards = await PUBLISH_VERSION(
        client, [base.version, base.versions_log, base.config],
        [record.version, encode_record(record), base.control, log_maxlen],
    )
    if shards and int(shards) > 1:
        await mirror_version(client, keys, record.version, int(shards))
    return bool(shards)


async def mirror_version(client: Client, keys: QueueKeys, version: int, shards: int) -> None:
    """Set field ``v`` of the version hash of shards ``1 .. shards-1`` to ``version`` unless
    one holds a newer one (each shard's SUBMIT calls read it for the staleness bound)."""
    for attempt in (0, 1):
        # One pipelined round trip (per node on a cluster); each call touches one shard's slot.
        pipe = client.pipeline(transaction=False)
        for shard in keys.shards(shards)[1:]:
            # execute_command: redis-py's cluster pipeline refuses pipe.evalsha
            pipe.execute_command("EVALSHA", MIRROR_VERSION.sha, 1, shard.version, version)
        replies = await pipe.execute(raise_on_error=False)
        if attempt or not any(isinstance(r, NoScriptError) for r in replies):
            break
        # A missing script fails its calls before they run; the mirror never lowers a
        # version, so running every call again is safe.
        await MIRROR_VERSION.ensure_loaded(client)
    for r in replies:
        if isinstance(r, Exception):
            raise r


async def heal_mirrors(client: Client, keys: QueueKeys, shards: int) -> bool:
    """Mirror the committed version into the shards ``1 .. shards-1`` whose mirror lags it
    (a publisher died between its commit and :func:`mirror_version`). Returns whether one
    lagged. Two reads when none lags: the record, then the mirrors (a commit in between
    only makes a mirror read newer)."""
    if shards <= 1:
        return False
    raw = await client.hget(keys.base.version, "v")
    if raw is None:
        return False
    version = int(raw)
    pipe = client.pipeline(transaction=False)
    for shard in keys.shards(shards)[1:]:
        pipe.hget(shard.version, "v")
    mirrors = await pipe.execute()
    if all(m is not None and int(m) >= version for m in mirrors):
        return False
    await mirror_version(client, keys, version, shards)
    return True


async def read_version(client: Client, keys: QueueKeys) -> VersionRecord | None:
    """The current committed version record, or None if none was ever published."""
    data = await client.hget(keys.version, "d")
    return decode_record(data) if data else None


class LoadError(msgspec.Struct, kw_only=True):
    """Why one replica cannot load a committed version (``QueueKeys.load_errors``)."""

    version: int
    error: str  # exception class name
    message: str
    at: float = msgspec.field(default_factory=time.time)
    attempts: int = 1
    #: True: the replica will not try this version again (a newer one is needed).
    final: bool = False


_load_err_dec = msgspec.msgpack.Decoder(LoadError)


async def report_load_error(client: Client, keys: QueueKeys, replica: str, err: LoadError) -> None:
    await client.hset(keys.load_errors, replica, _enc.encode(err))


async def read_load_errors(client: Client, keys: QueueKeys) -> dict[str, LoadError]:
    """Every replica's recorded load error (a replica's entry is removed once it loads a version)."""
    out = {}
    for k, v in (await client.hgetall(keys.load_errors)).items():
        try:
            out[k.decode() if isinstance(k, bytes) else k] = _load_err_dec.decode(v)
        except msgspec.DecodeError:
            continue
    return out


async def version_log(client: Client, keys: QueueKeys, count: int = 100) -> list[dict[str, Any]]:
    """The latest ``count`` committed versions, newest first (for dashboards)."""
    out = []
    for _eid, fields in await client.xrevrange(keys.versions_log, count=count):
        try:
            r = decode_record(fields[b"d"])
        except Exception:
            continue
        out.append(msgspec.structs.asdict(r))
    return out
