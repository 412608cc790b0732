"""The reclaimer role: one replica of a queue scans for dead peers; every replica still
recovers its own lost entries; the role moves when its holder dies or stops."""

from __future__ import annotations

import asyncio
from typing import Any

from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer
from rollq.keys import GROUP, QueueKeys
from tests.helpers import bounded, collect, pending_of, until

ONE = {"sampling": {"max_tokens": 1}}


class Counted:
    """Counts a consumer's reclaim turns, and its XINFO CONSUMERS calls (the peer scan) once
    it serves."""

    def __init__(self, c: Consumer) -> None:
        self.turns = 0
        self.scans = 0
        turn = c.reclaimer.reclaim_once

        async def counted_turn() -> int:
            self.turns += 1
            return await turn()

        c.reclaimer.reclaim_once = counted_turn
        self.c = c

    def count_scans(self) -> None:
        client = self.c._ctx.redis
        scan = client.xinfo_consumers

        async def counted_scan(*a: Any, **kw: Any) -> Any:
            self.scans += 1
            return await scan(*a, **kw)

        client.xinfo_consumers = counted_scan


async def role_holder(client, queue: str) -> bytes | None:
    return await client.get(QueueKeys(queue).reclaimer)


async def test_one_replica_scans_for_the_fleet(queue, make_consumer, redis_client):
    cs = [make_consumer(queue, consumer_id=f"r{i}", reclaim_interval=0.05) for i in range(4)]
    counted = [Counted(c) for c in cs]
    for c in cs:
        make_consumer.start(c)
    await until(lambda: all(c.state == "serving" for c in cs), 10, "the replicas to serve")
    for n in counted:
        n.count_scans()
        n.turns = 0
    await until(lambda: all(n.turns >= 20 for n in counted), 20, "20 reclaim turns of every replica")
    turns, scans = [n.turns for n in counted], [n.scans for n in counted]
    # one scan per turn of one replica (a turn or two more while the role is first taken)
    assert sum(scans) <= max(turns) + 2, f"scans {scans} for turns {turns}: more than one replica scans"
    holder = (await role_holder(redis_client, queue)).decode()
    assert scans[[c.id for c in cs].index(holder)] > 0, "the role's holder does not scan"


async def test_replica_without_the_role_recovers_its_own_lost_entries(queue, make_producer, make_consumer, redis_client):
    """What tests/system/test_faults.py checks for a lone replica (a read reply lost after
    Redis delivered it), for a replica that does not hold the reclaimer role and so never
    lists the group's consumers."""
    k = QueueKeys(queue)
    await redis_client.set(k.reclaimer, b"elsewhere", px=120_000)  # a live peer holds the role
    c = make_consumer(queue, consumer_id="c0", block=0.05)
    counted = Counted(c)
    make_consumer.start(c)
    await until(lambda: c.state == "serving", 5, "the consumer to serve")
    counted.count_scans()
    c.intake_gate.clear()  # hold the pull loop (as a weight update does)
    await asyncio.sleep(0.3)  # let a read in flight return
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", **ONE} for i in range(3)])
    resp = await redis_client.xreadgroup(GROUP, "c0", {k.jobs: ">"}, count=10)  # the reply that was lost
    assert resp and len(resp[0][1]) == 3, "precondition: the consumer must not have pulled the jobs itself"
    c.intake_gate.set()
    results = await bounded(p.gather(handles), 3 * c.settings.lease_ttl + 5, "the jobs whose delivery was lost")
    assert all(r.ok and r.replica == "c0" for r in results)
    assert counted.turns > 0 and counted.scans == 0, "a replica without the role scanned the group"
    assert await role_holder(redis_client, queue) == b"elsewhere"


async def test_role_moves_when_its_holder_is_killed(queue, redis_url, make_producer, make_consumer, spawn, redis_client):
    """The holder dies holding jobs: the role expires, a peer takes it and the jobs, each
    completed once."""
    k = QueueKeys(queue)
    lease = dict(lease_ttl=2, heartbeat=0.5, reclaim=0.5)
    victim = spawn(redis_url, queue, "victim", 100, max_inflight=4, **lease)  # 1 s jobs, 4 at a time
    await victim.ready()
    await until(lambda: role_holder(redis_client, queue), 10, "the first replica to take the role")
    assert await role_holder(redis_client, queue) == b"victim"
    p = await make_producer(queue)
    handles = await p.submit_many([{"prompt": f"j{i}", "sampling": {"max_tokens": 10}} for i in range(4)])

    async def holds_all() -> bool:
        return len(await pending_of(redis_client, k.jobs, "victim")) == 4

    await until(holds_all, 5, "the victim to take every job")
    heir = make_consumer(queue, consumer_id="heir", engine=EchoEngine(), lease_ttl=2, heartbeat_interval=0.5, reclaim_interval=0.5)
    make_consumer.start(heir)
    await until(lambda: heir.state == "serving", 5, "the heir to serve")
    victim.kill()
    got = await collect(p, 4, timeout=20, settle=0.5)
    assert sorted(got) == sorted(h.id for h in handles)
    assert all(len(rs) == 1 and rs[0].ok and rs[0].replica == "heir" and rs[0].deliveries == 2 for rs in got.values())
    assert heir.counters.reclaimed == 4
    assert await role_holder(redis_client, queue) == b"heir"


async def test_stopping_holder_gives_the_role_up(queue, make_consumer, redis_client):
    """A stopping holder deletes the role key; a peer takes it at its next turn, and the key
    is gone once every replica has stopped."""
    first = make_consumer(queue, consumer_id="first", reclaim_interval=0.05, lease_ttl=30)
    make_consumer.start(first)
    await until(lambda: role_holder(redis_client, queue), 10, "the first replica to take the role")
    second = make_consumer(queue, consumer_id="second", reclaim_interval=0.05, lease_ttl=30)
    make_consumer.start(second)
    await until(lambda: second.state == "serving", 5, "the second replica to serve")
    # first keeps the role (renewed every 50 ms, for 30 s) until it stops
    assert await role_holder(redis_client, queue) == b"first"
    await make_consumer.stop(first)
    await until(lambda: role_holder(redis_client, queue), 5, "a peer to take the role")
    assert await role_holder(redis_client, queue) == b"second"
    await make_consumer.stop(second)
    assert await role_holder(redis_client, queue) is None
