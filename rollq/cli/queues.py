"""``rollq status``, ``check``, ``dlq`` and ``queue``: looking at and administering queues."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..errors import BadQueueData, ShardCountMismatch
from ..settings import RedisSettings
from .common import common_options, err_console, every_queue_by_default, log, out, url_options


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


async def _status(a: argparse.Namespace) -> int:
    from ..connection import connect
    from ..keys import QueueKeys
    from ..registry import queues_in_use
    from ..status import queue_status

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
                        out({"queue": name, "ok": False, "error": str(e), "key": e.key, "field": e.field})
                    else:
                        from rich.console import Console
                        from rich.text import Text

                        Console().print(Text(f"queue {name}: unreadable: {e}", style="bold red"))
                    continue
                if a.json:
                    out(st.to_dict())
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
    from ..connection import connect
    from ..keys import QueueKeys

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
    from ..connection import connect
    from ..keys import QueueKeys
    from ..status import dlq_list, dlq_purge, dlq_requeue

    client = connect(RedisSettings.from_url(a.url))
    keys = QueueKeys(a.queue)
    try:
        if a.action == "list":
            items = await dlq_list(client, keys, a.count)
            if a.json:
                out([i.to_dict() for i in items])
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
            out({"requeued": n, "skipped": skipped}) if a.json else print(f"requeued {n}, skipped {skipped} (not valid jobs)")
        else:
            n = await dlq_purge(client, keys)
            out({"purged": n}) if a.json else print(f"purged {n}")
        return 0
    finally:
        await client.aclose()


def cmd_dlq(a: argparse.Namespace) -> int:
    return asyncio.run(_dlq(a))


async def _queue(a: argparse.Namespace) -> int:
    from ..connection import connect
    from ..keys import QueueKeys
    from ..registry import register_queue
    from ..shards import SHARDS_FIELD, declare_shards

    keys = QueueKeys(a.name)
    client = connect(RedisSettings.from_url(a.url))
    try:
        recorded = bool(await client.hexists(keys.config, SHARDS_FIELD))
        try:
            k = await declare_shards(client, keys, a.shards)
        except ShardCountMismatch as e:
            err_console().print(f"rollq queue create: {e}", markup=False, highlight=False, soft_wrap=True)
            return 1
        await register_queue(client, a.name)  # listed by `rollq status` and the dashboard from now on
        if a.json:
            out({"queue": a.name, "shards": k, "created": not recorded})
        else:
            print(f"queue {a.name}: {k} shard(s)" + (" (already recorded)" if recorded else " recorded"))
        return 0
    finally:
        await client.aclose()


def cmd_queue(a: argparse.Namespace) -> int:
    return asyncio.run(_queue(a))

def register(sub: Any) -> None:
    """Add status, check, dlq, queue to the ``rollq`` subcommands."""
    s = sub.add_parser("status", help="queue depth, in flight, replicas")
    common_options(s)
    every_queue_by_default(s)
    s.add_argument("--json", action="store_true", help="one JSON object per queue and line")
    s.add_argument("--watch", type=float, default=0.0, help="refresh every N seconds")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("check", help="liveness probe: exit 0 if the replica's lease is live")
    common_options(s)
    s.add_argument("--id", required=True)
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("dlq", help="dead-letter stream: list, requeue, purge")
    s.add_argument("action", choices=["list", "requeue", "purge"])
    common_options(s)
    s.add_argument("--json", action="store_true")
    s.add_argument("--count", type=int, default=100)
    s.add_argument("ids", nargs="*", help="requeue: entries as `dlq list` names them (SHARD/ENTRY in a sharded "
                   "queue; a plain entry id is looked up in every shard; default: all)")
    s.set_defaults(fn=cmd_dlq)

    s = sub.add_parser("queue", help="queue administration: create a sharded queue ahead of its clients")
    s.add_argument("action", choices=["create"])
    s.add_argument("name", help="queue name")
    url_options(s)
    s.add_argument("--shards", type=int, required=True, metavar="K",
                   help="shards of the queue (rollq/shards.py); refused if the queue records another count")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_queue)
