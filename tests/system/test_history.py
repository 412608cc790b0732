"""Exactly once under faults, checked from a history (see tests/system/soak.py): consumer
SIGKILLs, a Redis SIGKILL with AOF, and a producer whose connection a proxy cuts every
20-200 ms (about a minute on 2 cores); and through a queue's growth from 1 to 3 shards with
caller ids resubmitted and a publisher process SIGKILLed between commit and mirror (a few
seconds)."""

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


async def test_history_through_shard_growth_resubmitted_ids_and_a_publisher_dying_mid_commit(tmp_path):
    """A queue grows from 1 to 3 shards with jobs queued (staleness bound (0, 300)); two
    consumer processes start after the resubmissions below, so every resubmitted id is still
    queued when it is resubmitted (a resubmission after a finish may run again):

    - round A, one shard: producer "old" (connected before the growth) submits 60 jobs with
      caller ids ``a-*`` and 40 with generated ids;
    - the growth: producer "new" connects with ``shards=3`` (parts 100/100/100); it resubmits
      the 60 ``a-*`` ids (40 of them map to shards 1 and 2), then "old" (still counting one
      shard) does;
    - version 1 (commit and mirrors); round B from "new": 100 caller ids ``b-*`` and 100
      generated (shard 0 admits 180 of its 200), then "old" resubmits the ``b-*`` ids; the
      consumers start;
    - version 2 is published by a publisher process (tests/helpers/publisher_proc.py, through
      ``WeightPublisher.publish_weights``) SIGKILLed between its commit and its mirror: a proxy
      holds the mirror's EVALSHA, the process blocks on its reply and is killed there (shards 1
      and 2 keep version 1); round C from "new", blocking: 150 caller ids in shard 1 and 150
      in shard 2, more than they admit at their mirrored version 1 (200 each, about 60 taken)
      and within what they admit at version 2. It is admitted with no new version: the
      reclaimer or the submit heals the mirrors (``heal_mirrors``; without it the submit waits
      for version 3, which comes only after it);
    - version 3 (commit and mirrors).

    The checker: every job enqueued has one result and no other (0 lost, 0 results twice),
    the queue enqueued each id once (the shards' ``submitted`` counters add up to the ids),
    each reached an engine once (0 delivered twice), and the number enqueued never exceeded
    (0 + version + 1) * 300 at any sample (the version read after the counters)."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    from rollq.connection import connect, load_scripts
    from rollq.keys import QueueKeys
    from rollq.producer.client import Producer
    from rollq.server import RedisServer
    from rollq.settings import ProducerSettings
    from rollq.shards import shard_of_id
    from rollq.testing.chaos import HistoryLog, check_history, read_history
    from rollq.weightsync.versions import MIRROR_VERSION, VersionRecord, commit_version, read_version
    from tests.helpers import ROOT, Proc, bounded
    from tests.helpers.hold_proxy import HoldProxy

    batch, queue, k = 300, "grow", 3
    hist_path = str(tmp_path / "history.jsonl")
    srv = RedisServer(appendfsync="always", data_dir=os.path.join(str(tmp_path), "redis")).start()
    keys = QueueKeys(queue)
    r = connect(srv.url)
    hist = HistoryLog(hist_path, "producers")
    procs: list[Proc] = []
    settings = ProducerSettings(max_outstanding=5000, admission_poll=0.05)
    old = Producer(srv.url, queue, producer_id="old", settings=settings)
    new = Producer(srv.url, queue, producer_id="new", settings=ProducerSettings(**{**settings.__dict__, "shards": k}))
    samples: list[tuple[int, int]] = []  # (jobs enqueued, committed version)
    stop = asyncio.Event()

    def version_record(v: int) -> VersionRecord:
        return VersionRecord(version=v, transport="memmap", checksum="0", num_tensors=0, nbytes=0)

    async def sample() -> None:
        while not stop.is_set():
            pipe = r.pipeline(transaction=False)
            for s in keys.shards(k):
                pipe.hget(s.stats, "submitted")
            enqueued = sum(int(x or 0) for x in await pipe.execute())
            samples.append((enqueued, int(await r.hget(keys.version, "v") or 0)))
            await asyncio.sleep(0.02)

    handles: dict[str, list] = {"old": [], "new": []}

    def submitted(who: str, hs: list) -> None:
        fresh = [h for h in hs if not h.duplicate]
        handles[who] += fresh
        hist.event("submit", [h.id for h in fresh])

    sampler = None
    try:
        await load_scripts(r)
        await old.connect()
        sampler = asyncio.create_task(sample())
        await old.set_staleness_bound(0, batch)
        a_ids = [f"a-{i}" for i in range(60)]
        a_specs = [{"id": i, "prompt_token_ids": [1, 2], "sampling": {"max_tokens": 2}} for i in a_ids]
        gen = [{"prompt_token_ids": [3, 4], "sampling": {"max_tokens": 2}}]
        submitted("old", await bounded(old.submit_many(a_specs + gen * 40), 30, "round A"))

        await new.connect()  # records 3 shards: the queue grows
        assert new.shards == k and old.shards == 1
        again = await bounded(new.submit_many(a_specs), 30, "new's resubmission of round A")
        assert all(h.duplicate for h in again)
        again = await bounded(old.submit_many(a_specs), 30, "old's resubmission of round A")
        assert old.shards == k and all(h.duplicate for h in again)

        await commit_version(r, keys, version_record(1))
        b_ids = [f"b-{i}" for i in range(100)]
        b_specs = [{"id": i, "prompt_token_ids": [5], "sampling": {"max_tokens": 2}} for i in b_ids]
        submitted("new", await bounded(new.submit_many(b_specs + gen * 100), 30, "round B"))
        assert all(h.duplicate for h in await bounded(old.submit_many(b_specs), 30, "old's resubmission of round B"))
        procs += [Proc(srv.url, queue, f"c{i}", 1.0, lease_ttl=3.0, heartbeat=0.3, reclaim=0.3, block=0.2,
                       history=hist_path) for i in range(2)]
        for proc in procs:
            await proc.ready()

        # The publisher of version 2 (a process) dies between its commit and its mirror: its
        # connection goes through a proxy that holds the mirror's EVALSHA, so the process
        # blocks there, waiting for the reply; it is SIGKILLed then.
        proxy = await HoldProxy(srv.port, MIRROR_VERSION.sha).start()
        publisher = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.publisher_proc", proxy.url, queue, str(tmp_path / "w"), "2"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        try:
            await bounded(proxy.held.wait(), 60, "the publisher of version 2 to send its mirror")
            assert publisher.poll() is None, publisher.stderr.read().decode()[-2000:] if publisher.stderr else ""
            publisher.kill()
            assert publisher.wait(10) == -signal.SIGKILL
        finally:
            if publisher.poll() is None:
                publisher.kill()
                publisher.wait(10)
            await proxy.stop()
        record = await read_version(r, keys)
        assert record is not None and record.version == 2 and record.trainer == "publisher_proc", record
        # Committed, not mirrored, unless a healer (the reclaimer) already ran: a heal is a
        # pipeline of one call per shard, so a read may fall between its calls and see some
        # mirrors at 2 and the others still at 1.
        mirrors = [await r.hget(s.version, "v") for s in keys.shards(k)][1:]
        assert set(mirrors) <= {b"1", b"2"}, mirrors
        c_ids = [i for s in (1, 2) for i in [f"c{s}-{j}" for j in range(2000) if shard_of_id(f"c{s}-{j}", k) == s][:150]]
        c_specs = [{"id": i, "prompt_token_ids": [6], "sampling": {"max_tokens": 2}} for i in c_ids]
        submitted("new", await bounded(new.submit_many(c_specs), 30, "round C at version 2 (mirrors at 1)"))
        # Admitted without a new version: the mirrors were healed (by the reclaimer or the submit).
        assert int(await r.hget(keys.version, "v")) == 2
        assert [await r.hget(s.version, "v") for s in keys.shards(k)] == [b"2"] * k
        await commit_version(r, keys, version_record(3))

        for who, p in (("old", old), ("new", new)):
            results = await bounded(p.gather(handles[who]), 120, f"the results of {who}'s jobs")
            hist.event("result", [res.id for res in results])
            assert all(res.ok for res in results), [res.error for res in results if not res.ok][:3]
            assert p.counters["duplicate_results"] == 0, p.counters
        stop.set()
        await sampler
        pipe = r.pipeline(transaction=False)
        for s in keys.shards(k):
            pipe.hget(s.stats, "submitted")
        enqueued = sum(int(x or 0) for x in await pipe.execute())
    finally:
        stop.set()
        if sampler is not None:
            await asyncio.gather(sampler, return_exceptions=True)
        for p in (old, new):
            await p.close()
        for proc in procs:
            proc.cleanup()
        await r.aclose()
        hist.close()
        srv.cleanup()

    events = read_history(hist_path)
    rep = check_history(events)
    ids = [h.id for who in handles for h in handles[who]]
    assert len(ids) == len(set(ids)) == 60 + 40 + 100 + 100 + 300
    assert rep.lost == [] and rep.duplicates == {} and rep.unknown_results == [], rep.summary()
    assert enqueued == len(ids), (enqueued, len(ids))  # no id enqueued twice
    deliveries = [e["id"] for e in events if e["e"] == "deliver"]
    assert sorted(deliveries) == sorted(ids)  # each reached an engine once
    over = [(n, v) for n, v in samples if n > (v + 1) * batch]
    assert samples and over == [], over[:5]
