"""The served model's checkpoint manifest, and checking a trainer's state dict against it.

Every replica publishes the manifest (tensor names, dtypes, shapes) of the checkpoint it
serves, read from the safetensors headers of its model folder (header only, never the
data), when its :class:`~rollq.weightsync.replica.follower.WeightFollower` starts. vLLM's own loaded
parameters are fused (``qkv_proj``, ``gate_up_proj``) and are not what a trainer sends, so
the files are the reference. The publisher checks every state dict against it before any
replica is touched (:func:`check_state`).

Accepted forms, renamed to the served names when unambiguous: the served names themselves
(``model.state_dict()`` of a ``*ForCausalLM``); the same without the ``model.`` prefix
(``layers.0...``, ``embed_tokens.weight``, ``norm.weight``, as TorchRL's
``push_weights_from_transformers`` sends); a tied ``lm_head.weight`` the checkpoint does not
have is dropped.

>>> m = Manifest(model="tiny", tensors=[TensorMeta("model.norm.weight", "float32", [4])])
>>> import torch
>>> [n for n, _ in check_state([("norm.weight", torch.zeros(4))], m)]
['model.norm.weight']
>>> check_state([("norm.weight", torch.zeros(5))], m)
Traceback (most recent call last):
...
rollq.errors.WeightMismatch: state dict does not match the served model tiny: 1 shape mismatch (model.norm.weight: sent [5], served [4])
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import msgspec

from ..errors import WeightMismatch
from .versions import TensorMeta

log = logging.getLogger(__name__)

#: Schema of :class:`Manifest` (independent of the job protocol's).
MANIFEST_SCHEMA = 1
#: Mismatches listed per kind in an error message.
SHOWN = 5
#: A safetensors header larger than this is refused (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20

# safetensors dtype codes -> torch dtype names (without ``torch.``)
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}
_FLOATS = {"float64", "float32", "float16", "bfloat16"}
#: Floating-point dtypes each dtype holds exactly (a conversion into it loses nothing).
_HOLDS = {"float64": _FLOATS, "float32": {"float32", "float16", "bfloat16"}, "float16": {"float16"}, "bfloat16": {"bfloat16"}}
_PREFIX = "model."
_TIED = ("lm_head.weight", "embed_tokens.weight")


class Manifest(msgspec.Struct, kw_only=True):
    """Names, dtypes and shapes of the checkpoint a replica serves (sorted by name)."""

    v: int = MANIFEST_SCHEMA
    model: str
    tensors: list[TensorMeta]
    #: dtype the engine serves floating-point weights in (vLLM's loaded ``model_config.dtype``);
    #: None: the checkpoint's own.
    served_dtype: str | None = None
    #: The user named :attr:`served_dtype` (``VllmEngineConfig.dtype``): floating-point tensors
    #: of any dtype are accepted and converted to it, lossy or not. Otherwise only versions
    #: that convert without loss (bfloat16 or float16 into a float32 replica) are.
    dtype_named: bool = False
    at: float = msgspec.field(default_factory=time.time)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Manifest)


def encode_manifest(m: Manifest) -> bytes:
    return _enc.encode(m)


def decode_manifest(data: bytes) -> Manifest:
    m = _dec.decode(data)
    if m.v != MANIFEST_SCHEMA:
        from ..errors import SchemaVersionError

        raise SchemaVersionError(f"manifest schema {m.v} is not supported (this build: {MANIFEST_SCHEMA})")
    return m


# -- reading a model folder ------------------------------------------------------------------
def safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of one safetensors file (8-byte length, then the header; no data read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {n} bytes is larger than {MAX_HEADER_BYTES}")
        return json.loads(f.read(n))


def model_dir(model: str) -> Path | None:
    """The local folder of ``model`` (a path, or a hub name already in the local cache)."""
    if not model:
        return None
    if os.path.isdir(model):
        return Path(model)
    try:  # a hub name: only the local cache, never a download
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as e:
        log.debug("model %r is neither a folder nor in the local hub cache (%s)", model[:200], e)
        return None


def float_dtypes(items: Sequence[tuple[str, Any]]) -> list[str]:
    """The floating-point dtypes of ``items`` (torch names without ``torch.``), sorted.

    >>> import torch
    >>> float_dtypes([("a", torch.zeros(1)), ("b", torch.zeros(1, dtype=torch.bfloat16)), ("c", torch.zeros(1, dtype=torch.long))])
    ['bfloat16', 'float32']
    """
    return sorted({_dtype_name(t) for _, t in items} & _FLOATS)


def conversion(sent: str, served: str, named: bool, checkpoint: str | None = None) -> str | None:
    """How a floating-point tensor of dtype ``sent`` is served in ``served``: None (as it is),
    ``"exact"`` (converted without loss) or ``"rounded"``. A conversion is accepted when the
    user named ``served`` (``named``), or when ``sent`` is the ``checkpoint``'s own dtype and
    ``served`` holds it exactly (a bfloat16 checkpoint served in float32 on CPU); any other
    raises ValueError, since the replica's logprobs would not be the trainer's.

    >>> conversion("float32", "float32", False), conversion("float32", "bfloat16", True)
    (None, 'rounded')
    >>> conversion("bfloat16", "float32", False, checkpoint="bfloat16")
    'exact'
    >>> conversion("float32", "bfloat16", False)
    Traceback (most recent call last):
    ...
    ValueError: sent float32, served bfloat16: the replica would round it (name its dtype to accept that)
    """
    if sent == served:
        return None
    exact = sent in _HOLDS.get(served, ())
    if named or (exact and sent == checkpoint):
        return "exact" if exact else "rounded"
    how = "round" if not exact else "compute in another dtype than the trainer with"
    raise ValueError(f"sent {sent}, served {served}: the replica would {how} it (name its dtype to accept that)")


def read_manifest(model: str, served_dtype: str | None = None, dtype_named: bool = False) -> Manifest | None:
    """The checkpoint manifest of ``model`` from its safetensors headers, or None when there
    is no local folder with safetensors files (``"echo"``, a ``.bin`` checkpoint).

    >>> read_manifest("echo") is None
    True
    """
    d = model_dir(model)
    if d is None:
        return None
    index = d / "model.safetensors.index.json"
    if index.is_file():  # sharded: exactly the shards the index names (not consolidated.* copies)
        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        return None
    metas: dict[str, TensorMeta] = {}
    for f in files:
        for name, h in safetensors_header(f).items():
            if name == "__metadata__" or name in metas:
                continue
            metas[name] = TensorMeta(name, _ST_DTYPES.get(h["dtype"], h["dtype"].lower()), list(h["shape"]))
    if served_dtype in (None, "auto", ""):
        served_dtype = None
    return Manifest(model=str(model), tensors=[metas[n] for n in sorted(metas)], served_dtype=served_dtype,
                    dtype_named=dtype_named and served_dtype is not None)


# -- checking a state dict -------------------------------------------------------------------
@dataclass
class Mismatch:
    """How a state dict differs from a manifest (empty: it matches)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # name, sent, served
    dtype: list[tuple[str, str, str]] = field(default_factory=list)  # name, sent, served
    notes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.shape or self.dtype)

    def describe(self, what: str = "state dict", model: str = "") -> str:
        """One line naming the first :data:`SHOWN` mismatches of each kind."""

        def some(rows: Sequence[str]) -> str:
            more = f", and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
            return ", ".join(rows[:SHOWN]) + more

        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing ({some([_short(n) for n in self.missing])})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected ({some([_short(n) for n in self.unexpected])})")
        if self.shape:
            parts.append(f"{len(self.shape)} shape mismatch ({some([f'{_short(n)}: sent {a}, served {b}' for n, a, b in self.shape])})")
        if self.dtype:
            parts.append(f"{len(self.dtype)} dtype mismatch ({some([f'{_short(n)}: sent {a}, served {b}' for n, a, b in self.dtype])})")
        if self.dtype:
            parts[-1] += (" (a replica rounds floating-point weights only to a dtype its user named: publish in the "
                          "served dtype, or start the replica with VllmEngineConfig.dtype / --dtype set to the one to serve)")
        line = f"{what} does not match the served model{' ' + _short(model) if model else ''}: " + "; ".join(parts)
        return line + "".join(f" ({n})" for n in self.notes)


