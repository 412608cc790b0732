"""What a replica checks of a policy version before its engine sees any of it (the follower
runs both before staging): the memmap slot's tensors against the served checkpoint, and the
version's floating-point dtypes against the dtype the replica serves."""

from __future__ import annotations

import logging

from ...errors import WeightMismatch
from ..base import ReplicaSide
from ..manifest import Manifest, conversion, diff
from ..versions import TensorMeta, VersionRecord

# The follower runs these checks: they log under its name, where operators look for them.
log = logging.getLogger("rollq.weightsync.replica.follower")


def check_dtypes(rec: VersionRecord, consumer: ReplicaSide, served: str, manifest: Manifest | None) -> None:
    """Refuse a version whose floating-point dtypes this replica (serving ``served``) would
    round without its user having named the served dtype
    (:func:`~rollq.weightsync.manifest.conversion`); say once, in the log and the registry
    (``consumer.converted_from``), which dtypes it converts."""
    if not served or not rec.dtypes:
        return
    named = manifest.dtype_named if manifest is not None else False
    own = {m.dtype for m in manifest.tensors} & {"float64", "float32", "float16", "bfloat16"} if manifest else set()
    checkpoint = next(iter(own)) if len(own) == 1 else None
    converted = []
    for sent in rec.dtypes:
        try:
            how = conversion(sent, served, named, checkpoint)
        except ValueError as e:
            raise WeightMismatch(f"policy version {rec.version} is {', '.join(rec.dtypes)}; replica {consumer.id} "
                                 f"serves {served} ({e}): publish it in {served}, or start the replica with "
                                 f"VllmEngineConfig.dtype / --dtype naming the dtype to serve") from None
        if how is not None:
            converted.append(sent)
    if converted and converted != consumer.converted_from:
        log.warning("replica %s serves %s: policy version %d arrives in %s and is converted to %s%s", consumer.id,
                    served, rec.version, ", ".join(converted), served,
                    " (rounded: the served dtype was named)" if named and served not in ("float32", "float64") else "")
    consumer.converted_from = converted


def check_slot(rec: VersionRecord, manifest: Manifest | None, root: str | None) -> None:
    """Refuse a memmap version (in the store at ``root``) whose tensors do not match the
    served checkpoint's ``manifest`` (the publisher checks too, unless told not to)."""
    if manifest is None or rec.memmap_slot is None or root is None:
        return
    from ..memmap import MemmapStore

    marker = MemmapStore(root).marker(rec.memmap_slot)
    if not marker or marker.get("version") != rec.version:
        return  # the load itself refuses it (CorruptWeights)
    problems = diff([TensorMeta(n, d, list(sh)) for n, d, sh in marker.get("manifest", [])], manifest)
    if problems:
        raise WeightMismatch(problems.describe(f"policy version {rec.version} ({rec.memmap_slot})", manifest.model), mismatch=problems)
