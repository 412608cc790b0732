"""How late the follower sees the workers' watchers finish staging a version, by how often it
reads their statuses, both settings in one run.

    python benchmarks/ipc_watch_poll.py [--reps 200] [--busy-ms 1] [--idle-ms 1] [--out benchmarks/results/ipc_watch_poll]

A real redis-server, and the follower's own wait for a version the workers' watchers copy
(``IpcReceive._watched``, reading ``QueueKeys.weights_ipc_staged``). A process of its own
stands in for a watcher (a vLLM worker is another process): it writes "staging", then after a
random 1-15 ms "staged", as a watcher does once its copy ended. Meanwhile a task keeps the follower's event
loop busy ``--busy-ms`` at a time with ``--idle-ms`` between (vLLM's output handler and the
consumer's results share that loop with the requests running). The two settings of
``rollq.weightsync.transports.ipc.WATCH_POLL_FIRST_S`` / ``WATCH_POLL_S`` take turns, one
update each: reads after 1 ms doubling to every 5 ms (before) and after 0.5 ms doubling to
every 1 ms (now). Per update: from the "staged" write returning to the wait returning (ms),
and the reads it took. Results: ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._report import write_results  # noqa: E402

SETTINGS = {"before (1 ms doubling to 5 ms)": (0.001, 0.005), "now (0.5 ms doubling to 1 ms)": (0.0005, 0.001)}


def watcher_main(url: str, key: str, conn: Any) -> None:
    """The stand-in watcher: for each ``(version, wait_s)`` received, write "staging", answer,
    wait, write "staged" and answer the time the write returned (``time.time()``)."""
    import msgspec
    import redis

    from rollq.weightsync.wire import StageStatus, State

    client = redis.Redis.from_url(url)
    while (job := conn.recv()) is not None:
        version, wait_s = job
        client.hset(key, "r0/0", msgspec.msgpack.encode(StageStatus(state=State.STAGING, version=version)))
        conn.send(None)
        time.sleep(wait_s)
        client.hset(key, "r0/0", msgspec.msgpack.encode(StageStatus(state=State.STAGED, version=version)))
        conn.send(time.time())
    client.close()


async def busy_loop(busy_s: float, idle_s: float, stop: asyncio.Event) -> None:
    """Hold the event loop ``busy_s`` at a time, ``idle_s`` apart, until ``stop``."""
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(idle_s)


async def main(a: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    from rollq import RedisServer, WeightSyncSettings
    from rollq.connection import connect
    from rollq.keys import QueueKeys
    from rollq.weightsync.transports import ipc as ipc_mod
    from rollq.weightsync.transports.ipc import IpcReceive

    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    with RedisServer() as srv:
        client = await connect(srv.url)
        keys = QueueKeys("poll")
        reads = [0]
        real_hmget = client.hmget

        async def counted(*args: Any, **kw: Any) -> Any:
            reads[0] += 1
            return await real_hmget(*args, **kw)

        client.hmget = counted  # type: ignore[method-assign]
        t = IpcReceive(None, WeightSyncSettings(load_timeout=5.0), None)
        t.client, t.keys, t._fields = client, keys, ("r0/0",)
        conn, child = mp.get_context("spawn").Pipe()
        watcher = mp.get_context("spawn").Process(target=watcher_main, args=(srv.url, keys.weights_ipc_staged, child), daemon=True)
        watcher.start()
        stop = asyncio.Event()
        busy = asyncio.create_task(busy_loop(a.busy_ms / 1000, a.idle_ms / 1000, stop))
        names = list(SETTINGS)
        try:
            for i in range(2 * a.reps + 2):  # the first of each setting warms up, not counted
                name = names[i % 2]
                ipc_mod.WATCH_POLL_FIRST_S, ipc_mod.WATCH_POLL_S = SETTINGS[name]
                version, wait_s = i + 1, rng.uniform(0.001, 0.015)
                conn.send((version, wait_s))
                await asyncio.to_thread(conn.recv)  # "staging" written
                reads[0] = 0
                staged = await t._watched(version, keys)
                seen = time.time()
                written = await asyncio.to_thread(conn.recv)
                assert staged is not None and staged.version == version, staged
                if i >= 2:
                    rows.append({"setting": name, "late_s": seen - written, "reads": reads[0], "copy_s": wait_s})
        finally:
            stop.set()
            await busy
            conn.send(None)
            watcher.join(10)
            await client.aclose()
    return {"reps": a.reps, "busy_ms": a.busy_ms, "idle_ms": a.idle_ms, "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SETTINGS:
        late = sorted(r["late_s"] for r in rows if r["setting"] == name)
        out[name] = {"median_ms": statistics.median(late) * 1000, "p90_ms": late[int(0.9 * (len(late) - 1))] * 1000,
                     "mean_ms": statistics.fmean(late) * 1000,
                     "reads_per_wait": statistics.fmean(r["reads"] for r in rows if r["setting"] == name)}
    return out


def render(out: dict[str, Any], cmd: str) -> str:
    s = out["summary"]
    before, now = (s[n] for n in SETTINGS)
    lines = [f"# The follower seeing a watcher's \"staged\" status ({out['reps']} updates per setting, taking turns)", "",
             f"`{cmd}`: the event loop busy {out['busy_ms']} ms at a time, {out['idle_ms']} ms apart; the copy 1-15 ms.", "",
             "| reads of the statuses | median late (ms) | p90 (ms) | mean (ms) | reads per wait |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in SETTINGS:
        r = s[name]
        lines.append(f"| {name} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['mean_ms']:.2f} | {r['reads_per_wait']:.1f} |")
    lines += ["", f"now / before: median {now['median_ms'] / before['median_ms']:.2f}x, mean {now['mean_ms'] / before['mean_ms']:.2f}x, "
              f"reads {now['reads_per_wait'] / before['reads_per_wait']:.2f}x"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="updates per setting")
    ap.add_argument("--busy-ms", type=float, default=1.0, help="the event loop held this long at a time")
    ap.add_argument("--idle-ms", type=float, default=1.0, help="between two holds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    write_results(args.out, result, render(result, "python benchmarks/ipc_watch_poll.py " + " ".join(sys.argv[1:])))
