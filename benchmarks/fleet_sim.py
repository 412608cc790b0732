"""Fleet simulation (issue 16): many replica loops against one Redis, or a 3-master Redis Cluster.

    python benchmarks/fleet_sim.py [--replicas 1000] [--procs 4] [--targets single,cluster]
                                   [--idle 10] [--load-seconds 8] [--rates 1000,3000,max]
                                   [--shards 1] [--producers 1] [--out benchmarks/results/fleet_sim]

Each replica is the real consumer pipeline (:class:`rollq.consumer.loop.Consumer`: pull,
finish, heartbeat, reclaim, control listener, version wait) with an ``EchoEngine`` and the
real :class:`rollq.weightsync.replica.follower.WeightFollower` (version record reconciled every 5 s,
pub/sub hints through the consumer's control listener), all with default settings. ``--procs``
worker processes (``fleet_sim.py worker``, one asyncio loop each) run ``--replicas`` of them
between them. Workers talk to the parent in JSON lines on stdin/stdout; nothing is pickled.

Per target the parent starts its own server(s) (``rollq.server.RedisServer``: AOF on,
``appendfsync everysec``; the cluster: ``rollq.server.LocalCluster`` of 3 masters, AOF on,
through a ``redis+cluster://`` URL) and measures, from ``INFO commandstats`` and ``INFO cpu``
deltas on every node:

1. submit calibration (no replica running): Redis CPU per submitted job;
2. idle (no jobs): commands per replica per second by family (heartbeat, pull, reclaim,
   version follow) and Redis CPU per replica;
3. load, for each offered rate (a producer in the parent submitting with
   ``Producer.submit_many`` every 50 ms; ``max``: as fast as it can; with ``--producers P``
   the rate is split over the parent's producer and P-1 producer processes, each reading its
   own results), jobs/s completed, Redis CPU per job and Redis CPU as a fraction of one core;
4. the drain: every submitted job got exactly one result.

``--shards K`` runs the fleet on a queue of K shards (rollq/shards.py): the producer and every
replica are given ``shards=K`` (``ProducerSettings``/``ConsumerSettings``; K=1 leaves them at
None, as before sharding existed). Every window reports, per Redis node (per master of the
cluster), its CPU (``node_cores``) and its commands (``node_calls_per_s``, ``node_commands``),
and the report says which node holds each shard (``shard_nodes``), so a run at K=1 and one at
K=3 on the 3-master cluster show whether sharding spread the load over the masters.

This machine's few cores run the generator too, so the replicas issue their periodic commands
less often than a real fleet whose every replica has its own host. Measured cycles per
replica per second are reported next to the nominal ones (the settings' intervals), and the
per-cycle Redis cost is scaled to the nominal rate for the extrapolation (see ``summarize``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import queue as queue_mod
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:  # run as a script: import rollq from this checkout
    sys.path.insert(0, str(REPO))

QUEUE = "fleet"
PRODUCER_ID = "fleet-prod"
TICK_S = 0.05  # the producer submits one batch per tick at a fixed offered rate

#: Command (as ``INFO commandstats`` names it, lower case) -> family. Commands inside Lua
#: scripts are counted by Redis under their own names as well as under the EVALSHA that ran
#: them; the idle phase runs no script, so its families are exact.
#: A reclaim turn (rollq/consumer/_reclaimer.py) is a GET of the reclaimer role key and the
#: replica's own-entry check (two XPENDING); the role's holder adds a PEXPIRE and the peer
#: scan (XINFO CONSUMERS, one EXISTS per peer). Before the role existed (rollq before issue
#: 16's fix) every turn of every replica was the scan alone.
FAMILIES = {
    "set": "heartbeat", "hset": "heartbeat", "zadd": "heartbeat", "mget": "heartbeat",
    "hincrby": "heartbeat", "zremrangebyscore": "heartbeat",
    "xreadgroup": "pull", "xautoclaim": "pull", "xclaim": "pull",
    "xinfo|consumers": "reclaim", "exists": "reclaim", "get": "reclaim", "pexpire": "reclaim", "xpending": "reclaim",
    "hget": "version follow", "hmget": "version follow", "subscribe": "version follow",
    "evalsha": "scripts (SUBMIT, FINISH)", "eval": "scripts (SUBMIT, FINISH)",
    "xread": "results (producer)", "xdel": "results (producer)",
    # redis-py's cluster client asks a node (its default one) for the keys of commands whose
    # key positions move (XREAD, XREADGROUP): two COMMAND GETKEYS per such call, measured
    "command|getkeys": "key lookups (redis-py cluster client)",
}
#: The peer scan: what grows with the number of consumers in the group.
SCAN = ("xinfo|consumers", "exists")
#: Commands that mark one cycle of a periodic family (how many times the loop ran): the first
#: of each tuple that was called (a reclaim turn: the role's GET, else, before the role, the scan).
CYCLE_MARKER = {"heartbeat": ("set",), "reclaim": ("get", "xinfo|consumers"), "pull": ("xreadgroup",),
                "version follow": ("hget",)}
#: Marker calls per cycle (the follower's reconcile reads two HGETs in one pipeline).
CALLS_PER_CYCLE = {"heartbeat": 1, "reclaim": 1, "pull": 1, "version follow": 2}
#: Families whose cycle touches every shard of a sharded queue: a replica renews its lease and
#: takes its reclaim turn in each shard, and an idle pull reads each shard's stream, so one
#: cycle is K marker calls.
PER_SHARD = ("heartbeat", "reclaim", "pull")
#: Nominal cycles per replica per second with default settings (ConsumerSettings:
#: heartbeat_interval 1 s, reclaim_interval 1 s jittered 0.75-1.25x, block 1 s when idle;
#: WeightFollower reconcile_interval 5 s).
NOMINAL_HZ = {"heartbeat": 1.0, "reclaim": 1.0, "pull": 1.0, "version follow": 0.2}
IGNORED = {"info", "ping", "config|get", "config|set", "client|setname", "cluster|slots", "cluster|nodes",
           "cluster|info", "command", "command|docs", "hello", "select", "script|load", "script|exists",
           "xgroup|create", "xgroup|createconsumer", "client|info"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shard_setting(k: int) -> int | None:
    """``shards=`` of the producer's and the replicas' settings: None (follow the queue's
    record, 1 if none: the settings' default, as before sharding) for one shard, else ``k``."""
    return None if k == 1 else k


# ------------------------------------------------------------------------------------------
# worker process: --count replicas on one asyncio loop
# ------------------------------------------------------------------------------------------
def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def worker_main(args: argparse.Namespace) -> dict:
    """Run ``args.count`` replicas until the parent writes ``stop`` (or ``args.max_seconds``)."""
    import logging

    from rollq.consumer.engine import EchoEngine
    from rollq.consumer.replica import Replica
    from rollq.settings import ConsumerSettings, WeightSyncSettings

    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def read_stdin() -> None:  # a daemon thread: the parent's "stop" line (or EOF) ends the run
        sys.stdin.readline()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_stdin, daemon=True).start()
    settings = ConsumerSettings(shards=shard_setting(args.shards))
    # A follower each (no weights to load: echo engines), for its Redis traffic.
    weights = WeightSyncSettings(reconcile_interval=args.reconcile_interval)
    replicas = [Replica(EchoEngine(), args.url, args.queue, consumer_id=f"sim-{args.first + i:05d}", settings=settings,
                        weights=weights) for i in range(args.count)]
    consumers = [r.consumer for r in replicas]
    t0 = time.monotonic()
    # Start in waves so that 1,000 handshakes do not all queue up at once.
    for w in range(0, len(replicas), args.wave):
        wave = replicas[w:w + args.wave]
        await asyncio.gather(*(r.start() for r in wave))
        deadline = time.monotonic() + 60
        while any(r.consumer.state != "serving" for r in wave) and time.monotonic() < deadline and not stop.is_set():
            await asyncio.sleep(0.05)
    serving = sum(c.state == "serving" for c in consumers)
    _emit({"ready": serving, "count": len(consumers), "start_s": round(time.monotonic() - t0, 2), "pid": os.getpid()})
    try:
        await asyncio.wait_for(stop.wait(), args.max_seconds)
    except asyncio.TimeoutError:
        pass
    # Stop every replica at once (one by one, each await would wait behind all the others'
    # loops on this starved event loop), each consumer bounded by 60 s.
    in_time = await asyncio.gather(*(r.stop(timeout=60) for r in replicas))
    k = [c.counters for c in consumers]
    return {
        "replicas": len(consumers), "serving_at_start": serving, "stuck_at_stop": in_time.count(False),
        "pulled": sum(x.pulled for x in k), "completed": sum(x.completed for x in k),
        "failed": sum(x.failed for x in k), "reclaimed": sum(x.reclaimed for x in k),
        "completed_per_replica_max": max((x.completed for x in k), default=0),
        "replicas_with_jobs": sum(1 for x in k if x.completed),
        "exit_codes": sorted({c.exit_code for c, ok in zip(consumers, in_time) if ok}),
    }


