"""Exactly once under faults, checked from a history (see tests/system/soak.py): consumer
SIGKILLs, a Redis SIGKILL with AOF, and a producer whose connection a proxy cuts every
20-200 ms. Bounded: about a minute on 2 cores."""

from __future__ import annotations

import pytest

from tests.system.soak import SoakConfig, run_soak

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


async def test_history_has_no_lost_duplicate_or_stuck_job(tmp_path):
    rep = await run_soak(SoakConfig(jobs=3000, rounds=15, round_gap=2.0, consumers=3, delay_ms=5.0, max_tokens=20,
                                    consumer_kill_every=3.0, redis_kills=1, cut_every=(0.02, 0.2), drain_timeout=60.0),
                         str(tmp_path))
    c = rep.check
    assert rep.consumer_kills >= 2 and rep.redis_kills == 1 and rep.proxy_cuts >= 5, rep
    assert c["lost"] == 0, (c, rep.lost_sample)
    assert c["duplicates"] == 0, (c, rep.duplicate_sample)
    assert c["unknown_results"] == 0, c
    assert c["stuck"] == 0, c
    assert c["submitted"] + rep.in_doubt >= 3000 and c["results"] >= c["submitted"], c
