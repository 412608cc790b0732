"""Durable policy versions: the record in Redis, its announcement, and reading it back.

A version becomes visible only once its data is complete. The order is always: data, commit
marker with checksum, then :func:`commit_version` (record + log entry + pub/sub hint, one Lua
script, refused unless newer than the current record). Replicas subscribe for speed but
reconcile with :func:`read_version` on start, on reconnect and periodically.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..connection import PUBLISH_VERSION, Client
from ..keys import QueueKeys
from ..protocol import SCHEMA_VERSION


_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
}


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    """Name, dtype (torch name without ``torch.``) and shape of one tensor."""

    name: str
    dtype: str
    shape: list[int]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEMSIZE[self.dtype]


class VersionRecord(msgspec.Struct, kw_only=True):
    """What a replica needs to load one committed policy version."""

    v: int = SCHEMA_VERSION
    version: int
    transport: str  # "memmap" | "nccl"
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


async def commit_version(client: Client, keys: QueueKeys, record: VersionRecord, log_maxlen: int = 10_000) -> bool:
    """Record ``record`` as the current version if it is newer; log and announce it."""
    ok = await PUBLISH_VERSION(
        client, [keys.version, keys.versions_log], [record.version, encode_record(record), keys.control, log_maxlen]
    )
    return bool(ok)


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
