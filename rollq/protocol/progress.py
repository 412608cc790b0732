"""Progress of a streamed job: the tokens its samples generated so far, before the result.

A job submitted with ``stream=True`` (:attr:`~rollq.protocol.jobs.Job.stream`) has the
replica running it publish :class:`ProgressEntry` messages to a per-job Redis stream
(``QueueKeys.progress``) while it generates. Each entry holds, for one sample, the tokens
that followed ``offset`` in one *attempt* (``delivery``: the job's delivery number;
``run``: its engine request within that delivery, 0 unless it was restarted for a weight
swap). The final :class:`~rollq.protocol.results.Result` stays the authoritative record;
progress is a best-effort preview of it.

>>> from rollq.protocol import pack_i32
>>> e = ProgressEntry(delivery=1, sample=0, offset=0, tokens=pack_i32([5, 6]), text="ab")
>>> d = decode_progress(encode_progress(e))
>>> d.token_ids, d.text
([5, 6], 'ab')
"""

from __future__ import annotations

import msgspec

from ..errors import ProtocolError, SchemaVersionError
from .arrays import PackedTokens
from .limits import MAX_N, MAX_TOKENS_LIMIT, SCHEMA_VERSION
from .text import cut

__all__ = ["ProgressEntry", "encode_progress", "decode_progress", "MAX_PROGRESS_TOKENS", "MAX_PROGRESS_TEXT"]

#: Most tokens one entry carries (a writer splits longer runs over several entries).
MAX_PROGRESS_TOKENS = 4096
#: Most characters of text one entry carries (longer deltas are split).
MAX_PROGRESS_TEXT = 64 << 10


class ProgressEntry(msgspec.Struct, PackedTokens, array_like=True, kw_only=True, gc=False, frozen=True):
    """New tokens of one sample: ``tokens`` (int32 bytes) are its tokens ``offset ..
    offset + len`` in attempt ``(delivery, run)``; ``logprobs`` (float32 bytes, one per token)
    when the job asked for them; ``text`` the text those tokens added, where the engine
    detokenizes (None otherwise); ``version`` the policy version served when they were made."""

    v: int = SCHEMA_VERSION
    delivery: int
    run: int = 0
    sample: int
    offset: int
    tokens: bytes
    logprobs: bytes | None = None
    text: str | None = None
    version: int = 0

    @property
    def attempt(self) -> tuple[int, int]:
        """Which run of the job made these tokens; a later attempt supersedes an earlier one."""
        return (self.delivery, self.run)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(ProgressEntry)


def encode_progress(entry: ProgressEntry) -> bytes:
    return _enc.encode(entry)


def decode_progress(data: bytes) -> ProgressEntry:
    """Decode and check one entry (:class:`~rollq.errors.ProtocolError` for anything wrong)."""
    try:
        e = _dec.decode(data)
    except msgspec.DecodeError as err:
        raise ProtocolError(f"malformed progress entry: {cut(str(err), 300)}") from err
    if e.v != SCHEMA_VERSION:
        raise SchemaVersionError(f"progress entry has schema version {e.v}; this build understands {SCHEMA_VERSION}")
    n = len(e.tokens)
    if (
        n % 4
        or n // 4 > MAX_PROGRESS_TOKENS
        or not 0 <= e.sample < MAX_N
        or not 0 <= e.offset <= MAX_TOKENS_LIMIT
        or e.delivery < 0
        or e.run < 0
        or (e.logprobs is not None and len(e.logprobs) != n)
        or (e.text is not None and len(e.text) > MAX_PROGRESS_TEXT)
    ):
        raise ProtocolError(f"progress entry out of bounds (sample {e.sample}, offset {e.offset}, {n} token bytes)")
    return e
