"""Token ids and logprobs as raw little-endian arrays (``int32`` / ``float32``).

>>> unpack_i32(pack_i32([1, -2, 3]))
[1, -2, 3]
>>> len(pack_i32(range(5)))
20
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Iterable

from ..errors import InvalidJob

_LITTLE = sys.byteorder == "little"
_I32: dict[int, struct.Struct] = {}  # "<{n}i" packers by length


def i32_packer(n: int) -> struct.Struct:
    """A cached ``struct.Struct`` packing ``n`` int32 token ids, little-endian."""
    packer = _I32.get(n)
    if packer is None:
        if len(_I32) > 4096:
            _I32.clear()
        packer = _I32[n] = struct.Struct(f"<{n}i")
    return packer


def pack_i32(values: Iterable[int] | bytes | None) -> bytes:
    """Token ids as little-endian int32 bytes (lists, arrays, numpy, tensors accepted)."""
    if type(values) is list:  # the common case first: one C call, range-checked by struct
        packer = _I32.get(len(values)) or i32_packer(len(values))
        try:
            return packer.pack(*values)
        except (struct.error, TypeError) as e:  # a float, or an object that is no index
            raise InvalidJob(f"token ids must be integers that fit in int32: {e}") from e
    if values is None:
        return b""
    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    arr: Any = values  # a tensor or an array, tested by its methods
    if getattr(arr, "numpy", None) is not None:  # torch tensor
        try:
            arr = values = arr.numpy()
        except (TypeError, RuntimeError) as e:  # bfloat16, a tensor on a device, ...
            raise InvalidJob(f"token ids must be an integer tensor on the CPU: {e}") from e
    if hasattr(arr, "astype") and hasattr(arr, "tobytes"):  # numpy
        dtype = arr.dtype
        # A cast would turn 1.7 into 1 and NaN into -2**31, and wrap large unsigned ids.
        if dtype.kind not in "iu":
            raise InvalidJob(f"token ids must be integers, got an array of {dtype}")
        if arr.size and (dtype.itemsize > 4 or (dtype.kind == "u" and dtype.itemsize == 4)) and (
                arr.min() < -(2**31) or arr.max() >= 2**31):
            raise InvalidJob("token ids must fit in int32")
        packed: bytes = arr.astype("<i4", copy=False).tobytes()
        return packed
    try:
        a = array("i", values if isinstance(values, (list, tuple)) else list(values))
    except (OverflowError, TypeError) as e:
        raise InvalidJob(f"token ids must be integers that fit in int32: {e}") from e
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_i32(data: bytes) -> list[int]:
    a = array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def pack_f32(values: Iterable[float] | None) -> bytes:
    if values is None:
        return b""
    arr: Any = values  # an array, tested by its methods
    if hasattr(arr, "astype") and hasattr(arr, "tobytes"):
        packed: bytes = arr.astype("<f4", copy=False).tobytes()
        return packed
    a = array("f", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_f32(data: bytes) -> list[float]:
    a = array("f")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


class PackedTokens:
    """Accessors for a struct whose ``tokens`` (int32 bytes) and ``logprobs`` (float32 bytes
    or None) fields hold one sample's tokens, as :class:`~rollq.protocol.results.Sample` and
    :class:`~rollq.protocol.progress.ProgressEntry` do.

    >>> import msgspec
    >>> class S(msgspec.Struct, PackedTokens):
    ...     tokens: bytes
    ...     logprobs: bytes | None = None
    >>> s = S(tokens=pack_i32([4, 2]), logprobs=pack_f32([-0.5, -1.0]))
    >>> s.token_ids, s.token_logprobs
    ([4, 2], [-0.5, -1.0])
    """

    __slots__ = ()
    tokens: bytes
    logprobs: bytes | None

    @property
    def token_ids(self) -> list[int]:
        return unpack_i32(self.tokens)

    @property
    def token_logprobs(self) -> list[float] | None:
        return unpack_f32(self.logprobs) if self.logprobs is not None else None
