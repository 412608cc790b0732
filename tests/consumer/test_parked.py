"""Jobs waiting for a policy version (``min_version``): parked outside the in-flight cap,
bounded, and failed with VersionUnavailable when their version cannot be reached."""

from __future__ import annotations

import pytest

from rollq.errors import VersionUnavailable
from rollq.keys import QueueKeys
from rollq.weightsync.versions import VersionRecord, commit_version
from tests.helpers import bounded, until

FAR = 2**62
ONE = {"sampling": {"max_tokens": 1}}


def record(v: int) -> VersionRecord:
    return VersionRecord(version=v, transport="memmap", checksum="0", num_tensors=0, nbytes=0)


async def test_version_waiting_jobs_do_not_block_other_jobs(queue, make_producer, make_consumer):
    p = await make_producer(queue)
    far = await p.submit_many([{"prompt": f"far {i}", "min_version": FAR, **ONE} for i in range(600)])
    normal = await p.submit_many([{"prompt": f"now {i}", **ONE} for i in range(10)])
    c = make_consumer(queue, max_inflight=4, initial_inflight=4, adaptive=False)
    make_consumer.start(c)
    rs = await bounded(p.gather(normal, timeout=30), 30, "the 10 jobs behind 600 waiting for version 2**62")
    assert all(r.ok for r in rs)
    assert len(c.versions.waiting) == 600 and not any(h.done() for h in far)  # still waiting, not failed
    assert c.jobs.free_slots() == 4  # parked jobs take no in-flight capacity
    await make_consumer.stop(c)


async def test_parked_jobs_are_bounded_and_start_when_their_version_loads(queue, make_producer, make_consumer):
    p = await make_producer(queue)
    hs = await p.submit_many([{"prompt": f"v1 {i}", "min_version": 1, **ONE} for i in range(40)])
    c = make_consumer(queue, max_inflight=4, initial_inflight=4, adaptive=False, max_parked=10)
    make_consumer.start(c)
    await until(lambda: len(c.versions.waiting) >= 10, 10, "ten parked jobs")
    await until(lambda: c.jobs.free_slots() == 0, 1, "the pull to stop at max_parked")
    pulled = c.counters.pulled
    assert 10 <= len(c.versions.waiting) <= 10 + 4  # the bound, plus at most the read that crossed it
    c.version = 1
    c.release_held()
    rs = await bounded(p.gather(hs, timeout=30), 30, "the parked jobs after version 1 loaded")
    assert all(r.ok and r.policy_version == (1, 1) for r in rs)
    assert c.counters.pulled > pulled
    await make_consumer.stop(c)


async def test_min_version_beyond_the_newest_committed_fails_with_version_unavailable(queue, redis_client, make_producer, make_consumer):
    await commit_version(redis_client, QueueKeys(queue), record(3))
    p = await make_producer(queue)
    c = make_consumer(queue, max_uncommitted_wait=0.5, max_version_wait=2.0)
    make_consumer.start(c)
    far = await p.submit("far", min_version=FAR, **ONE)
    with pytest.raises(VersionUnavailable, match="beyond the newest committed version 3"):
        await bounded(far.result(), 10, "a job needing version 2**62 to fail")
    # version 3 is committed but this replica never loads it: the overall wait bounds it
    committed = await p.submit("committed", min_version=3, **ONE)
    with pytest.raises(VersionUnavailable, match="max_version_wait"):
        await bounded(committed.result(), 10, "a job needing a committed version that never loads to fail")
    assert len(c.versions.waiting) == 0
    r = await bounded((await p.submit("any", **ONE)).result(), 5, "an unconstrained job")
    assert r.ok
    await make_consumer.stop(c)


async def test_a_version_the_replica_cannot_load_fails_the_jobs_waiting_for_it(queue, redis_client, make_producer, make_consumer):
    keys = QueueKeys(queue)
    await commit_version(redis_client, keys, record(2))
    p = await make_producer(queue)
    c = make_consumer(queue)
    make_consumer.start(c)
    h2 = await p.submit("needs 2", min_version=2, **ONE)
    h3 = await p.submit("needs 3", min_version=3, **ONE)
    await until(lambda: len(c.versions.waiting) == 2, 5, "two jobs waiting")
    c.version_failed(2, "WeightMismatch: 1 shape mismatch (lm_head.weight)")
    with pytest.raises(VersionUnavailable, match="cannot load policy version 2.*WeightMismatch"):
        await bounded(h2.result(), 5, "the job needing the unloadable version to fail")
    assert not h3.done()  # version 3 may still come and load
    # a newer version is committed: jobs it would serve wait for it again
    await commit_version(redis_client, keys, record(3))
    h2b = await p.submit("needs 2 again", min_version=2, **ONE)
    await until(lambda: len(c.versions.waiting) == 2, 5, "the new job waiting")
    c.version = 3
    c.release_held()
    rs = await p.gather([h3, h2b], timeout=10)
    assert all(r.ok and r.policy_version == (3, 3) for r in rs)
    await make_consumer.stop(c)
