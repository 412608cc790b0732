"""The submission part on its own (rollq/producer/_submission.py, routing.py): a Submission
driven by a stand-in for its producer (the three things of SubmitHost), against real Redis."""

from __future__ import annotations

import pytest

from rollq.connection import connect
from rollq.keys import QueueKeys
from rollq.producer._calls import CallNumbers
from rollq.producer._handles import Ledger
from rollq.producer._routing import CallRouter
from rollq.producer._submission import Submission, SubmitHost
from rollq.protocol import Job, decode_job
from rollq.settings import ProducerSettings, RedisSettings
from rollq.shards import ShardMap, declare_shards, home_shard, shard_of_id


class Host:
    """A producer as its Submission sees it: a client, jobs from specs, following a count."""

    def __init__(self, client, keys: QueueKeys, producer_id: str = "p1"):
        self._client = client
        self.keys, self.id = keys, producer_id
        self.followed: list[int] = []
        self.submission: Submission | None = None
        self._n = 0

    def build_jobs(self, specs) -> list[Job]:
        out = []
        for spec in specs:
            self._n += 1
            given = spec.get("id")
            out.append(Job(id=given or f"{self.id}-{self._n}", reply=self.id, text=spec["prompt"],
                           replica=spec.get("replica"), tracked=given is not None))
        return out

    async def _follow_shards(self, k: int) -> None:
        self.followed.append(k)
        layout = ShardMap(self.keys, k)
        self.submission.router.set_shards(layout, [s.submit_calls(self.id) for s in layout])


def make(host: Host, settings: ProducerSettings) -> Submission:
    counters = {"submitted": 0, "duplicates": 0, "results": 0, "duplicate_results": 0, "resends": 0}
    ledger = Ledger(settings, counters, lambda: None)
    ledger.connect()
    host.submission = Submission(lambda: host, host.id, host.keys, settings, RedisSettings(), counters, ledger)
    return host.submission


def test_the_host_protocol_is_what_a_producer_offers():
    from rollq.producer.client import Producer

    host: SubmitHost = Producer("redis://127.0.0.1:1/0", "q")  # type-checked: Producer is a SubmitHost
    assert callable(host.build_jobs) and callable(host._follow_shards) and host._client is None


@pytest.mark.asyncio
async def test_a_submission_enqueues_through_its_host_and_follows_a_grown_count(redis_url, queue):
    keys = QueueKeys(queue)
    client = connect(RedisSettings.from_url(redis_url))
    try:
        host = Host(client, keys)
        sub = make(host, ProducerSettings(script_batch=2))
        handles = await sub.submit_many([{"prompt": f"j{i}"} for i in range(5)])
        assert [h.id for h in handles] == [f"p1-{i}" for i in range(1, 6)]
        assert sub.ledger.outstanding == 5 and await client.xlen(keys.jobs) == 5
        assert sub.numbers.last >= 3  # 5 jobs in calls of 2: three numbered calls
        # The queue records 3 shards now: the next call is refused for its count, the host
        # follows the record, and the call goes again, routed over 3 shards.
        await declare_shards(client, keys, 3)
        more = await sub.submit_many([{"prompt": "a", "id": "given-1"}, {"prompt": "b", "replica": "r9"}])
        assert host.followed == [3] and sub.router.shards == 3
        streams = {h.id: h._entry[0] for h in more}
        assert streams["given-1"] == keys.shard(shard_of_id("given-1", 3)).jobs
        assert streams["p1-7"] == keys.shard(home_shard("r9", 3)).replica_jobs("r9")
        entries = await client.xrange(streams["given-1"])
        assert decode_job(entries[-1][1][b"d"]).id == "given-1"
    finally:
        await client.delete(*[k for s in keys.shards(3) for k in (s.jobs, s.ids, s.config, s.submit_calls("p1"))])
        await client.aclose()


@pytest.mark.asyncio
async def test_a_submission_whose_producer_is_gone_says_so():
    sub = Submission(lambda: None, "p1", QueueKeys("q"), ProducerSettings(), RedisSettings(), {}, Ledger(ProducerSettings(), {}, lambda: None))
    with pytest.raises(RuntimeError, match="producer of this submission is gone"):
        await sub.submit_many([{"prompt": "x"}])


def test_the_router_numbers_calls_and_routes_each_kind_of_job():
    keys, numbers = QueueKeys("grpo"), CallNumbers()
    ledger = Ledger(ProducerSettings(), {}, lambda: None)
    router = CallRouter("p1", keys, 2, numbers, ledger)
    jobs = [Job(id=f"g{i}", reply="p1", text="x") for i in range(3)]
    calls = router.calls(jobs)  # one shard: two calls of at most 2 jobs, numbered 1, 2
    assert [(c[0][0], c[0][-1], c[1][3], list(c[2])) for c in calls] == [
        (keys.jobs, keys.submit_calls("p1"), 1, [0, 1]), (keys.jobs, keys.submit_calls("p1"), 2, [2])]
    layout = ShardMap(keys, 4)
    router.set_shards(layout, [s.submit_calls("p1") for s in layout])
    jobs = [Job(id="mine", reply="p1", text="x", tracked=True), Job(id="t", reply="p1", text="x", replica="r1"),
            *(Job(id=f"rr{i}", reply="p1", text="x") for i in range(4))]
    by_job = {jobs[k].id: (c[0], c[1]) for c in router.calls(jobs) for k in c[2]}
    assert by_job["mine"][0][0] == layout.of_id("mine").jobs and by_job["mine"][0][-1] == layout.of_id("mine").submit_calls("p1")
    assert by_job["t"][0][0] == layout.home("r1").replica_jobs("r1")
    assert sorted(layout.of_key(by_job[f"rr{i}"][0][0]).shard_index for i in range(4)) == [0, 1, 2, 3]
    assert {args[6] for args in (v[1] for v in by_job.values())} == {4}  # every call carries K
    # A queue that grew: a caller-chosen id homed elsewhere is checked in shard 0 first.
    router.grown = True
    other = next(f"id{i}" for i in range(100) if shard_of_id(f"id{i}", 4) != 0)
    (keys0, args, _), = router.calls([Job(id=other, reply="p1", text="x", tracked=True)])
    assert keys0[0] == keys.jobs and args[7] == "1"


async def test_submit_batch_sends_a_requests_jobs_together_or_none_of_them(make_producer, queue, redis_client):
    """``Producer.submit_batch``: every spec validated before anything is sent; many batches
    at once share the producer's connections (no connection held per batch, unlike
    ``submit_many``)."""
    import asyncio

    from rollq.errors import InvalidJob

    p = await make_producer(queue)
    stream = QueueKeys(queue).jobs
    with pytest.raises(InvalidJob):
        await p.submit_batch([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}])
    assert await redis_client.xlen(stream) == 0
    assert await p.submit_batch([]) == []
    batches = await asyncio.gather(*(p.submit_batch([{"prompt_token_ids": [i, 1]}, {"prompt": f"x{i}"}]) for i in range(300)))
    assert sum(len(b) for b in batches) == 600 and await redis_client.xlen(stream) == 600
    ids = [h.id for b in batches for h in b]
    assert len(set(ids)) == 600
