"""What one replica's weight update did: :class:`UpdateStats`, kept in
:attr:`rollq.weightsync.replica.follower.WeightFollower.history`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Updates a follower keeps in :attr:`~rollq.weightsync.replica.follower.WeightFollower.history`
#: (the newest; a replica that follows a version per trainer step runs for thousands).
HISTORY_KEEP = 1024


def kept_load(load: dict[str, Any]) -> dict[str, Any]:
    """A worker's report as an update keeps it: the swap's per-request progress (a token count
    for every request the engine held or let go of in the last 30 s, thousands on a GPU; the
    replica has used it by then) reduced to its size, ``{"requests": n, "complete": bool}``.

    >>> kept_load({"swap": "shadow", "progress": {"tokens": {"a": 3, "b": 0}, "complete": True}})
    {'swap': 'shadow', 'progress': {'requests': 2, 'complete': True}}
    >>> kept_load({"swap": "shadow"})
    {'swap': 'shadow'}
    """
    progress = load.get("progress")
    if not isinstance(progress, dict) or "tokens" not in progress:
        return load
    tokens = progress["tokens"]
    return dict(load, progress={"requests": len(tokens) if isinstance(tokens, dict) else 0,
                                "complete": bool(progress.get("complete"))})


@dataclass
class UpdateStats:
    version: int
    policy: str
    transport: str
    update_s: float  # from noticing the version to serving it
    #: Intake closed around the swap (keep/abort) or the drain (drain). On GPUs with shadow
    #: weights the swap call only enqueues the device copies, which finish before the
    #: engine's next step; generation stops for those copies plus the step in flight, not
    #: for this whole time.
    pause_s: float
    #: The worker's report (a :class:`~rollq.weightsync.wire.SwapReport` as a map, with the
    #: memmap staging's timings when the version was staged from memmap); in a follower's
    #: history its ``progress`` is reduced to the number of requests it covered (:func:`kept_load`).
    load: dict[str, Any] = field(default_factory=dict)
    #: Where the update's time went on this side: ``read_s`` (the record, policy and acks),
    #: ``stage_call_s`` (staging the version while serving, as the follower saw it: the
    #: workers' RPCs and status polls included), ``load_call_s`` (the load or swap call to
    #: the engine, as the follower saw it), and its timeline in wall-clock seconds:
    #: ``hinted_at`` (the pub/sub announcement reached this follower; 0: the update was found
    #: by polling), ``woke_at`` (the reconcile that applied it began), ``staging_at`` (staging
    #: began, after the record was read and checked), ``swap_at`` (intake closed for the swap),
    #: ``recorded_at`` (the update was recorded: the replica serves it). Every ``await`` between
    #: these waits for the consumer's event loop, which the gaps between them measure.
    timings: dict[str, float] = field(default_factory=dict)

    def waits(self) -> dict[str, float]:
        """The update's time from the announcement (or, found by polling, from the reconcile)
        to the replica serving it, in consecutive parts (seconds): ``wake_s`` (announcement to
        reconcile), ``read_check_s`` (reading and checking the record), ``stage_call_s``,
        ``staged_to_swap_s``, ``pause_s`` (intake closed for the swap) and
        ``swap_to_recorded_s``; empty without the timeline (an overlapped swap).

        >>> t = {"hinted_at": 10.0, "woke_at": 10.002, "staging_at": 10.003, "stage_call_s": 0.05,
        ...      "swap_at": 10.054, "recorded_at": 10.08}
        >>> {k: round(v * 1000, 1) for k, v in UpdateStats(2, "keep", "ipc", 0.08, 0.02, timings=t).waits().items()}
        {'wake_s': 2.0, 'read_check_s': 1.0, 'stage_call_s': 50.0, 'staged_to_swap_s': 1.0, 'pause_s': 20.0, 'swap_to_recorded_s': 6.0}
        """
        t = self.timings
        if not all(k in t for k in ("woke_at", "staging_at", "swap_at", "recorded_at")):
            return {}
        stage = t.get("stage_call_s", 0.0)
        return {"wake_s": t["woke_at"] - (t.get("hinted_at") or t["woke_at"]), "read_check_s": t["staging_at"] - t["woke_at"],
                "stage_call_s": stage, "staged_to_swap_s": t["swap_at"] - t["staging_at"] - stage, "pause_s": self.pause_s,
                "swap_to_recorded_s": t["recorded_at"] - t["swap_at"] - self.pause_s}
