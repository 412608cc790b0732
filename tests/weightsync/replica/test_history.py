"""A follower's history of updates stays small however long the replica follows versions."""

from __future__ import annotations

from rollq import Consumer, EchoEngine
from rollq.weightsync import WeightFollower
from rollq.weightsync.replica._stats import HISTORY_KEEP, UpdateStats


def _update(version: int, requests: int) -> UpdateStats:
    progress = {"tokens": {f"req-{version}-{i}": i for i in range(requests)}, "complete": True}
    return UpdateStats(version, "keep", "ipc", 0.01, 0.001, {"swap": "shadow", "progress": progress})


def test_history_keeps_the_newest_updates_without_their_per_request_progress(redis_url, queue):
    """Each swap's report maps every request the engine held or let go of in the last 30 s to
    its token count (about 12,000 on a GPU at RL rates). A replica following a version per
    trainer step kept every report whole: ~1 MB per version, gigabytes over a long run. The
    history keeps the newest HISTORY_KEEP updates, each with the size of its progress map."""
    follower = WeightFollower(Consumer(EchoEngine(), redis_url, queue, consumer_id="r0"))
    for v in range(1, HISTORY_KEEP + 51):
        follower.history.append(follower._updated(_update(v, requests=2000 if v % 100 == 0 else 3)))
    assert len(follower.history) == HISTORY_KEEP
    assert [u.version for u in follower.history] == list(range(51, HISTORY_KEEP + 51))
    assert follower.history[-1].load == {"swap": "shadow", "progress": {"requests": 3, "complete": True}}
    assert follower.history[49].version == 100 and follower.history[49].load["progress"]["requests"] == 2000
