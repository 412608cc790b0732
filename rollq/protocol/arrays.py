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
from typing import Iterable

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
    tobytes = getattr(values, "numpy", None)
    if tobytes is not None:  # torch tensor
        try:
            values = values.numpy()  # type: ignore[union-attr]
        except (TypeError, RuntimeError) as e:  # bfloat16, a tensor on a device, ...
            raise InvalidJob(f"token ids must be an integer tensor on the CPU: {e}") from e
    if hasattr(values, "astype") and hasattr(values, "tobytes"):  # numpy
        dtype = values.dtype  # type: ignore[union-attr]
        # A cast would turn 1.7 into 1 and NaN into -2**31, and wrap large unsigned ids.
        if dtype.kind not in "iu":
            raise InvalidJob(f"token ids must be integers, got an array of {dtype}")
        if values.size and (dtype.itemsize > 4 or (dtype.kind == "u" and dtype.itemsize == 4)) and (
                values.min() < -(2**31) or values.max() >= 2**31):  # type: ignore[union-attr]
            raise InvalidJob("token ids must fit in int32")
        return values.astype("<i4", copy=False).tobytes()  # type: ignore[union-attr]
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
    if hasattr(values, "astype") and hasattr(values, "tobytes"):
        return values.astype("<f4", copy=False).tobytes()  # type: ignore[union-attr]
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
