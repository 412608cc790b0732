"""The messages between an RL run's trainer process and the process hosting its replicas.

:class:`~rollq.rl.replica_host.ReplicasProcess` (the trainer's side) and the host process
(``python -m rollq.rl._host_main``) talk over one Unix socket: frames of a 4-byte
big-endian length and a msgpack body, typed by the structs below. The trainer sends a
:class:`HostConfig` first (answered by the :class:`Reply` of ``seq`` 0), then :data:`Call`\ s,
each numbered by its ``seq`` and answered by the :class:`Reply` of that ``seq``, in the order
the calls end: several may run at once, and a call its caller gave up on is withdrawn by a
:class:`Cancel` (its reply, if one comes, answers nothing). Nothing is pickled.

>>> data = frame(encode(Attach(queue="rl-sync", weights_root=None)))
>>> len(data) - 4 == int.from_bytes(data[:4], "big")
True
>>> decode_call(data[4:])
Attach(queue='rl-sync', weights_root=None, abort_resume=False, seq=0)
>>> decode_reply(encode(Reply(ok=False, error_type="TimeoutError", error="...", seq=7))).seq
7
>>> decode_call(encode(HostConfig(url="redis://x", queue="q", v=99)))
Traceback (most recent call last):
rollq.errors.SchemaVersionError: a call of schema version 99 (this build: 2)
"""

from __future__ import annotations

import asyncio
from typing import Any, Union

import msgspec
from msgspec import UNSET, UnsetType

from ..errors import ProtocolError, SchemaVersionError
from .replicas import ReplicaSnapshot

__all__ = [
    "Attach", "Call", "Cancel", "Detach", "HOST_WIRE_VERSION", "HostConfig", "MAX_FRAME", "Reply", "Snapshot", "Stop",
    "WaitVersion", "decode_call", "decode_config", "decode_reply", "encode", "frame", "read_frame", "seq_of",
]

#: The version of these messages; a peer of another version is refused.
HOST_WIRE_VERSION = 2
#: The largest frame either side accepts (a snapshot of many updates stays far below it).
MAX_FRAME = 16 << 20


class HostConfig(msgspec.Struct, tag="config", kw_only=True):
    """What the host process builds: :class:`~rollq.rl.replicas.Replicas`' arguments (those
    left unset take ``Replicas``' own defaults), and the cores the host pins itself to (None:
    wherever the OS puts it)."""

    url: str
    queue: str
    weights_root: str | None | UnsetType = UNSET
    count: int | UnsetType = UNSET
    engine: str | UnsetType = UNSET
    model: str | None | UnsetType = UNSET
    max_model_len: int | UnsetType = UNSET
    kv_cache_memory_bytes: int | None | UnsetType = UNSET
    broadcast: bool | UnsetType = UNSET
    cpu_binds: list[str | None] | None | UnsetType = UNSET
    reconcile_interval: float | UnsetType = UNSET
    gpu_memory_utilization: float | None | UnsetType = UNSET
    dtype: str | UnsetType = UNSET
    logprobs_mode: str | UnsetType = UNSET
    ipc_prestage: bool | UnsetType = UNSET
    ipc_direct: bool | UnsetType = UNSET
    pin: list[int] | None = None
    #: The host's logging level (the trainer process's, so both sides log alike).
    log_level: int = 20
    v: int = HOST_WIRE_VERSION

    def replicas_kwargs(self) -> dict[str, Any]:
        """The :class:`~rollq.rl.replicas.Replicas` keyword arguments that were set (all but
        ``url`` and ``queue``)."""
        skip = ("url", "queue", "pin", "log_level", "v")
        return {f: getattr(self, f) for f in self.__struct_fields__ if f not in skip and getattr(self, f) is not UNSET}


class Attach(msgspec.Struct, tag="attach", kw_only=True):
    """:meth:`~rollq.rl.replicas.Replicas.attach`."""

    queue: str
    weights_root: str | None = None
    abort_resume: bool = False
    seq: int = 0


