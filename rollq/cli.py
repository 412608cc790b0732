"""The ``rollq`` command line.

    rollq redis [--cluster N]                    embedded redis-server (or N-master cluster); prints its URL
    rollq consume --engine echo|vllm ...         run one replica
    rollq submit FILE.jsonl [--wait]             submit jobs (one JSON object per line)
    rollq status [--json] [--watch S]            queue depth, in flight, replicas (every queue in use)
    rollq dlq list|requeue|purge [--json]        dead letters (of every shard)
    rollq queue create NAME --shards K           record a queue's shard count before its clients start
    rollq check --id REPLICA                     liveness probe: exit 0 if its lease is live
    rollq dashboard [--port P]                   live web dashboard, JSON API, /metrics
    rollq top                                    live terminal view
    rollq demo [--task T] [--json]               an async GRPO run that learns (embedded Redis, vLLM, trainer)

``--url`` defaults to ``$ROLLQ_REDIS_URL``; ``--queue`` to ``default`` (``status``, ``dashboard``
and ``top``: every queue in use, from the registry producers and consumers keep).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from .connection import RETRYABLE
from .errors import BadQueueData, RedisAuthError, ShardCountMismatch
from .settings import DEFAULT_QUEUE, ENV_URL, ENV_URL_FILE, ConsumerSettings, RedisSettings, read_url_file

log = logging.getLogger("rollq.cli")


#: Longest log message the CLI prints; the rest is cut (messages carry untrusted job fields).
MAX_LOG_CHARS = 2000


class _CutLongMessages(logging.Filter):
    """Cut log messages to :data:`MAX_LOG_CHARS` before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if len(msg) > MAX_LOG_CHARS:
            from .protocol import cut

            record.msg, record.args = cut(msg, MAX_LOG_CHARS), None
        return True


def _setup_logging(level: str) -> None:
    from rich.highlighter import NullHighlighter
    from rich.logging import RichHandler

    # Log lines carry untrusted strings (job ids, error messages): no markup, and no
    # highlighting either (rich's highlighter took seconds on a 40,000-character id).
    handler = RichHandler(console=_err_console(), show_path=False, rich_tracebacks=True, markup=False,
                          highlighter=NullHighlighter())
    handler.addFilter(_CutLongMessages())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="%(name)s: %(message)s",
                        handlers=[handler])


def _err_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _common(p: argparse.ArgumentParser) -> None:
    _url_options(p)
    p.add_argument("--queue", "-q", default=DEFAULT_QUEUE, help="queue name (default: %(default)s)")


def _url_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"Redis URL (default: ${ENV_URL} or redis://127.0.0.1:6379/0; "
                   "a password given here shows in ps: use --url-file or the environment)")
    p.add_argument("--url-file", default=None, metavar="PATH",
                   help=f"read the Redis URL from the first line of PATH (also ${ENV_URL_FILE})")


def _out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------------------
# rollq redis
# --------------------------------------------------------------------------------------
def cmd_redis(a: argparse.Namespace) -> int:
    import signal

    from .server import LocalCluster, RedisServer

    def _interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the server(s) as Ctrl-C does

    signal.signal(signal.SIGTERM, _interrupt)
    if a.cluster:
        if a.port or a.dir:
            log.error("--cluster picks its own ports and a temporary directory: drop --port/--dir")
            return 2
        cluster = LocalCluster(masters=a.cluster).start()
        _out({"url": cluster.url, "nodes": [n.url for n in cluster.nodes], "formed_with": cluster.formed_with}) if a.json else print(cluster.url, flush=True)
        try:
            while all(n.proc and n.proc.poll() is None for n in cluster.nodes):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.cleanup()
        return 0
    srv = RedisServer(port=a.port, data_dir=a.dir, appendfsync=a.appendfsync).start()
    _out({"url": srv.url, "pid": srv.proc.pid, "data_dir": srv.data_dir}) if a.json else print(srv.url, flush=True)
    try:
        while srv.proc and srv.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


# --------------------------------------------------------------------------------------
# rollq consume
# --------------------------------------------------------------------------------------
def make_engine(a: argparse.Namespace) -> Any:
    from .consumer.engine import EchoEngine

    if a.engine == "echo":
        return EchoEngine(delay_per_token=a.echo_delay_ms / 1000.0)
    from .consumer.vllm_engine import VllmEngine, VllmEngineConfig

    model = a.model
    if not model:
        from .testing.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model())
    return VllmEngine(
        VllmEngineConfig(
            model=model, tensor_parallel_size=a.tensor_parallel_size, dtype=a.dtype,
            max_model_len=a.max_model_len, gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=getattr(a, "enforce_eager", None),
            kv_cache_memory_bytes=a.kv_cache_memory_bytes,
            # Following weight versions needs rollq's worker extension inside vLLM's workers.
            worker_extension_cls=a.worker_extension
            or ("rollq.weightsync.worker_ext.RollqWorkerExtension" if (a.weights_root or a.broadcast) else None),
        )
    )