def _short(s: str, n: int = 120) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def diff(metas: Sequence[TensorMeta], manifest: Manifest) -> Mismatch:
    """Compare tensors already named as served (no renaming) with ``manifest``."""
    served = {m.name: m for m in manifest.tensors}
    out = Mismatch()
    seen = set()
    for m in metas:
        ref = served.get(m.name)
        if ref is None:
            out.unexpected.append(m.name)
            continue
        seen.add(m.name)
        if list(m.shape) != list(ref.shape):
            out.shape.append((m.name, list(m.shape), list(ref.shape)))
        if ref.dtype in _FLOATS and m.dtype in _FLOATS:
            serves = manifest.served_dtype or ref.dtype
            try:
                conversion(m.dtype, serves, manifest.dtype_named, ref.dtype)
            except ValueError:
                out.dtype.append((m.name, m.dtype, serves))
        elif m.dtype != ref.dtype:
            out.dtype.append((m.name, m.dtype, ref.dtype))
    out.missing = [n for n in served if n not in seen]
    return out


def _served_name(name: str, served: dict[str, TensorMeta]) -> str | None:
    if name in served:
        return name
    if _PREFIX + name in served:  # the inner model's state dict (TorchRL, model.model.state_dict())
        return _PREFIX + name
    if name.startswith(_PREFIX) and name[len(_PREFIX):] in served:  # a bare-model checkpoint
        return name[len(_PREFIX):]
    return None


