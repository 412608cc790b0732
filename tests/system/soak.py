"""A bounded Jepsen-style run: producers submit through a proxy that cuts connections,
consumer processes are SIGKILLed and restarted, Redis is SIGKILLed and restarted (AOF,
``appendfsync always``); every submit, delivery, finish and result goes to a history that
:func:`rollq.testing.chaos.check_history` checks with the final Redis state.

Used by ``tests/system/test_history.py`` (small, in CI) and ``benchmarks/history_soak.py``
(100k jobs). Only loopback traffic; only processes this run started are killed, by pid.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from rollq.connection import connect
from rollq.errors import SubmitInterrupted
from rollq.keys import GROUP, QueueKeys
from rollq.producer.client import Producer
from rollq.server import RedisServer
from rollq.settings import ProducerSettings, RedisSettings
from rollq.testing.chaos import CutProxy, HistoryLog, check_history, read_history
from tests.helpers import Proc

log = logging.getLogger(__name__)


@dataclass
class SoakConfig:
    jobs: int = 3000
    rounds: int = 6
    round_gap: float = 2.0  # seconds between rounds: the faults land while jobs run
    consumers: int = 3
    delay_ms: float = 0.2  # echo engine: per generated token
    max_tokens: int = 4
    cut_every: tuple[float, float] = (0.02, 0.2)  # seconds between proxy cuts
    consumer_kill_every: float = 3.0
    redis_kills: int = 1
    seed: int = 0
    drain_timeout: float = 90.0
    results_through_proxy: bool = True
    queue: str = "soak"


@dataclass
class SoakReport:
    config: dict[str, Any]
    check: dict[str, Any]
    wall_s: float
    consumer_kills: int
    redis_kills: int
    proxy_cuts: int
    submit_errors: int
    in_doubt: int
    lost_sample: list[str] = field(default_factory=list)
    duplicate_sample: dict[str, int] = field(default_factory=dict)


async def _stuck(url: str, queue: str) -> dict[str, int]:
    """What Redis still holds for the queue once every result is in: entries queued or
    pending in the job streams (should be none)."""
    k = QueueKeys(queue)
    c = connect(url)
    out: dict[str, int] = {}
    try:
        for stream in [k.jobs]:
            out[f"{stream} entries"] = int(await c.xlen(stream))
            try:
                info = await c.xpending(stream, GROUP)
                out[f"{stream} pending"] = int(info["pending"])
            except Exception:  # noqa: BLE001 - no group: nothing pending
                out[f"{stream} pending"] = 0
    finally:
        await c.aclose()
    return out


async def run_soak(cfg: SoakConfig, workdir: str | None = None) -> SoakReport:
    rng = random.Random(cfg.seed)
    workdir = workdir or tempfile.mkdtemp(prefix="rollq-soak-")
    hist_path = os.path.join(workdir, "history.jsonl")
    srv = RedisServer(appendfsync="always", data_dir=os.path.join(workdir, "redis")).start()
    proxy = await CutProxy(srv.port).start()
    procs: dict[str, Proc] = {}
    kills = redis_kills = submit_errors = in_doubt = 0
    t0 = time.monotonic()
    hist = HistoryLog(hist_path, "producer")

    def start_consumer(cid: str) -> None:
        procs[cid] = Proc(srv.url, cfg.queue, cid, cfg.delay_ms, lease_ttl=1.5, heartbeat=0.3, reclaim=0.3,
                          block=0.2, max_deliveries=50, history=hist_path)

    for i in range(cfg.consumers):
        start_consumer(f"c{i}")
    settings = RedisSettings.from_url(proxy.url, command_timeout=20.0)
    producer = Producer(settings, cfg.queue, producer_id="soak-producer",
                        settings=ProducerSettings(max_outstanding=cfg.jobs + 1))
    results_seen = 0
    done = asyncio.Event()

    async def read_results() -> None:
        nonlocal results_seen
        async for r in producer.results(timeout=cfg.drain_timeout):
            hist.event("result", [r.id], **({"error": r.error.type} if r.error else {}))
            results_seen += 1
            if done.is_set() and results_seen >= expected():
                return

    submitted_ids: set[str] = set()

    def expected() -> int:
        return len(submitted_ids)

    async def faults() -> None:
        nonlocal kills, redis_kills
        next_kill = time.monotonic() + cfg.consumer_kill_every
        redis_at = [t0 + (i + 1) * (cfg.consumer_kill_every * 2.5) for i in range(cfg.redis_kills)]
        while not done.is_set() or results_seen < expected():
            await asyncio.sleep(0.05)
            now = time.monotonic()
            if now - t0 > cfg.drain_timeout * 3:
                return
            if now >= next_kill:
                cid = rng.choice(sorted(procs))
                procs[cid].kill()  # SIGKILL, by pid: a process this run started
                procs[cid].cleanup()
                kills += 1
                start_consumer(cid)  # the same id comes back and resumes its own leased jobs
                next_kill = now + cfg.consumer_kill_every
            if redis_at and now >= redis_at[0] and not done.is_set():
                redis_at.pop(0)
                srv.kill()  # SIGKILL: AOF with appendfsync always keeps every acknowledged write
                await asyncio.sleep(0.3)
                srv.start()
                redis_kills += 1

    await producer.connect()
    reader = asyncio.create_task(read_results())
    fault_task = asyncio.create_task(faults())
    proxy.start_cutting(*cfg.cut_every, seed=cfg.seed)
    per_round = cfg.jobs // cfg.rounds
    sp = {"max_tokens": cfg.max_tokens}
    try:
        for rnd in range(cfg.rounds):
            specs = [{"prompt_token_ids": [rnd, i % 1000 + 1], "sampling": sp} for i in range(per_round)]
            try:
                handles = await producer.submit_many(specs)
            except SubmitInterrupted as e:  # Redis unreachable past command_timeout (a long outage)
                submit_errors += 1
                hist.event("submit", [h.id for h in e.enqueued])
                submitted_ids.update(h.id for h in e.enqueued)
                hist.event("maybe", [j.id for j in e.in_doubt])
                in_doubt += len(e.in_doubt)
                handles = await e.resume()  # resends the in-doubt calls under their numbers: no doubles
            hist.event("submit", [h.id for h in handles])
            submitted_ids.update(h.id for h in handles)
            if rnd + 1 < cfg.rounds:
                await asyncio.sleep(cfg.round_gap)
        done.set()
        await asyncio.wait_for(reader, cfg.drain_timeout + 30)
    finally:
        proxy.stop_cutting()
        fault_task.cancel()
        await asyncio.gather(fault_task, return_exceptions=True)
        if not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        cuts = proxy.cuts
        await producer.close()
        stuck = await _stuck(srv.url, cfg.queue)
        for p in procs.values():
            p.cleanup()
        await proxy.stop()
        hist.close()
        srv.cleanup()
    report = check_history(read_history(hist_path), stuck)
    return SoakReport(
        config=cfg.__dict__ | {"cut_every": list(cfg.cut_every)}, check=report.summary(),
        wall_s=round(time.monotonic() - t0, 1), consumer_kills=kills, redis_kills=redis_kills, proxy_cuts=cuts,
        submit_errors=submit_errors, in_doubt=in_doubt, lost_sample=report.lost[:10],
        duplicate_sample=dict(list(report.duplicates.items())[:10]),
    )