def consumer_settings(a: argparse.Namespace) -> ConsumerSettings:
    return ConsumerSettings(
        max_inflight=a.max_inflight, initial_inflight=a.initial_inflight,
        batch=a.batch, lease_ttl=a.lease_ttl, heartbeat_interval=min(1.0, a.lease_ttl / 4),
        max_deliveries=a.max_deliveries, drain_timeout=a.drain_timeout, shards=a.shards,
    )


async def _consume(a: argparse.Namespace) -> int:
    from .consumer.loop import Consumer

    engine = make_engine(a)
    await engine.start()
    consumer = Consumer(engine, a.url, a.queue, consumer_id=a.id, settings=consumer_settings(a))
    sync = None
    if a.weights_root or a.broadcast:
        from .weightsync.follower import WeightFollower

        sync = WeightFollower(consumer, root=a.weights_root, broadcast=a.broadcast, swap_overlap=a.swap_overlap)
        await sync.start()
    try:
        return await consumer.run(burst=a.burst, install_signal_handlers=True)
    finally:
        if sync is not None:
            await sync.stop()
        await engine.stop()


def cmd_consume(a: argparse.Namespace) -> int:
    return asyncio.run(_consume(a))


# --------------------------------------------------------------------------------------
# rollq submit
# --------------------------------------------------------------------------------------
def _read_specs(path: str) -> list[dict[str, Any]]:
    from .errors import InvalidJob

    try:
        fh = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise InvalidJob(f"cannot read {path}: {e.strerror}") from e
    specs = []
    try:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise InvalidJob(f"line {n}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidJob(f"line {n}: not JSON: {e}") from None
            except RecursionError:
                raise InvalidJob(f"line {n}: JSON nested too deep") from None
            if not isinstance(obj, dict):
                raise InvalidJob(f"line {n}: expected a JSON object")
            specs.append(obj)
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()
    if not specs:
        raise InvalidJob(f"{path}: no jobs (one JSON object per line)")
    return specs


def result_to_json(r: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"id": r.id, "policy_version": [r.version_start, r.version_end], "replica": r.replica}
    if r.error is not None:
        d["error"] = {"type": r.error.type, "message": r.error.message}
    else:
        d["outputs"] = [
            {"token_ids": s.token_ids, "text": s.text, "finish_reason": s.finish_reason,
             **({"logprobs": s.token_logprobs} if s.logprobs is not None else {})}
            for s in r.samples
        ]
    d["timings"] = {"submitted": r.submitted, "started": r.started, "finished": r.finished}
    if r.meta is not None:
        d["meta"] = r.meta
    return d


async def _submit(a: argparse.Namespace) -> int:
    from rich.progress import Progress

    from .producer.client import Producer
    from .settings import ProducerSettings

    specs = _read_specs(a.file)
    p = Producer(a.url, a.queue, settings=ProducerSettings(shards=a.shards))
    jobs = [p.build_job(s) for s in specs]  # validate everything before connecting or sending
    async with p:
        handles = await p.submit_many(jobs)
        if not a.wait:
            for h in handles:
                _out({"id": h.id, "duplicate": h.duplicate})
            return 0
        failed = 0
        with Progress(console=_err_console(), transient=False) as prog:
            task = prog.add_task(f"{a.queue}: results", total=len(handles))
            pending = {h.id for h in handles}
            async for r in p.results(timeout=a.timeout):
                if r.id not in pending:
                    continue
                pending.discard(r.id)
                failed += r.error is not None
                _out(result_to_json(r))
                prog.advance(task)
                if not pending:
                    break
        if pending:
            log.error("%d jobs got no result within %.0fs", len(pending), a.timeout)
            return 2
        return 1 if failed else 0


def cmd_submit(a: argparse.Namespace) -> int:
    from .errors import InvalidJob

    try:
        return asyncio.run(_submit(a))
    except InvalidJob as e:
        _err_console().print(f"rollq submit: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2


# --------------------------------------------------------------------------------------
# rollq status / check / dlq
# --------------------------------------------------------------------------------------
def render_status(st: Any) -> Any:
    from rich.console import Group
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:g} ms"

    t = Table(title=f"queue {st.queue}", show_header=False)
    for k, v in [
        ("waiting", st.depth), ("in flight", st.in_flight),
        ("oldest waiting", "-" if st.oldest_waiting_s is None else f"{st.oldest_waiting_s:.1f} s"),
        ("submitted", st.submitted), ("completed", st.completed), ("failed", st.failed),
        ("dead-lettered", f"{st.dead_lettered} ({st.dlq_length} in DLQ)"),
        ("latency p50 / p99", f"{ms(st.latency_p50_ms)} / {ms(st.latency_p99_ms)}"),
        ("policy version", "-" if st.version is None else st.version),
    ]:
        t.add_row(k, str(v))
    if st.shards > 1:  # the figures above are sums over the shards; each one's shows an imbalance
        t.add_row("shards", str(st.shards))
        t.add_row("waiting per shard", " ".join(str(n) for n in st.shard_depth))
        t.add_row("in flight per shard", " ".join(str(n) for n in st.shard_in_flight))
    r = Table(title="replicas")
    for col in ("id", "state", "alive", "heartbeat", "version", "in flight / cap", "kv", "tok/s", "done", "model"):
        r.add_column(col)
    for rep in st.replicas:
        i = rep.info
        r.add_row(
            rep.id, i["state"], "yes" if rep.alive else "NO", f"{rep.heartbeat_age_s:.1f}s ago", str(i["version"]),
            f"{i['inflight']}/{i['cap']}", "-" if i["kv_usage"] is None else f"{i['kv_usage']:.0%}",
            f"{i['tokens_per_s']:.0f}", str(i["completed"]), i["model"][-40:],
        )
    return Group(t, r)


def _every_queue_by_default(p: argparse.ArgumentParser) -> None:
    """``--queue`` of ``p`` defaults to every queue in use (rollq/registry.py)."""
    for action in p._actions:
        if action.dest == "queue":
            action.default = None
            action.help = "queue name (default: every queue in use)"


async def _status(a: argparse.Namespace) -> int:
    from .connection import connect
    from .keys import QueueKeys
    from .registry import queues_in_use
    from .status import queue_status

    client = connect(RedisSettings.from_url(a.url))
    try:
        while True:
            # no --queue: every queue in use, one JSON line (or table) each, sorted by name; a
            # queue holding a stray value is shown as unreadable (naming the key), the rest as usual
            bad = 0
            for name in [a.queue] if a.queue is not None else await queues_in_use(client):
                try:
                    st = await queue_status(client, QueueKeys(name))
                except BadQueueData as e:
                    bad += 1
                    if a.json:
                        _out({"queue": name, "ok": False, "error": str(e), "key": e.key, "field": e.field})
                    else:
                        from rich.console import Console
                        from rich.text import Text

                        Console().print(Text(f"queue {name}: unreadable: {e}", style="bold red"))
                    continue
                if a.json:
                    _out(st.to_dict())
                else:
                    from rich.console import Console

                    Console().print(render_status(st))
            if not a.watch:
                return 1 if bad else 0
            await asyncio.sleep(a.watch)
    finally:
        await client.aclose()


def cmd_status(a: argparse.Namespace) -> int:
    return asyncio.run(_status(a))


async def _check(a: argparse.Namespace) -> int:
    from .connection import connect
    from .keys import QueueKeys

    client = connect(RedisSettings.from_url(a.url), socket_timeout=3)
    try:
        return 0 if await client.exists(QueueKeys(a.queue).heartbeat(a.id)) else 1
    except Exception as e:
        log.error("check failed: %s", e)
        return 1
    finally:
        await client.aclose()


def cmd_check(a: argparse.Namespace) -> int:
    return asyncio.run(_check(a))


async def _dlq(a: argparse.Namespace) -> int:
    from .connection import connect
    from .keys import QueueKeys
    from .status import dlq_list, dlq_purge, dlq_requeue

    client = connect(RedisSettings.from_url(a.url))
    keys = QueueKeys(a.queue)
    try:
        if a.action == "list":
            items = await dlq_list(client, keys, a.count)
            if a.json:
                _out([i.to_dict() for i in items])
            else:
                from rich.console import Console
                from rich.table import Table
                from rich.text import Text

                t = Table(title=f"dead letters of {a.queue} (newest first; entries over "
                                "ConsumerSettings.dlq_payload_bytes are kept cut, and cannot be requeued)")
                for col in ("entry", "job", "error", "reason", "deliveries", "kept / entry bytes", "requeueable"):
                    t.add_column(col)
                for i in items:  # every field may be untrusted: Text, never markup
                    t.add_row(*(Text(str(v)) for v in (
                        i.ref, str(i.job_id)[:64], i.error_type[:40], i.reason[:80], i.deliveries,
                        f"{i.kept_bytes} / {i.payload_bytes}", "yes" if i.requeueable else "no")))
                Console().print(t)
        elif a.action == "requeue":
            n, skipped = await dlq_requeue(client, keys, a.ids or None)
            _out({"requeued": n, "skipped": skipped}) if a.json else print(f"requeued {n}, skipped {skipped} (not valid jobs)")
        else:
            n = await dlq_purge(client, keys)
            _out({"purged": n}) if a.json else print(f"purged {n}")
        return 0
    finally:
        await client.aclose()


def cmd_dlq(a: argparse.Namespace) -> int:
    return asyncio.run(_dlq(a))


async def _queue(a: argparse.Namespace) -> int:
    from .connection import connect
    from .keys import QueueKeys
    from .registry import register_queue
    from .shards import SHARDS_FIELD, declare_shards

    keys = QueueKeys(a.name)
    client = connect(RedisSettings.from_url(a.url))
    try:
        recorded = bool(await client.hexists(keys.config, SHARDS_FIELD))
        try:
            k = await declare_shards(client, keys, a.shards)
        except ShardCountMismatch as e:
            _err_console().print(f"rollq queue create: {e}", markup=False, highlight=False, soft_wrap=True)
            return 1
        await register_queue(client, a.name)  # listed by `rollq status` and the dashboard from now on
        if a.json:
            _out({"queue": a.name, "shards": k, "created": not recorded})
        else:
            print(f"queue {a.name}: {k} shard(s)" + (" (already recorded)" if recorded else " recorded"))
        return 0
    finally:
        await client.aclose()


def cmd_queue(a: argparse.Namespace) -> int:
    return asyncio.run(_queue(a))


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(a)


# --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its options, as one flat table (long because it lists them all)."""
    p = argparse.ArgumentParser(prog="rollq", description="Redis-Streams job queue feeding vLLM replicas")
    p.add_argument("--log-level", default=os.environ.get("ROLLQ_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("redis", help="run an embedded redis-server and print its URL")
    s.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    s.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    s.add_argument("--appendfsync", default="everysec", choices=["always", "everysec", "no"],
                   help="AOF fsync policy (default: %(default)s). always: nothing acknowledged is lost "
                        "even if the machine crashes, every write waits for the disk; everysec: a killed "
                        "redis-server loses nothing the kernel has, a machine crash up to ~2 s of writes; "
                        "no: a machine crash loses what the kernel had not flushed (~30 s). README: Durability")
    s.add_argument("--cluster", type=int, default=0, metavar="N",
                   help="a local Redis Cluster of N masters instead (prints its redis+cluster:// URL)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_redis)

    s = sub.add_parser("consume", help="run one replica")
    _common(s)
    s.add_argument("--engine", choices=["echo", "vllm"], default="echo")
    s.add_argument("--id", default=None, help="replica id (default: host-random)")
    s.add_argument("--echo-delay-ms", type=float, default=0.0, help="echo engine: delay per generated token")
    s.add_argument("--model", default=None, help="vllm: model path (default: the locally built tiny model)")
    s.add_argument("--tensor-parallel-size", type=int, default=1)
    s.add_argument("--dtype", default="auto",
                   help="vllm: dtype to serve the weights in (auto: float32 on CPU, the checkpoint's own on GPU; "
                        "naming one also accepts policy versions of a wider dtype, rounded to it)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--enforce-eager", action="store_true", default=None,
                   help="vllm: no torch.compile or CUDA graphs (starts faster, decodes slower; the default on CPU)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vllm: KV cache size in bytes (instead of a share of device memory)")
    s.add_argument("--worker-extension", default=None, help="vllm worker_extension_cls (weight sync)")
    s.add_argument("--weights-root", default=None, help="follow policy versions published under this memmap root")
    s.add_argument("--broadcast", action="store_true", help="also join the trainer's NCCL/gloo weight broadcasts")
    s.add_argument("--swap-overlap", action="store_true",
                   help="with --broadcast and the keep policy: swap a version in part by part while its last parts "
                        "arrive (shorter end to end, longer pause; see WeightFollower(swap_overlap=True))")
    d = ConsumerSettings()  # the defaults below are the settings' own
    s.add_argument("--max-inflight", type=int, default=d.max_inflight, help="cap on running jobs (default: from the engine)")
    s.add_argument("--initial-inflight", type=int, default=d.initial_inflight)
    s.add_argument("--batch", type=int, default=d.batch, help="most jobs taken in one read (default: %(default)s)")
    s.add_argument("--lease-ttl", type=float, default=d.lease_ttl,
                   help="seconds before a silent replica's jobs are reclaimed (default: %(default)s)")
    s.add_argument("--max-deliveries", type=int, default=d.max_deliveries)
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="SIGTERM: seconds to finish running jobs (default: %(default)s)")
    s.add_argument("--burst", action="store_true", help="drain the queue, then exit")
    s.add_argument("--shards", type=int, default=None,
                   help="the queue's shard count (default: follow its record; see `rollq queue create`)")
    s.set_defaults(fn=cmd_consume)

    s = sub.add_parser("submit", help="submit jobs from a JSONL file ('-': stdin)")
    _common(s)
    s.add_argument("file")
    s.add_argument("--wait", action="store_true", help="print one JSON line per result")
    s.add_argument("--timeout", type=float, default=600.0, help="--wait: give up after this many idle seconds")
    s.add_argument("--shards", type=int, default=None,
                   help="the queue's shard count (default: follow its record; see `rollq queue create`)")
    s.set_defaults(fn=cmd_submit)

    s = sub.add_parser("status", help="queue depth, in flight, replicas")
    _common(s)
    _every_queue_by_default(s)
    s.add_argument("--json", action="store_true", help="one JSON object per queue and line")
    s.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("check", help="liveness probe: exit 0 if the replica's lease is live")
    _common(s)
    s.add_argument("--id", required=True)
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("dlq", help="dead-letter stream: list, requeue, purge")
    s.add_argument("action", choices=["list", "requeue", "purge"])
    _common(s)
    s.add_argument("--json", action="store_true")
    s.add_argument("--count", type=int, default=100)
    s.add_argument("ids", nargs="*", help="requeue: entries as `dlq list` names them (SHARD/ENTRY in a sharded "
                   "queue; a plain entry id is looked up in every shard; default: all)")
    s.set_defaults(fn=cmd_dlq)

    s = sub.add_parser("queue", help="queue administration: create a sharded queue ahead of its clients")
    s.add_argument("action", choices=["create"])
    s.add_argument("name", help="queue name")
    _url_options(s)
    s.add_argument("--shards", type=int, required=True, metavar="K",
                   help="shards of the queue (rollq/shards.py); refused if the queue records another count")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_queue)

    s = sub.add_parser("demo", help="end-to-end demo: an async GRPO run through rollq (embedded Redis, vLLM replicas, trainer)")
    s.add_argument("--engine", choices=["echo", "vllm"], default="vllm",
                   help="vllm: train the tiny model; echo: queue only (no weights, nothing trained)")
    s.add_argument("--task", choices=["bucket", "positional", "length"], default="bucket",
                   help="bucket: the quick run; positional, length: harder tasks (rollq/rl/tasks), each with its "
                        "own recipe (model, steps, groups, lr) for the options left out")
    s.add_argument("--replicas", type=int, default=2)
    s.add_argument("--steps", type=int, help="trainer steps (policy versions published; default: the task's, 40 for bucket)")
    s.add_argument("--groups", type=int, help="GRPO groups (jobs) per step (default: the task's, 16 for bucket)")
    s.add_argument("--group-size", type=int, help="samples per group (sampling n; default: the task's, 8 for bucket)")
    s.add_argument("--max-lag", type=int, default=1, help="staleness bound in policy versions")
    s.add_argument("--transport", choices=["memmap", "gloo", "nccl"], default="memmap",
                   help="weight sync: memmap files, or a gloo (CPU) / NCCL (GPU) broadcast")
    s.add_argument("--lr", type=float, help="Adam learning rate (default: the task's, 5e-3 for bucket)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--trainer-threads", type=int, default=1, help="CPU: torch threads of the trainer")
    s.add_argument("--dtype", default="auto",
                   help="the replicas' served dtype (auto: float32 on CPU, the checkpoint's own on GPU)")
    s.add_argument("--plot", default="rollq-demo.png", help="PNG of reward and policy lag (a .json beside it)")
    s.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    s.set_defaults(fn=cmd_demo)

    from .dashboard.cli import register

    register(sub)  # rollq dashboard, rollq top
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    _setup_logging(a.log_level)
    try:
        if getattr(a, "url_file", None) and not getattr(a, "url", None):
            a.url = read_url_file(a.url_file)
        return a.fn(a) or 0
    except KeyboardInterrupt:
        return 130
    except (RedisAuthError, ShardCountMismatch, ValueError) as e:  # a wrong password, an unreadable URL file,
        # --shards other than the queue's recorded count
        _err_console().print(f"rollq: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except RETRYABLE as e:  # commands that need Redis once (submit, status, dlq) and cannot reach it
        _err_console().print(f"rollq: cannot reach Redis: {e}", markup=False, highlight=False, soft_wrap=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
