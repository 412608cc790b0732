"""Encoding and decoding: msgpack arrays through msgspec, a clear error for any bad bytes.

Decoders raise :class:`~rollq.errors.ProtocolError` (or its subclass
:class:`~rollq.errors.SchemaVersionError`) or :class:`~rollq.errors.InvalidJob`, and nothing
else, whatever the bytes.
"""

from __future__ import annotations

import msgspec

from ..errors import InvalidJob, ProtocolError, SchemaVersionError
from ..keys import check_name
from .jobs import Job, validate_job
from .limits import SCHEMA_VERSION
from .results import DeadLetter, Result
from .text import cut

_enc = msgspec.msgpack.Encoder()
_job_dec = msgspec.msgpack.Decoder(Job)
_res_dec = msgspec.msgpack.Decoder(Result)
_dl_dec = msgspec.msgpack.Decoder(DeadLetter)
_any_dec = msgspec.msgpack.Decoder()

encode = _enc.encode


def _diagnose(data: bytes, what: str, err: Exception) -> ProtocolError:
    """Turn a typed-decode failure into the clearest error we can give."""
    try:
        raw = _any_dec.decode(data)
    except RecursionError:
        return ProtocolError(f"{what} of {len(data)} bytes nests too deep to decode")
    except Exception:  # noqa: BLE001 - not msgpack at all
        return ProtocolError(f"{what} is not valid msgpack ({len(data)} bytes)")
    if isinstance(raw, list) and raw and isinstance(raw[0], int) and raw[0] != SCHEMA_VERSION:
        return SchemaVersionError(
            f"{what} has schema version {raw[0]}; this build understands version {SCHEMA_VERSION}"
        )
    return ProtocolError(f"malformed {what}: {cut(str(err), 300)}")


class _Envelope(msgspec.Struct, array_like=True):
    """The first three fields of a job (the rest is skipped without being decoded)."""

    v: int
    id: str
    reply: str


def peek_id(data: bytes) -> tuple[str | None, str | None]:
    """Best-effort ``(job id, reply)`` of an undecodable job, to tell its submitter: only a
    plausible id and a valid producer name are returned (an entry with a 10 MB id or reply
    must not name a result key, nor fill a log line)."""
    try:
        raw = msgspec.msgpack.decode(data, type=_Envelope)
    except Exception:  # noqa: BLE001 - anything undecodable: nobody to tell
        return None, None
    jid, reply = raw.id, raw.reply
    try:
        check_name("producer", reply)
    except ValueError:
        return None, None
    return (jid if 0 < len(jid) <= 256 else None), reply


def encode_job(job: Job) -> bytes:
    return _enc.encode(job)


def decode_job(data: bytes, max_prompt_bytes: int | None = None) -> Job:
    """Decode and validate a job; raise ProtocolError / SchemaVersionError / InvalidJob, and
    nothing else, whatever the bytes (a structure nested too deep to decode included).

    msgspec's decoder enforces types and ranges; the rest of :func:`validate_job` follows.
    """
    try:
        job = _job_dec.decode(data)
    except msgspec.ValidationError as e:
        if job_like(data):
            raise InvalidJob(f"invalid job: {cut(str(e), 300)}") from e
        raise _diagnose(data, "job", e) from e
    except msgspec.DecodeError as e:
        raise _diagnose(data, "job", e) from e
    except RecursionError as e:
        raise ProtocolError(f"job of {len(data)} bytes nests too deep to decode") from e
    except Exception as e:  # noqa: BLE001 - any other decoder failure is a bad entry too
        raise ProtocolError(f"job of {len(data)} bytes cannot be decoded: {type(e).__name__}") from e
    return validate_job(job, max_prompt_bytes=max_prompt_bytes, sampling=False, entry_bytes=len(data))


def job_like(data: bytes) -> bool:
    """A well-formed job envelope of our schema version (its contents may still be invalid)."""
    try:
        raw = msgspec.msgpack.decode(data, type=_Envelope)
    except Exception:  # noqa: BLE001 - not one
        return False
    return raw.v == SCHEMA_VERSION


def encode_result(result: Result) -> bytes:
    return _enc.encode(result)


def decode_result(data: bytes) -> Result:
    try:
        r = _res_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _diagnose(data, "result", e) from e
    if r.v != SCHEMA_VERSION:
        raise SchemaVersionError(f"result schema version {r.v} is not supported")
    return r


def encode_dead_letter(d: DeadLetter) -> bytes:
    return _enc.encode(d)


def decode_dead_letter(data: bytes) -> DeadLetter:
    try:
        return _dl_dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _diagnose(data, "dead letter", e) from e
