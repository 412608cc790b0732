"""What a replica holds of a job: :class:`JobInHand` (the entry, the job, when it started and
the weight swaps it ran through), :class:`Failure` (why one ends without a result), and
:func:`mark_versions` (a result's per-sample policy versions from those swaps).

The job moves (:mod:`rollq.consumer._jobs`), the wait for a version
(:mod:`rollq.consumer._versions`) and the outcomes (:mod:`rollq.consumer._finisher`) all work
on these; none of the three is needed to read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ..protocol import UNKNOWN_START, Job

if TYPE_CHECKING:
    from .engine import EngineOutput

#: Versions swapped in while a job ran: (version, tokens per sample before the swap, or None
#: where not known, and whether a sample missing from them had none).
Swaps = list[tuple[int, "dict[int, int] | None", bool]]


@dataclass(slots=True, eq=False)
class JobInHand:
    """One job this replica holds: read from ``stream`` as entry ``eid``, delivered
    ``deliveries`` times (held, waiting, parked or running; see the module docstring)."""

    stream: str
    eid: bytes
    job: Job
    deliveries: int
    #: Running: when it was handed to the engine (wall clock; 0 before) and the policy
    #: version then.
    started: float = 0.0
    version_start: int = 0
    swaps: Swaps | None = None
    #: Waiting: since when (monotonic), and since when its version is known not to be committed.
    since: float = 0.0
    beyond_since: float | None = None
    #: Parked with resume (:mod:`rollq.consumer._resume`): the engine's output when it was
    #: aborted, its samples so far; None: it runs again from scratch.
    partial: EngineOutput | None = None


class Failure(NamedTuple):
    """Why a job, or an entry that holds none, ends without a result."""

    #: Its name is the error type the submitter sees (``ErrorInfo.type``).
    error: type[BaseException]
    message: str
    #: Also write a dead letter, keeping ``payload`` (the entry as read, or the job re-encoded).
    dead_letter: bool = False
    payload: bytes = b""


def mark_versions(samples: list[Any], version_start: int, swaps: Swaps) -> int:
    """Fill each sample's ``versions`` (see :class:`~rollq.protocol.Sample`) from the swaps
    that happened while its job ran; returns the last version that made a token of any
    sample (or may have: a start not known counts), the result's ``version_end``.

    A version swapped in after a sample's last token made none of its tokens; its mark stays
    (a later start that is not known begins no earlier) but it is not the result's to claim.

    >>> from rollq.protocol import Sample, pack_i32
    >>> s = [Sample(tokens=pack_i32([1, 2, 3])), Sample(tokens=pack_i32([1]))]
    >>> mark_versions(s, 4, [(5, {0: 2, 1: 1}, True)]), s[0].versions, s[1].versions
    (5, [(4, 0), (5, 2)], [(4, 0), (5, 1)])
    >>> mark_versions(s, 4, [(5, {0: 3, 1: 1}, True), (6, None, False)])
    4
    """
    end = version_start
    for j, sample in enumerate(samples):
        n = len(sample.tokens) // 4
        marks = [(version_start, 0)]
        known = 0  # the last known start: an unknown one is no earlier
        for v, counts, complete in swaps:
            start = counts.get(j) if counts is not None else None
            if start is None:
                start = 0 if counts is not None and complete else UNKNOWN_START
            if start != UNKNOWN_START:
                start = known = min(start, n)
            marks.append((v, start))
            if known < n:
                end = max(end, v)
        sample.versions = marks
    return end
