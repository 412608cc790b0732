"""Load balance: rollq's pull vs TorchRL AsyncVLLM's routing strategies, same workload.

    python benchmarks/load_balance.py [--jobs 1000] [--out benchmarks/results/load_balance]

Workload: a batch of jobs submitted at once (an RL step), output lengths drawn from a
long-tailed (log-normal) distribution, chat-templated prompts (they share their first tokens),
replicas of unequal speed (two at full speed, two at half speed), each able to run ``B``
requests at once.

Two measurements, both reported:

1. **real**: a real redis-server and real rollq consumers driving echo engines (a per-token
   delay sets each replica's speed; the consumer's in-flight cap is ``B``). rollq: every
   replica pulls from the shared stream. TorchRL strategies: the router assigns each job to a
   replica at submission (random, round-robin, "requests" = fewest unfinished, "prefix-aware"
   = hash of the first 8 prompt tokens with the reference's overload check, which never fires
   because its exception is swallowed), and the job waits on that replica's own stream.
2. **simulation** (labelled as such): a discrete-event model with the same lengths, speeds and
   ``B``, for larger scales without waiting for them.

Makespan / ideal, where ideal = total tokens / total token capacity of all replicas.

With ``--burst`` it measures instead how a burst lands on idle replicas (an RL step's
generate() on a fleet with room for all of it): bursts of 64 jobs of 32-64 tokens on 2, 3
and 4 idle replicas of equal speed, each able to hold the whole burst (128 slots) and
compute-bound (:class:`SerialEchoEngine`: a fixed token rate shared by its requests, so a
replica given twice the jobs takes twice as long). Reports makespan / ideal (ideal: the
burst's tokens over the fleet's token rate) and each replica's share of each burst; with
``--before REV`` the same bursts also run on the ``rollq`` of git revision ``REV``.

    python benchmarks/load_balance.py --burst [--before de29751] [--out benchmarks/results/load_balance_burst]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollq import Consumer, ConsumerSettings, EchoEngine, Producer, RedisServer  # noqa: E402

STRATEGIES = ["rollq-pull", "random", "round-robin", "requests", "prefix-aware"]


def workload(n: int, seed: int, mean_tokens: int, max_tokens: int) -> list[int]:
    rng = random.Random(seed)
    mu = __import__("math").log(mean_tokens) - 0.5
    return [max(4, min(max_tokens, int(rng.lognormvariate(mu, 1.0)))) for _ in range(n)]


CHAT_PREFIX = [151644, 8948, 198, 2610, 525, 264, 10950, 17847]  # "<|im_start|>system\nYou are a ..."


def prompt_tokens(i: int) -> list[int]:
    return CHAT_PREFIX + [1000 + (i * 7919) % 30000 for _ in range(24)]


class Router:
    """TorchRL 0.11 LoadBalancer strategies, as the reference implements them."""

    def __init__(self, strategy: str, n: int, seed: int = 0):
        self.strategy, self.n = strategy, n
        self.rng = random.Random(seed)
        self.rr = 0
        self.unfinished = [0] * n

    def select(self, prompt: list[int]) -> int:
        if self.strategy == "random":
            return self.rng.randrange(self.n)
        if self.strategy == "round-robin":
            i = self.rr % self.n
            self.rr += 1
            return i
        if self.strategy == "requests":
            m = min(self.unfinished)
            return self.rng.choice([i for i, c in enumerate(self.unfinished) if c == m])
        if self.strategy == "prefix-aware":
            # hash(tuple(first 8 tokens)) % n; the overload check raises NameError inside a
            # try/except that returns False, so the preferred replica is always chosen.
            return hash(tuple(prompt[:8])) % self.n
        raise ValueError(self.strategy)


# ---------------------------------------------------------------------------------------
# simulation
# ---------------------------------------------------------------------------------------
def simulate(strategy: str, lengths: list[int], speeds: list[float], slots: int, token_s: float, seed: int = 0) -> dict:
    n = len(speeds)
    t_tok = [token_s / s for s in speeds]
    finish: list[float] = []
    if strategy == "rollq-pull":
        free = [(0.0, r) for r in range(n) for _ in range(slots)]
        heapq.heapify(free)
        for L in lengths:  # FIFO: the earliest free slot anywhere takes the next job
            t, r = heapq.heappop(free)
            done = t + L * t_tok[r]
            finish.append(done)
            heapq.heappush(free, (done, r))
    else:
        router = Router(strategy, n, seed)
        queues: list[list[int]] = [[] for _ in range(n)]
        for i, L in enumerate(lengths):
            r = router.select(prompt_tokens(i))
            router.unfinished[r] += 1
            queues[r].append(L)
        for r in range(n):
            free = [0.0] * slots
            for L in queues[r]:
                t = heapq.heappop(free)
                done = t + L * t_tok[r]
                finish.append(done)
                heapq.heappush(free, done)
    ideal = sum(lengths) / sum(slots / tt for tt in t_tok)
    finish.sort()
    return {"makespan_s": max(finish), "ideal_s": ideal, "ratio": max(finish) / ideal, "p99_s": finish[int(0.99 * (len(finish) - 1))]}


# ---------------------------------------------------------------------------------------
# real run
# ---------------------------------------------------------------------------------------
async def real_run(url: str, strategy: str, lengths: list[int], speeds: list[float], slots: int, token_s: float) -> dict:
    queue = f"lb-{strategy}-{os.getpid()}"
    n = len(speeds)
    settings = ConsumerSettings(max_inflight=slots, initial_inflight=slots, adaptive=False, batch=slots, block=0.05)
    consumers = [
        Consumer(EchoEngine(delay_per_token=token_s / s), url, queue, consumer_id=f"r{i}", settings=settings)
        for i, s in enumerate(speeds)
    ]
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    await asyncio.sleep(0.3)
    router = Router(strategy, n) if strategy != "rollq-pull" else None
    specs = []
    for i, L in enumerate(lengths):
        spec = {"prompt_token_ids": prompt_tokens(i), "sampling": {"max_tokens": L}}
        if router is not None:
            r = router.select(prompt_tokens(i))
            router.unfinished[r] += 1
            spec["replica"] = f"r{r}"
        specs.append(spec)
    async with Producer(url, queue) as p:
        t0 = time.perf_counter()
        await p.submit_many(specs)
        done = []
        async for res in p.results(timeout=120):
            done.append(time.perf_counter() - t0)
            if len(done) == len(lengths):
                break
    for c in consumers:
        c.stop()
    await asyncio.gather(*tasks)
    t_tok = [token_s / s for s in speeds]
    ideal = sum(lengths) / sum(slots / tt for tt in t_tok)
    done.sort()
    share = [c.counters.completed for c in consumers]
    return {"makespan_s": done[-1], "ideal_s": ideal, "ratio": done[-1] / ideal, "p99_s": done[int(0.99 * (len(done) - 1))], "jobs_per_replica": share}


# ---------------------------------------------------------------------------------------
# bursts on idle replicas
# ---------------------------------------------------------------------------------------
def serial_echo(pkg):
    """An echo engine of ``pkg`` whose replica generates ``1 / token_s`` tokens per second in
    all: its requests are served one after another (the same makespan as sharing the rate)."""

    class SerialEchoEngine(pkg.EchoEngine):
        def __init__(self, token_s: float) -> None:
            super().__init__(delay_per_token=token_s)
            self.token_s = token_s
            self.busy_until = 0.0

        def submit(self, request_id, job, done) -> None:
            now = asyncio.get_running_loop().time()
            self.busy_until = max(now, self.busy_until) + job.sampling.max_tokens * self.token_s
            self.delay_per_token = (self.busy_until - now) / job.sampling.max_tokens
            super().submit(request_id, job, done)

    return SerialEchoEngine


async def burst_run(pkg, url: str, n_replicas: int, bursts: list[list[int]], token_s: float, slots: int) -> dict:
    """Each burst in turn on ``n_replicas`` idle replicas of ``pkg``: makespan / ideal and the
    jobs each replica took."""
    queue = f"lbb-{n_replicas}-{os.getpid()}-{time.monotonic_ns()}"
    engine = serial_echo(pkg)
    settings = pkg.ConsumerSettings(max_inflight=slots, initial_inflight=slots, adaptive=False)
    consumers = [pkg.Consumer(engine(token_s), url, queue, consumer_id=f"r{i}", settings=settings) for i in range(n_replicas)]
    tasks = [asyncio.create_task(c.run()) for c in consumers]
    await asyncio.sleep(2.5)  # every replica has beaten (heartbeat 1 s) and blocks on a fresh read
    out = {"ratio": [], "jobs_per_replica": []}
    async with pkg.Producer(url, queue) as p:
        for lengths in bursts:
            t0 = time.perf_counter()
            hs = await p.submit_many([{"prompt_token_ids": prompt_tokens(i), "sampling": {"max_tokens": L}}
                                      for i, L in enumerate(lengths)])
            rs = await p.gather(hs, timeout=120)
            makespan = time.perf_counter() - t0
            assert all(r.ok for r in rs)
            ideal = sum(lengths) * token_s / n_replicas
            out["ratio"].append(round(makespan / ideal, 3))
            out["jobs_per_replica"].append([sum(1 for r in rs if r.replica == f"r{i}") for i in range(n_replicas)])
            await asyncio.sleep(1.5)  # the trainer's step between bursts; the replicas are idle again
    for c in consumers:
        c.stop()
    await asyncio.gather(*tasks)
    shares = [max(j) / sum(j) for j in out["jobs_per_replica"]]
    out["ratio_median"] = sorted(out["ratio"])[len(out["ratio"]) // 2]
    out["ratio_max"] = max(out["ratio"])
    out["largest_share_max"] = round(max(shares), 3)
    return out


def burst_main(a: argparse.Namespace) -> None:
    rng = random.Random(0)
    bursts = [[rng.randint(32, 64) for _ in range(a.burst_jobs)] for _ in range(a.bursts)]
    sides = {"after": __import__("rollq")}
    if a.before:
        from ab_revision import import_revision

        sides = {"before": import_revision(a.before), **sides}
    res: dict = {"params": {"burst_jobs": a.burst_jobs, "bursts": a.bursts, "token_ms": a.burst_token_ms,
                            "slots": a.burst_slots, "before": a.before, "replicas": a.replicas},
                 "command": "python benchmarks/load_balance.py " + " ".join(sys.argv[1:]), "runs": {}}
    with RedisServer() as srv:
        for n in a.replicas:
            for side, pkg in sides.items():
                r = asyncio.run(burst_run(pkg, srv.url, n, bursts, a.burst_token_ms / 1000, a.burst_slots))
                res["runs"][f"{side}/{n}"] = r
                print(f"{side} {n} replicas: makespan/ideal {r['ratio']} shares {r['jobs_per_replica']}", file=sys.stderr)
    res["env"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [
        f"Bursts of {a.burst_jobs} jobs (32-64 tokens each) on idle replicas, {a.bursts} bursts per fleet; each replica "
        f"holds {a.burst_slots} jobs and generates one token per {a.burst_token_ms} ms in all (compute-bound).",
        "", f"`{res['command']}`", "",
        "| rollq | replicas | makespan / ideal (median) | worst | largest share of a burst | jobs per replica, each burst |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, r in res["runs"].items():
        side, n = key.split("/")
        lines.append(f"| {side} | {n} | {r['ratio_median']:.3f} | {r['ratio_max']:.3f} | {r['largest_share_max']:.0%} | "
                     f"{' '.join('/'.join(map(str, j)) for j in r['jobs_per_replica'])} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4000)
    ap.add_argument("--slots", type=int, default=16, help="requests a replica runs at once (B)")
    ap.add_argument("--token-ms", type=float, default=1.0, help="ms per token at full speed")
    ap.add_argument("--mean-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sim-jobs", type=int, default=20000)
    ap.add_argument("--out", default=None, help="default benchmarks/results/load_balance (_burst with --burst)")
    ap.add_argument("--burst", action="store_true", help="the burst scenario (see the module doc) instead")
    ap.add_argument("--bursts", type=int, default=5, help="--burst: bursts per fleet size")
    ap.add_argument("--burst-jobs", type=int, default=64)
    ap.add_argument("--burst-slots", type=int, default=128)
    ap.add_argument("--burst-token-ms", type=float, default=2.0)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--before", default=None, help="--burst: also run the bursts on the rollq of this git revision")
    a = ap.parse_args()
    if a.burst:
        a.out = a.out or "benchmarks/results/load_balance_burst"
        burst_main(a)
        return
    a.out = a.out or "benchmarks/results/load_balance"
    speeds = [1.0, 1.0, 0.5, 0.5]
    lengths = workload(a.jobs, 0, a.mean_tokens, a.max_tokens)
    sim_lengths = workload(a.sim_jobs, 1, a.mean_tokens, a.max_tokens)
    res: dict = {"params": vars(a) | {"speeds": speeds, "total_tokens": sum(lengths)}, "real": {}, "simulation": {}}
    with RedisServer() as srv:
        for s in STRATEGIES:
            res["real"][s] = asyncio.run(real_run(srv.url, s, lengths, speeds, a.slots, a.token_ms / 1000))
            print(f"real {s:13s} {res['real'][s]['ratio']:.3f}", file=sys.stderr)
    for s in STRATEGIES:
        res["simulation"][s] = simulate(s, sim_lengths, speeds, a.slots, a.token_ms / 1000)
    res["env"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "at": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(res, indent=2))
    lines = [
        f"Load balance: {a.jobs} jobs (real) / {a.sim_jobs} (simulation), log-normal lengths (mean {a.mean_tokens}, "
        f"max {a.max_tokens} tokens), 4 replicas at speeds {speeds}, B={a.slots} concurrent each, {a.token_ms} ms/token at full speed.",
        "",
        "| strategy | real makespan / ideal | real p99 (s) | real jobs per replica | simulated makespan / ideal |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in STRATEGIES:
        r, m = res["real"][s], res["simulation"][s]
        lines.append(f"| {s} | {r['ratio']:.3f} | {r['p99_s']:.2f} | {r['jobs_per_replica']} | {m['ratio']:.3f} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