def _is_tied(head: Any, embed: Any) -> bool:
    if head.shape != embed.shape or head.dtype != embed.dtype:
        return False
    if head.device == embed.device and head.data_ptr() == embed.data_ptr():
        return True
    return bool(head.device == embed.device and head.equal(embed))


def normalize(items: Sequence[tuple[str, Any]], manifest: Manifest) -> tuple[list[tuple[str, Any]], Mismatch]:
    """Rename ``items`` to the served names where that is unambiguous and drop a tied
    ``lm_head.weight`` the checkpoint lacks; returns the renamed items and the mismatches."""
    served = {m.name: m for m in manifest.tensors}
    out: list[tuple[str, Any]] = []
    problems = Mismatch()
    taken: dict[str, str] = {}
    by_served: dict[str, Any] = {}
    heads = []
    for name, t in items:
        target = _served_name(name, served)
        if target is None:
            if name.endswith(_TIED[0]) and name in (_TIED[0], _PREFIX + _TIED[0]):
                heads.append((name, t))
            else:
                problems.unexpected.append(name)
            continue
        if target in taken:
            problems.unexpected.append(name)
            problems.notes.append(f"{_short(taken[target])!r} and {_short(name)!r} both name {_short(target)!r}")
            continue
        taken[target] = name
        by_served[target] = t
        out.append((target, t))
    for name, t in heads:  # lm_head.weight the checkpoint does not have: tied to the embeddings?
        embed = next((by_served[n] for n in (_PREFIX + _TIED[1], _TIED[1]) if n in by_served), None)
        if embed is not None and _is_tied(t, embed):
            log.debug("dropping %s: tied to the embeddings, not in the served checkpoint", name)
            continue
        problems.unexpected.append(name)
        problems.notes.append(f"{name} is not in the served checkpoint and differs from embed_tokens.weight")
    found = diff([TensorMeta(n, _dtype_name(t), list(t.shape)) for n, t in out], manifest)
    found.unexpected = problems.unexpected + found.unexpected
    found.notes = problems.notes
    return out, found


def check_state(items: Sequence[tuple[str, Any]], manifest: Manifest, what: str = "state dict") -> list[tuple[str, Any]]:
    """``items`` renamed to the served names; :class:`~rollq.errors.WeightMismatch` naming the
    first mismatches (missing, unexpected, shape, dtype) if they do not match ``manifest``."""
    out, problems = normalize(items, manifest)
    if problems:
        raise WeightMismatch(problems.describe(what, manifest.model), mismatch=problems)
    return out