class Detach(msgspec.Struct, tag="detach"):
    """:meth:`~rollq.rl.replicas.Replicas.detach`."""

    seq: int = 0


class WaitVersion(msgspec.Struct, tag="wait_version"):
    """:meth:`~rollq.rl.replicas.Replicas.wait_version`."""

    version: int
    timeout: float = 120.0
    seq: int = 0


class Snapshot(msgspec.Struct, tag="snapshot"):
    """:meth:`~rollq.rl.replicas.Replicas.snapshot`."""

    seq: int = 0


class Stop(msgspec.Struct, tag="stop"):
    """Stop the replicas; the host exits after replying (calls still running are cancelled)."""

    seq: int = 0


class Cancel(msgspec.Struct, tag="cancel"):
    """Cancel the running call numbered ``target`` (its caller gave up on it); not answered."""

    target: int
    seq: int = 0


#: One request of the trainer to the host.
Call = Union[Attach, Detach, WaitVersion, Snapshot, Stop, Cancel]


class Reply(msgspec.Struct, kw_only=True):
    """The host's answer to the config (``seq`` 0) or to the call numbered ``seq``: ``ok``, or
    the error's type name and message; a snapshot where the call (or the start) returns one."""

    ok: bool
    seq: int = 0
    error_type: str = ""
    error: str = ""
    snapshot: ReplicaSnapshot | None = None


class _Versioned(msgspec.Struct):
    v: int = HOST_WIRE_VERSION


class _Numbered(msgspec.Struct):
    seq: int = 0


encode = msgspec.msgpack.Encoder().encode
_call = msgspec.msgpack.Decoder(Call)
_config = msgspec.msgpack.Decoder(HostConfig)
_reply = msgspec.msgpack.Decoder(Reply)
_version = msgspec.msgpack.Decoder(_Versioned)
_numbered = msgspec.msgpack.Decoder(_Numbered)


def _decode(dec: msgspec.msgpack.Decoder, data: bytes, what: str) -> Any:
    try:
        v = _version.decode(data).v
    except msgspec.DecodeError:
        v = HOST_WIRE_VERSION  # not a map with a version: the typed decode says what is wrong
    if v != HOST_WIRE_VERSION:
        raise SchemaVersionError(f"a {what} of schema version {v} (this build: {HOST_WIRE_VERSION})")
    try:
        return dec.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:
        raise ProtocolError(f"malformed {what} ({len(data)} bytes): {str(e)[:200]}") from e


def decode_call(data: bytes) -> Call:
    """A call from the trainer; :class:`~rollq.errors.ProtocolError` for anything else."""
    return _decode(_call, data, "call")


def seq_of(data: bytes) -> int:
    """The ``seq`` of a call that did not decode, where it can be read (else 0), so that the
    host's answer saying why reaches the caller waiting for it.

    >>> seq_of(msgspec.msgpack.encode({"type": "reboot", "seq": 12})), seq_of(b"\\xc1")
    (12, 0)
    """
    try:
        seq = _numbered.decode(data).seq
    except (msgspec.DecodeError, RecursionError):
        return 0
    return seq if 0 <= seq < 2**63 else 0


def decode_config(data: bytes) -> HostConfig:
    """The host's config, the first frame the trainer sends."""
    return _decode(_config, data, "host config")


def decode_reply(data: bytes) -> Reply:
    """The host's reply."""
    return _decode(_reply, data, "reply")


def frame(body: bytes) -> bytes:
    """``body`` behind its 4-byte big-endian length."""
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a frame of {len(body)} bytes is over the limit of {MAX_FRAME}")
    return len(body).to_bytes(4, "big") + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's body; :class:`asyncio.IncompleteReadError` at the end of the stream,
    :class:`~rollq.errors.ProtocolError` for a length over :data:`MAX_FRAME`."""
    n = int.from_bytes(await reader.readexactly(4), "big")
    if n > MAX_FRAME:
        raise ProtocolError(f"a frame of {n} bytes announced, over the limit of {MAX_FRAME}")
    return await reader.readexactly(n)