async def producer_main(args: argparse.Namespace) -> None:
    """A producer child (``--producers`` > 1): its own :class:`Load`, driven by the parent's
    command lines (``offer RATE|max SECONDS``, ``received``, ``wait SECONDS``, ``stop``); one
    JSON line answers each. It reads its own results, so the exactly-once check covers its jobs."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.strip())
        loop.call_soon_threadsafe(lines.put_nowait, "stop")

    threading.Thread(target=read_stdin, daemon=True).start()
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    load = Load(args.url, args.queue, args.shards, producer_id=f"{PRODUCER_ID}-{args.index}")
    await load.start()
    _emit({"ready": 1, "pid": os.getpid()})
    try:
        while True:
            cmd = (await asyncio.wait_for(lines.get(), args.max_seconds)).split()
            if not cmd or cmd[0] == "stop":
                _emit({"done": True, "check": load.check()})
                return
            if cmd[0] == "offer":
                sub = await load.offer(None if cmd[1] == "max" else float(cmd[1]), float(cmd[2]))
                _emit({**sub, "received": load.received()})
            elif cmd[0] == "received":
                _emit({"received": load.received()})
            elif cmd[0] == "wait":
                _emit({"drained": await load.wait_all(float(cmd[1])), "received": load.received()})
    finally:
        await load.close()


class Worker:
    """One child process (replicas: :meth:`replicas`; a producer: :meth:`producer`) and the
    JSON lines it writes."""

    @classmethod
    def replicas(cls, url: str, queue: str, first: int, count: int, args: argparse.Namespace) -> Worker:
        return cls(["worker", "--url", url, "--queue", queue, "--first", str(first), "--count", str(count),
                    "--wave", str(args.wave), "--max-seconds", str(args.worker_max_seconds),
                    "--reconcile-interval", str(args.reconcile_interval), "--shards", str(args.shards)])

    @classmethod
    def producer(cls, url: str, queue: str, index: int, args: argparse.Namespace) -> Worker:
        return cls(["producer", "--url", url, "--queue", queue, "--index", str(index), "--shards", str(args.shards),
                    "--max-seconds", str(args.worker_max_seconds)])

    def __init__(self, argv: list[str]):
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=str(REPO))
        self.lines: queue_mod.Queue = queue_mod.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._keep_err), daemon=True).start()

    def _keep_err(self, line: str) -> None:
        self.err = (self.err + [line])[-200:]

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line)

    def next_json(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            if line.startswith("{"):
                return json.loads(line)
        return {"error": f"no report within {timeout:.0f}s (rc={self.proc.poll()})", "stderr": "".join(self.err)[-2000:]}

    def send(self, line: str) -> None:
        """Write one command line to the child (a producer's ``offer``, ``received``, ``wait``)."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def ask(self, line: str, timeout: float) -> dict:
        self.send(line)
        return self.next_json(timeout)

    def stop(self) -> None:
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # our own child, by its handle
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ------------------------------------------------------------------------------------------
# Redis measurements
# ------------------------------------------------------------------------------------------
def snapshot(nodes: list) -> dict:
    """``INFO commandstats`` and ``INFO cpu`` of every node, with the wall time."""
    out = []
    for r in nodes:
        cs = r.info("commandstats")
        cpu = r.info("cpu")
        out.append({
            "cmd": {k[len("cmdstat_"):]: (int(v["calls"]), int(v["usec"])) for k, v in cs.items()},
            "cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        })
    return {"t": time.monotonic(), "nodes": out}


def delta(a: dict, b: dict, replicas: int, baseline: dict | None = None, shards: int = 1) -> dict:
    """What happened between two snapshots: per command calls/usec, per family, CPU.

    With ``baseline`` (a delta of the bare server) its CPU per second is taken off every
    node's CPU (``redis_cpu_s``, ``redis_cores``); ``raw_cores`` keeps the total. ``shards``:
    the queue's K; a cycle of the :data:`PER_SHARD` families is K marker calls."""
    wall = b["t"] - a["t"]
    cmds: dict[str, list[int]] = {}
    node_cpu = []
    node_cmds: list[dict[str, int]] = []  # per node: command -> calls
    for na, nb in zip(a["nodes"], b["nodes"]):
        node_cpu.append(nb["cpu"] - na["cpu"])
        mine: dict[str, int] = {}
        for name, (calls, usec) in nb["cmd"].items():
            c0, u0 = na["cmd"].get(name, (0, 0))
            if calls - c0 and name not in IGNORED:
                acc = cmds.setdefault(name, [0, 0])
                acc[0] += calls - c0
                acc[1] += usec - u0
                mine[name] = calls - c0
        node_cmds.append(dict(sorted(mine.items(), key=lambda kv: -kv[1])))
    fams: dict[str, dict] = {}
    for name, (calls, usec) in cmds.items():
        f = fams.setdefault(FAMILIES.get(name, "other"), {"calls": 0, "usec": 0, "commands": []})
        f["calls"] += calls
        f["usec"] += usec
        f["commands"].append(name)
    per = max(1, replicas) * wall
    for f in fams.values():
        f["calls_per_replica_per_s"] = f["calls"] / per
        f["usec_per_replica_per_s"] = f["usec"] / per
    cycles = {f: next((cmds[m][0] for m in ms if m in cmds), 0) / CALLS_PER_CYCLE[f] / (shards if f in PER_SHARD else 1) / per
              for f, ms in CYCLE_MARKER.items()}
    raw = sum(node_cpu)
    if baseline is not None:
        node_cpu = [c - b * wall for c, b in zip(node_cpu, baseline["node_cores"])]
    cpu = sum(node_cpu)
    return {
        "wall_s": wall, "redis_cpu_s": cpu, "redis_cores": cpu / wall, "node_cores": [c / wall for c in node_cpu],
        "raw_cores": raw / wall,
        "node_calls_per_s": [sum(n.values()) / wall for n in node_cmds], "node_commands": node_cmds,
        "usec_sum": sum(u for _, u in cmds.values()),
        "commands": {k: {"calls": c, "usec": u, "usec_per_call": u / c} for k, (c, u) in sorted(cmds.items())},
        "families": fams, "cycles_per_replica_per_s": cycles,
        "calls_per_replica_per_s": sum(c for c, _ in cmds.values()) / per,
    }


def group_consumers(node, queue: str, shard: int = 0) -> int:
    """Consumers a shard's shared-stream group lists (what every reclaim scan of it walks)."""
    import redis

    from rollq.keys import GROUP, QueueKeys

    try:
        groups = node.xinfo_groups(QueueKeys(queue).shard(shard).jobs)
    except redis.ResponseError:
        return 0
    return sum(int(g["consumers"]) for g in groups if g["name"] in (GROUP, GROUP.encode()))


def shard_nodes(target, queue: str, k: int) -> list[int]:
    """The node (index into ``target.nodes``; 0 for a single server) of each shard's keys."""
    if not hasattr(target, "nodes"):
        return [0] * k
    from redis.crc import key_slot

    from rollq.keys import QueueKeys

    return [target.node_of_slot(key_slot(part.jobs.encode())) for part in QueueKeys(queue).shards(k)]


def consumers_per_shard(nodes: list, queue: str, where: list[int]) -> list[int]:
    return [group_consumers(nodes[n], queue, i) for i, n in enumerate(where)]


def open_nodes(target) -> list:
    import redis

    ports = [n.port for n in target.nodes] if hasattr(target, "nodes") else [target.port]
    return [redis.Redis(host="127.0.0.1", port=p, socket_timeout=30) for p in ports]


def wait_background(nodes: list, timeout: float = 30.0) -> None:
    """No AOF rewrite or RDB save is running (no fork inside a measured window)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not int(r.info("persistence").get("aof_rewrite_in_progress", 0)) for r in nodes):
            return
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------
# the producer (in the parent, on its own asyncio loop)
# ------------------------------------------------------------------------------------------
class Load:
    """A producer that submits at an offered rate and counts every result it receives."""

    def __init__(self, url: str, queue: str, shards: int = 1, producer_id: str = PRODUCER_ID):
        from rollq.producer.client import Producer
        from rollq.protocol import SamplingParams
        from rollq.settings import ProducerSettings

        self.p = Producer(url, queue, producer_id=producer_id, settings=ProducerSettings(shards=shard_setting(shards)))
        self.sp = SamplingParams(max_tokens=16)
        self.tokens = list(range(100, 150))  # 50 int32 token ids: a 200-byte prompt
        self.submitted: set[str] = set()
        self.seen: dict[str, int] = {}
        self.failed = 0
        self.errors: dict[str, int] = {}  # "type: message" of failed jobs -> count
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        await self.p.connect()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for res in self.p.results():
            self.seen[res.id] = self.seen.get(res.id, 0) + 1
            if res.error is not None:
                self.failed += 1
                why = f"{res.error.type}: {res.error.message[:80]}"
                self.errors[why] = self.errors.get(why, 0) + 1

    async def submit(self, n: int) -> int:
        specs = [{"prompt_token_ids": self.tokens, "sampling": self.sp} for _ in range(n)]
        handles = await self.p.submit_many(specs)
        self.submitted.update(h.id for h in handles)
        return len(handles)

    async def offer(self, rate: float | None, seconds: float) -> dict:
        """Submit at ``rate`` jobs/s (None: batches of 2,000 back to back) for ``seconds``."""
        t0 = time.monotonic()
        sent = 0
        ticks = 0
        while time.monotonic() - t0 < seconds and ticks < 100_000:
            ticks += 1
            if rate is None:
                sent += await self.submit(2000)
                await asyncio.sleep(0)
                continue
            due = int(rate * (time.monotonic() - t0 + TICK_S)) - sent
            if due > 0:
                sent += await self.submit(due)
            await asyncio.sleep(max(0.0, t0 + ticks * TICK_S - time.monotonic()))
        return {"offered_per_s": rate, "submitted": sent, "submit_s": time.monotonic() - t0}

    async def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.submitted <= self.seen.keys():
                return True
            await asyncio.sleep(0.1)
        return False

    def received(self) -> int:
        return len(self.seen)

    def check(self) -> dict:
        missing = self.submitted - self.seen.keys()
        reader = self.p._reader  # the producer's result-reader task: it must still be running
        died = reader is not None and reader.done() and not reader.cancelled() and reader.exception()
        return {
            "producer": self.p.id, "reader_died": repr(died) if died else None,
            "submitted": len(self.submitted), "results": len(self.seen), "missing": len(missing),
            "duplicate_results_seen": sum(1 for v in self.seen.values() if v > 1),
            "unknown_results": len(self.seen.keys() - self.submitted), "failed": self.failed,
            "errors": dict(sorted(self.errors.items(), key=lambda kv: -kv[1])[:5]),
            "producer_dropped_second_results": self.p.counters.get("duplicate_results", 0),
        }

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.p.close()


# ------------------------------------------------------------------------------------------
# one target: a server or a cluster
# ------------------------------------------------------------------------------------------
def left_in_result_streams(nodes: list, queue: str, where: list[int], producers: int) -> dict:
    """Entries still in each producer's result stream of each shard (results written but not
    read: a reader that fell behind or stopped), where any are left."""
    from rollq.keys import QueueKeys

    left = {}
    ids = [PRODUCER_ID] + [f"{PRODUCER_ID}-{i}" for i in range(1, producers)]
    for i, (part, n) in enumerate(zip(QueueKeys(queue).shards(len(where)), where)):
        for pid in ids:
            k = nodes[n].xlen(part.results(pid))
            if k:
                left[f"shard {i} / {pid}"] = k
    return left


async def ask_all(producers: list[Worker], line: str, timeout: float) -> list[dict]:
    """Send ``line`` to every producer child and read each one's answer (in threads)."""
    return list(await asyncio.gather(*(asyncio.to_thread(pr.ask, line, timeout) for pr in producers)))


def parse_rates(text: str) -> list[float | None]:
    return [None if r.strip() == "max" else float(r) for r in text.split(",") if r.strip()]


async def run_target(kind: str, args: argparse.Namespace) -> dict:
    from rollq.server import LocalCluster, RedisServer

    target = LocalCluster(masters=3) if kind == "cluster" else RedisServer()
    target.start()
    out: dict = {"target": kind, "replicas": args.replicas, "procs": args.procs, "url": target.url,
                 "shards": args.shards}
    workers: list[Worker] = []
    producers: list[Worker] = []  # producer children (--producers > 1), beside the parent's
    load = None
    try:
        nodes = open_nodes(target)
        out["redis_version"] = nodes[0].info("server")["redis_version"]
        load = Load(target.url, args.queue, args.shards)
        await load.start()
        producers += [Worker.producer(target.url, args.queue, i, args) for i in range(1, args.producers)]
        for pr in producers:
            if "ready" not in pr.next_json(60):
                raise RuntimeError(f"a producer child did not start: {''.join(pr.err)[-500:]}")
        where = out["shard_nodes"] = shard_nodes(target, args.queue, args.shards)
        if kind == "cluster":
            from redis.crc import key_slot

            from rollq.keys import QueueKeys

            slot = key_slot(QueueKeys(args.queue).jobs.encode())
            out["queue_slot"] = slot
            out["queue_node"] = target.node_of_slot(slot)
        log(f"{kind}: {args.shards} shard(s) on node(s) {where}")

        # 0. the bare server: what Redis spends with no client (serverCron, AOF), subtracted below.
        wait_background(nodes)
        s0 = snapshot(nodes)
        await asyncio.sleep(args.baseline)
        out["baseline"] = base = delta(s0, snapshot(nodes), 1)

        # 1. submit calibration: no replica is running, so this is the submit path alone.
        wait_background(nodes)
        s0 = snapshot(nodes)
        n_cal = await load.submit(args.calibrate_jobs)
        s1 = snapshot(nodes)
        d = delta(s0, s1, 1, base)
        out["submit_calibration"] = {"jobs": n_cal, "redis_cpu_us_per_job": 1e6 * d["redis_cpu_s"] / n_cal,
                                     "commands_per_job": {k: v["calls"] / n_cal for k, v in d["commands"].items()},
                                     "detail": d}
        log(f"{kind}: submit alone costs Redis {1e6 * d['redis_cpu_s'] / n_cal:.1f} us/job")

        # 2. the fleet
        per = [args.replicas // args.procs + (1 if i < args.replicas % args.procs else 0) for i in range(args.procs)]
        first = 0
        t0 = time.monotonic()
        for count in per:
            if count:
                workers.append(Worker.replicas(target.url, args.queue, first, count, args))
                first += count
        ready = [w.next_json(args.start_timeout) for w in workers]
        out["start"] = {"seconds": time.monotonic() - t0, "workers": ready}
        serving = sum(r.get("ready", 0) for r in ready)
        log(f"{kind}: {serving}/{args.replicas} replicas serving after {time.monotonic() - t0:.1f}s")
        if serving < args.replicas:
            raise RuntimeError(f"only {serving} of {args.replicas} replicas started: {ready}")
        # The calibration's jobs are consumed during start-up. Redis lists a consumer in the
        # group only once it has been delivered an entry, and the reclaim scan walks that list:
        # a warm-up trickle (each entry wakes the next blocked reader) gives every replica
        # jobs, as in a fleet that has been serving for a while.
        await load.wait_all(60)
        t_w = time.monotonic()
        await load.offer(max(200.0, args.replicas / 2), args.warmup)
        await load.wait_all(60)
        trickled = consumers_per_shard(nodes, args.queue, where)
        refused = 0
        if args.create_consumers:
            # The trickle reaches only some replicas on this starved machine: the rest are
            # entered in every shard's group as XREADGROUP would enter them on their first
            # delivery from it (every replica reads every shard).
            from rollq.keys import GROUP, QueueKeys

            for part, n in zip(QueueKeys(args.queue).shards(args.shards), where):
                pipe = nodes[n].pipeline(transaction=False)
                for i in range(args.replicas):
                    pipe.xgroup_createconsumer(part.jobs, GROUP, f"sim-{i:05d}")
                refused += sum(isinstance(r, Exception) for r in pipe.execute(raise_on_error=False))
        now_in = consumers_per_shard(nodes, args.queue, where)
        out["warmup"] = {"seconds": time.monotonic() - t_w, "group_consumers_after_trickle": max(trickled),
                         "group_consumers": max(now_in), "group_consumers_per_shard": now_in,
                         "created": args.create_consumers, "createconsumer_refused": refused}
        log(f"{kind}: warm-up {out['warmup']['seconds']:.1f}s: {trickled} consumers per shard group after the trickle, "
            f"{out['warmup']['group_consumers']} now")
        await asyncio.sleep(args.settle)

        # 3. idle
        wait_background(nodes)
        s0 = snapshot(nodes)
        await asyncio.sleep(args.idle)
        s1 = snapshot(nodes)
        out["idle"] = delta(s0, s1, args.replicas, base, args.shards)
        per_shard = consumers_per_shard(nodes, args.queue, where)
        out["idle"]["group_consumers"] = max(per_shard)  # the largest group a reclaim scan walks
        out["idle"]["group_consumers_per_shard"] = per_shard
        i = out["idle"]
        log(f"{kind}: idle {i['calls_per_replica_per_s']:.1f} commands/replica/s, Redis {i['redis_cores']:.2f} cores "
            f"(cycles/replica/s: " + ", ".join(f"{k} {v:.2f}" for k, v in i["cycles_per_replica_per_s"].items()) + ")")

        # 4. load at each offered rate
        out["load"] = []
        for rate in parse_rates(args.rates):
            wait_background(nodes)
            share = rate / args.producers if rate else None  # the offered rate, split over the producers
            # The children are asked from threads: the parent's loop keeps reading its results.
            r0 = load.received() + sum(r.get("received", 0) for r in await ask_all(producers, "received", 30))
            s0 = snapshot(nodes)
            for pr in producers:
                pr.send(f"offer {share or 'max'} {args.load_seconds}")
            sub = await load.offer(share, args.load_seconds)
            theirs = await asyncio.gather(*(asyncio.to_thread(pr.next_json, args.load_seconds + 60) for pr in producers))
            s1 = snapshot(nodes)
            r1 = load.received() + sum(t.get("received", 0) for t in theirs)
            d = delta(s0, s1, args.replicas, base, args.shards)
            sub["submitted"] += sum(t.get("submitted", 0) for t in theirs)
            sub["offered_per_s"] = rate
            d.update(sub)
            d["results_in_window"] = r1 - r0
            d["jobs_per_s"] = (r1 - r0) / d["wall_s"]
            d["submitted_per_s"] = sub["submitted"] / d["wall_s"]
            drained = await load.wait_all(args.drain_timeout)
            theirs = await ask_all(producers, f"wait {args.drain_timeout}", args.drain_timeout + 30)
            drained = all(t.get("drained") for t in theirs) and drained
            d["drained"] = drained
            out["load"].append(d)
            log(f"{kind}: offered {rate or 'max'}: submitted {d['submitted_per_s']:,.0f}/s, completed "
                f"{d['jobs_per_s']:,.0f} jobs/s, Redis {d['redis_cores']:.2f} cores (nodes "
                + ", ".join(f"{c:.2f}" for c in d["node_cores"]) + "; commands/s per node "
                + ", ".join(f"{c:,.0f}" for c in d["node_calls_per_s"]) + ")")
            if not drained:
                log(f"{kind}: not drained within {args.drain_timeout}s")
                break
            await asyncio.sleep(1.0)
        out["exactly_once"] = check = load.check()
        out["left_in_result_streams"] = left_in_result_streams(nodes, args.queue, where, args.producers)
        out["producer_checks"] = [dict(check)]
        for t in await ask_all(producers, "stop", 60):  # every producer's own results, summed
            out["producer_checks"].append(t.get("check"))
            for key, v in (t.get("check") or {"missing": -1}).items():
                if isinstance(v, int):
                    check[key] = check.get(key, 0) + v
        out["producers"] = 1 + len(producers)
        log(f"{kind}: results {out['exactly_once']}")
    finally:
        for pr in producers:
            pr.stop()
            pr.reap(30)
        out["producer_stderr"] = ["".join(pr.err)[-8000:] for pr in producers]
        for w in workers:
            w.stop()
        until = time.monotonic() + 120
        out["workers"] = [w.next_json(max(1.0, until - time.monotonic())) for w in workers]
        for w in workers:
            w.reap(30)
        if load is not None:
            await load.close()
        target.cleanup()
    return out


# ------------------------------------------------------------------------------------------
# figures from the measurements
# ------------------------------------------------------------------------------------------
def summarize(res: dict, budget_jobs_per_s: float = 100_000.0) -> dict:
    """The arithmetic of the report.

    - ``k`` = Redis CPU (``used_cpu``) / sum of command usec in the idle window: what the event
      loop, socket reads and writes and the AOF add to the commands' own time.
    - Idle cost of one replica at the nominal rates: for each family, its Redis usec per cycle
      (measured) times its nominal cycles per second, times ``k``, less the peer scan
      (:data:`SCAN`: one ``XINFO CONSUMERS`` listing every consumer and one ``EXISTS`` per
      other consumer), which is counted apart: ``scan_us_per_peer`` = its usec per scan /
      (N-1), times ``k``, and ``scans_per_turn`` = scans / reclaim turns, about 1 when every
      replica scans (rollq before the reclaimer role) and about 1/N when one elected replica
      does. The fleet's idle cost is ``N * fixed + S(N) * (N-1) * scan_us_per_peer`` with
      ``S(N)`` = N scanners per second (every replica scans: quadratic) or 1 (one scanner).
    - Redis CPU per job: the load window's ``used_cpu`` less the idle background scaled by the
      reclaim turns that ran in that window, over the jobs completed.
    - Largest fleet at ``budget_jobs_per_s`` on one core: the largest N whose idle cost fits in
      ``1 core - budget * cpu_per_job``, for both scan models (``every_replica_scans_*``,
      ``one_scanner_*``) and for the one measured here (``current_reclaim_*``).
    """
    n = res["replicas"]
    idle = res["idle"]
    k = idle["redis_cpu_s"] / max(1e-9, idle["usec_sum"] / 1e6)
    per = n * idle["wall_s"]
    fam_usec_cycle = {}
    for f, hz in NOMINAL_HZ.items():
        cyc = idle["cycles_per_replica_per_s"].get(f, 0.0)
        usec = idle["families"].get(f, {}).get("usec_per_replica_per_s", 0.0)
        fam_usec_cycle[f] = usec / cyc if cyc else 0.0
    turns = idle["cycles_per_replica_per_s"].get("reclaim", 0.0) * per
    scans = idle["commands"].get(SCAN[0], {}).get("calls", 0)
    scan_usec = sum(idle["commands"].get(c, {}).get("usec", 0) for c in SCAN)
    scans_per_turn = scans / turns if turns else 0.0
    scan_us_per_peer = k * scan_usec / scans / max(1, n - 1) if scans else 0.0
    # the reclaim turn less the scan: the role's GET and the own-entry check
    turn_usec = fam_usec_cycle["reclaim"] - (scan_usec / turns if turns else 0.0)
    fixed_us = k * (sum(fam_usec_cycle[f] * NOMINAL_HZ[f] for f in NOMINAL_HZ if f != "reclaim")
                    + turn_usec * NOMINAL_HZ["reclaim"])
    fixed_us += k * idle["families"].get("other", {}).get("usec_per_replica_per_s", 0.0)
    every_scans = scans_per_turn > 0.5  # what this run measured: every replica scans, or one

    def idle_us(replicas: int, every: bool) -> float:
        """Redis usec per second of an idle fleet of ``replicas``."""
        scanners = replicas if every else 1
        return replicas * fixed_us + scanners * NOMINAL_HZ["reclaim"] * max(0, replicas - 1) * scan_us_per_peer

    idle_cycles_reclaim = idle["cycles_per_replica_per_s"].get("reclaim", 0.0)
    loads = []
    for d in res.get("load", []):
        jobs = d["results_in_window"]
        scale = d["cycles_per_replica_per_s"].get("reclaim", 0.0) / idle_cycles_reclaim if idle_cycles_reclaim else 1.0
        background = idle["redis_cores"] * scale * d["wall_s"]
        cpu_job = (d["redis_cpu_s"] - background) / jobs if jobs else None
        loads.append({
            "offered_per_s": d["offered_per_s"], "submitted_per_s": d["submitted_per_s"], "jobs_per_s": d["jobs_per_s"],
            "redis_cores": d["redis_cores"], "node_cores": d["node_cores"], "node_calls_per_s": d["node_calls_per_s"],
            "reclaim_cycles_vs_idle": scale,
            "redis_cpu_us_per_job": 1e6 * cpu_job if cpu_job is not None else None,
            "jobs_per_replica_per_s": d["jobs_per_s"] / n,
            "commands_per_replica_per_s": d["calls_per_replica_per_s"],
            "families_calls_per_replica_per_s": {f: v["calls_per_replica_per_s"] for f, v in d["families"].items()},
        })
    # Per-job cost used for the extrapolation: the lowest measured at the highest rate (more
    # jobs per read and per FINISH call), and as a bracket the worst.
    costs = [x["redis_cpu_us_per_job"] for x in loads if x["redis_cpu_us_per_job"] and x["jobs_per_s"] > 100]
    best = min(costs) if costs else None
    worst = max(costs) if costs else None

    def fleet(cpu_job_us: float | None, every: bool) -> dict:
        if cpu_job_us is None:
            return {}
        left = 1e6 - budget_jobs_per_s * cpu_job_us  # usec of one core per second left for idle work
        out = {"left_us_per_s": left, "max_jobs_per_s_one_core": 1e6 / cpu_job_us if cpu_job_us else None}
        if left <= 0:
            return {**out, "max_replicas": 0}
        a = NOMINAL_HZ["reclaim"] * scan_us_per_peer
        if every and a > 0:  # a * N^2 + (fixed - a) * N - left = 0
            b = fixed_us - a
            nmax = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
        else:  # N * fixed + (N-1) * a = left
            nmax = (left + a) / (fixed_us + a)
        return {**out, "max_replicas": int(nmax)}

    def per_node(load: dict | None) -> dict:
        """Largest fleet at ``budget_jobs_per_s`` when each Redis node has a core of its own
        (a sharded queue on a cluster: each master serves its shards' part of the jobs):
        per node, its measured Redis us per job of the whole queue (its share of the work) and
        its measured idle us per replica; the fleet is bounded by the node that fills first."""
        if not load or not load["jobs_per_s"]:
            return {}
        nodes = []
        for busy, quiet in zip(load["node_cores"], idle["node_cores"]):
            us_job = 1e6 * max(0.0, busy - quiet) / load["jobs_per_s"]
            us_replica = 1e6 * quiet / n
            left = 1e6 - budget_jobs_per_s * us_job
            nodes.append({"us_per_job": us_job, "idle_us_per_replica": us_replica,
                          "max_jobs_per_s": 1e6 / us_job if us_job else None,
                          "max_replicas": (int(left / us_replica) if us_replica else None) if left > 0 else 0})
        caps = [x["max_replicas"] for x in nodes if x["max_replicas"] is not None]
        rates = [x["max_jobs_per_s"] for x in nodes if x["max_jobs_per_s"]]
        return {"nodes": nodes, "max_replicas": min(caps) if caps else None,
                "max_jobs_per_s": min(rates) if rates else None}

    fastest = max(loads, key=lambda x: x["jobs_per_s"]) if loads else None
    return {
        "replicas": n, "k_cpu_over_usec": k,
        # each node its own core, from the fastest load window (see per_node)
        "per_node_at_budget": per_node(fastest),
        "idle_measured": {
            "commands_per_replica_per_s": idle["calls_per_replica_per_s"],
            "redis_cores": idle["redis_cores"], "redis_us_per_replica_per_s": 1e6 * idle["redis_cores"] / n,
            "node_cores": idle["node_cores"], "node_calls_per_s": idle["node_calls_per_s"],
            "cycles_per_replica_per_s": idle["cycles_per_replica_per_s"],
            "families_calls_per_replica_per_s": {f: v["calls_per_replica_per_s"] for f, v in idle["families"].items()},
            "scans_per_turn": scans_per_turn,
        },
        "idle_nominal": {
            "usec_per_cycle": fam_usec_cycle, "nominal_hz": NOMINAL_HZ,
            "every_replica_scans": every_scans, "scans_per_turn": scans_per_turn,
            "fixed_us_per_replica_per_s": fixed_us, "scan_us_per_peer": scan_us_per_peer,
            "us_per_replica_per_s_at_this_n": idle_us(n, every_scans) / n,
            "fleet_cores_at_this_n": idle_us(n, every_scans) / 1e6,
            "fleet_cores_at_1000": {"every_replica_scans": idle_us(1000, True) / 1e6, "one_scanner": idle_us(1000, False) / 1e6},
            "commands_per_replica_per_s": sum(
                idle["families"].get(f, {}).get("calls_per_replica_per_s", 0.0)
                / max(1e-9, idle["cycles_per_replica_per_s"].get(f, 0.0)) * NOMINAL_HZ[f]
                for f in NOMINAL_HZ if idle["cycles_per_replica_per_s"].get(f, 0.0)
            ),
        },
        "load": loads,
        "cpu_per_job_us": {"best": best, "worst": worst, "submit_alone": res["submit_calibration"]["redis_cpu_us_per_job"]},
        "fleet_at_budget": {
            "budget_jobs_per_s": budget_jobs_per_s,
            "current_reclaim_best": fleet(best, every_scans), "current_reclaim_worst": fleet(worst, every_scans),
            "every_replica_scans_best": fleet(best, True), "every_replica_scans_worst": fleet(worst, True),
            "one_scanner_best": fleet(best, False), "one_scanner_worst": fleet(worst, False),
        },
        # no jobs at all: how many idle replicas one core holds
        "idle_fleet_one_core": {"every_replica_scans": fleet(0.0, True).get("max_replicas"),
                                "one_scanner": fleet(0.0, False).get("max_replicas")},
        "exactly_once": res.get("exactly_once"),
    }


def fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:,.{nd}f}" if isinstance(x, float) else f"{x:,}"


def per_node_lines(s: dict, budget: float) -> list[str]:
    """The per-node reading of the fastest load window (``summarize``'s ``per_node``)."""
    pn = s.get("per_node_at_budget") or {}
    if not pn.get("nodes"):
        return []
    cells = "; ".join(f"node {i}: {fmt(x['us_per_job'], 1)} us/job, {fmt(x['idle_us_per_replica'], 1)} us/replica/s idle"
                      for i, x in enumerate(pn["nodes"]))
    return [f"- each Redis node a core of its own (fastest window): {cells}; the busiest node saturates at "
            f"{fmt(pn['max_jobs_per_s'], 0)} jobs/s of the whole queue, and at {budget:,.0f} jobs/s holds "
            f"{fmt(pn['max_replicas'], 0)} replicas"]


def node_table(res: dict, s: dict) -> list[str]:
    """Per Redis node (per master of the cluster): CPU and commands of every window, and which
    shards of the queue it holds: where the load went."""
    where = res.get("shard_nodes") or [res.get("queue_node", 0)]
    nodes = len(s["idle_measured"]["node_cores"])
    held = {n: [str(i) for i, m in enumerate(where) if m == n] for n in range(nodes)}
    head = " | ".join(f"node {n} (shards {', '.join(held[n]) or '-'})" for n in range(nodes))
    lines = ["", "### Per Redis node: cores · commands/s", "", f"| window | {head} |",
             "| --- |" + " ---: |" * nodes]
    windows = [("idle", s["idle_measured"])] + [
        (f"load {fmt(x['offered_per_s'], 0) if x['offered_per_s'] else 'max'}", x) for x in s["load"]]
    for name, w in windows:
        cells = [f"{fmt(c, 2)} · {fmt(k, 0)}" for c, k in zip(w["node_cores"], w["node_calls_per_s"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown(all_res: dict) -> str:
    lines = ["# Fleet simulation (issue 16)", "", f"`{all_res['command']}`", "",
             f"{all_res['env']['cpus']} CPU cores shared by the generator and Redis; {all_res['env']['python']}; "
             f"Redis {all_res['targets'][0].get('redis_version', '?') if all_res['targets'] else '?'}.", ""]
    for res in all_res["targets"]:
        s = res.get("summary")
        lines += [f"## {res['target']}: {res['replicas']} replicas in {res['procs']} processes"
                  + (f", {res['shards']} shards" if res.get("shards", 1) > 1 else ""), ""]
        if not s:
            lines += [f"failed: {res.get('error', '?')}", ""]
            continue
        im, nom = s["idle_measured"], s["idle_nominal"]
        lines += [
            "### Idle (no jobs)", "",
            "| family | commands/replica/s measured | cycles/replica/s measured | nominal cycles/s | Redis usec per cycle |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for f in NOMINAL_HZ:
            lines.append(f"| {f} | {fmt(im['families_calls_per_replica_per_s'].get(f, 0.0), 2)} | "
                         f"{fmt(im['cycles_per_replica_per_s'].get(f, 0.0), 2)} | {NOMINAL_HZ[f]} | {fmt(nom['usec_per_cycle'][f], 1)} |")
        lines += [
            "",
            f"- measured: {fmt(im['commands_per_replica_per_s'], 1)} commands/replica/s, Redis {fmt(im['redis_cores'], 2)} cores "
            f"({fmt(im['redis_us_per_replica_per_s'], 1)} us per replica per s)",
            f"- at the nominal rates: {fmt(nom['commands_per_replica_per_s'], 1)} commands/replica/s, "
            f"{fmt(nom['us_per_replica_per_s_at_this_n'], 1)} us of Redis CPU per replica per s = "
            f"{fmt(nom['fixed_us_per_replica_per_s'], 1)} fixed + the peer scan, {fmt(nom['scan_us_per_peer'], 3)} us per other replica "
            f"per scan, {fmt(nom['scans_per_turn'], 3)} scans per reclaim turn "
            f"({'every replica scans' if nom['every_replica_scans'] else 'one elected replica scans'}); "
            f"the fleet: {fmt(nom['fleet_cores_at_this_n'], 2)} cores (k = used_cpu / command usec = {fmt(s['k_cpu_over_usec'], 2)})",
            f"- 1,000 idle replicas at these costs: {fmt(nom['fleet_cores_at_1000']['every_replica_scans'], 2)} cores if every "
            f"replica scans, {fmt(nom['fleet_cores_at_1000']['one_scanner'], 3)} with one scanner; the most idle replicas one "
            f"core holds: {s['idle_fleet_one_core']['every_replica_scans']:,} / {s['idle_fleet_one_core']['one_scanner']:,}",
            "",
            "### Under load", "",
            "| offered jobs/s | submitted/s | completed jobs/s | jobs/replica/s | Redis cores (per node) | Redis us/job | commands/replica/s |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for x in s["load"]:
            lines.append(f"| {fmt(x['offered_per_s'], 0) if x['offered_per_s'] else 'max'} | {fmt(x['submitted_per_s'], 0)} | "
                         f"{fmt(x['jobs_per_s'], 0)} | {fmt(x['jobs_per_replica_per_s'], 2)} | "
                         f"{fmt(x['redis_cores'], 2)} ({', '.join(fmt(c, 2) for c in x['node_cores'])}) | "
                         f"{fmt(x['redis_cpu_us_per_job'], 1)} | {fmt(x['commands_per_replica_per_s'], 1)} |")
        c, fb = s["cpu_per_job_us"], s["fleet_at_budget"]
        lines += [
            "",
            f"- Redis CPU per job: {fmt(c['best'], 1)}-{fmt(c['worst'], 1)} us (submit alone: {fmt(c['submit_alone'], 1)} us); "
            f"one core saturates at {fmt(fb['current_reclaim_best'].get('max_jobs_per_s_one_core'), 0)} jobs/s with no idle fleet",
            f"- largest fleet one core serves at {fb['budget_jobs_per_s']:,.0f} jobs/s, reclaim as measured here: "
            f"{fb['current_reclaim_best'].get('max_replicas', '-')} (best per-job cost) / {fb['current_reclaim_worst'].get('max_replicas', '-')} (worst)",
            f"- the same if every replica scans: {fb['every_replica_scans_best'].get('max_replicas', '-')} / "
            f"{fb['every_replica_scans_worst'].get('max_replicas', '-')}; with one scanner: "
            f"{fb['one_scanner_best'].get('max_replicas', '-')} / {fb['one_scanner_worst'].get('max_replicas', '-')}",
            *per_node_lines(s, fb["budget_jobs_per_s"]),
            f"- exactly once: {s['exactly_once']}",
            f"- start-up {fmt(res['start']['seconds'], 0)} s; jobs the replicas reclaimed from each other (leases that lapsed "
            f"while this machine starved the generator): {sum(w.get('reclaimed', 0) for w in res['workers'])}; "
            f"workers that reported at stop: {sum(1 for w in res['workers'] if w.get('done'))}/{len(res['workers'])}",
            *node_table(res, s),
            "",
        ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode")
    w = sub.add_parser("worker", help="(internal) run replicas until 'stop' on stdin")
    w.add_argument("--url", required=True)
    w.add_argument("--queue", default=QUEUE)
    w.add_argument("--first", type=int, default=0)
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--wave", type=int, default=50)
    w.add_argument("--max-seconds", type=float, default=900.0)
    w.add_argument("--reconcile-interval", type=float, default=5.0)
    w.add_argument("--shards", type=int, default=1)
    pp = sub.add_parser("producer", help="(internal) a producer driven by command lines on stdin")
    pp.add_argument("--url", required=True)
    pp.add_argument("--queue", default=QUEUE)
    pp.add_argument("--index", type=int, required=True)
    pp.add_argument("--shards", type=int, default=1)
    pp.add_argument("--max-seconds", type=float, default=900.0)
    ap.add_argument("--replicas", default="1000", help="replica count, or a comma list: each target runs at each")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--targets", default="single,cluster", help="comma list of single, cluster")
    ap.add_argument("--queue", default=QUEUE)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    ap.add_argument("--load-seconds", type=float, default=8.0, help="seconds per offered rate")
    ap.add_argument("--rates", default="1000,3000,max", help="offered jobs/s, comma list; 'max': as fast as possible")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after start-up before measuring")
    ap.add_argument("--calibrate-jobs", type=int, default=2000)
    ap.add_argument("--baseline", type=float, default=2.0, help="seconds of the bare-server window")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of the warm-up trickle")
    ap.add_argument("--no-create-consumers", dest="create_consumers", action="store_false",
                    help="do not enter every replica in the group after the warm-up (XGROUP CREATECONSUMER)")
    ap.add_argument("--wave", type=int, default=50, help="replicas a worker starts at a time")
    ap.add_argument("--reconcile-interval", type=float, default=5.0)
    ap.add_argument("--shards", type=int, default=1, metavar="K",
                    help="shards of the queue (producer and replicas get shards=K; 1: the settings' default)")
    ap.add_argument("--producers", type=int, default=1,
                    help="producers offering the load: the parent's and N-1 child processes (each its own results)")
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--worker-max-seconds", type=float, default=900.0)
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "fleet_sim"), help="path without suffix ('' : none)")
    return ap.parse_args(argv)


async def run_all(args: argparse.Namespace) -> dict:
    """Every target in turn; returns the report (``targets``: raw figures plus ``summary``)."""
    report = {
        "command": "python benchmarks/fleet_sim.py " + " ".join(sys.argv[1:]),
        "env": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "args": {k: v for k, v in vars(args).items() if k != "mode"}, "targets": [],
    }
    counts = [int(n) for n in str(args.replicas).split(",") if n.strip()]
    for n in counts:
        for kind in [t.strip() for t in args.targets.split(",") if t.strip()]:
            if kind not in ("single", "cluster"):
                raise ValueError(f"unknown target {kind!r}: use single or cluster")
            one = argparse.Namespace(**{**vars(args), "replicas": n, "procs": max(1, min(args.procs, n))})
            t0 = time.monotonic()
            try:
                res = await run_target(kind, one)
                res["summary"] = summarize(res)
            except (RuntimeError, OSError, KeyError, ValueError) as e:
                res = {"target": kind, "replicas": n, "procs": one.procs, "error": f"{type(e).__name__}: {e}"}
                log(f"{kind} failed: {res['error']}")
            res["seconds"] = time.monotonic() - t0
            log(f"{kind}, {n} replicas: {res['seconds']:.0f}s")
            report["targets"].append(res)
    return report


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: servers and workers stop


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    if args.mode == "producer":
        asyncio.run(producer_main(args))
        return 0
    if args.mode == "worker":
        res = asyncio.run(worker_main(args))
        _emit({"done": True, **res})
        return 0
    report = asyncio.run(run_all(args))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
        log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0 if all("error" not in t for t in report["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
