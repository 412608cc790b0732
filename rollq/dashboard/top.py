"""``rollq top``: the dashboard's data as a live terminal view (rich).

It runs its own :class:`~rollq.dashboard.sampler.Sampler` (the same reads as the web
dashboard, once per second) and renders the same documents the JSON API serves.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .sampler import Sampler

_STATE_STYLE = {"serving": "green", "paused": "blue", "draining": "magenta", "starting": "magenta",
                "stale": "yellow", "dead": "bold red"}
_NONE = "-"


def _num(v: Any, fmt: str = "{:,.0f}") -> str:
    return _NONE if v is None else fmt.format(v)


def _rate(v: float | None) -> str:
    return _NONE if v is None else (f"{v:.1f}" if v < 10 else f"{v:,.0f}")


def _ms(v: float | None) -> str:
    """A latency quantile: a histogram bucket's upper bound, so "at most"."""
    return _NONE if v is None else "≤" + (f"{v / 1000:.1f}s" if v >= 1000 else f"{v:g}ms")


def _s(v: float | None) -> str:
    if v is None:
        return _NONE
    if v < 60:
        return f"{v:.1f}s"
    return f"{int(v // 60)}m{int(v % 60):02d}s"


def _table(title: str, columns: list[str], left: int) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1),
              pad_edge=False, expand=False)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right", no_wrap=True, overflow="ellipsis")
    return t


def render_top(docs: list[dict[str, Any]], now: float | None = None) -> Group:
    """One frame from dashboard documents (:meth:`Sampler.document`), one per queue."""
    now = time.time() if now is None else now
    many = len(docs) > 1
    qt = _table("queues", ["queue", "wait", "run", "oldest", "in/s", "out/s", "p50", "p99", "DLQ", "ver", "up"], 1)
    qt.caption = "wait: waiting · run: in flight · in/out: jobs/s · up: live/registered replicas"
    qt.caption_justify = "left"
    rt = _table("replicas", [*(["queue"] if many else []), "replica", "state", "ver", "run/cap", "kv", "tok/s",
                             "done", "beat", "update", "pause"], 3 if many else 2)
    st = _table("shards (queues of more than one)", ["queue", "shard", "wait", "run"], 1)
    vt = _table("recent versions", [*(["queue"] if many else []), "version", "published", "transport", "size",
                                    "trainer"], 6)
    notes = []
    for d in docs:
        name, smp = d["name"], d["sampler"]
        if smp["error"]:
            notes.append(Text(f"{name}: {smp['error']}", style="red"))
        if "queue" not in d:
            qt.add_row(Text(name, style="red"), *[_NONE] * 10)
            continue
        q, r, lat, v = d["queue"], d["rates"], d["latency"], d["versions"]
        live = sum(1 for x in d["replicas"] if x["lease"])
        qt.add_row(
            name, _num(q["waiting"]), _num(q["in_flight"]), _s(q["oldest_waiting_s"]),
            _rate(r["submitted_per_s"]), _rate(r["completed_per_s"]),
            _ms(lat["p50_ms"] if lat["p50_ms"] is not None else lat["all_time"]["p50_ms"]),
            _ms(lat["p99_ms"] if lat["p99_ms"] is not None else lat["all_time"]["p99_ms"]),
            Text(_num(q["dlq_length"]), style="red" if q["dlq_length"] else ""),
            _num(v["current"]), f"{live}/{len(d['replicas'])}",
        )
        if q.get("shards", 1) > 1:  # the figures above are sums: each shard's shows an imbalance
            for i, (w, f) in enumerate(zip(q["shard_waiting"], q["shard_in_flight"])):
                st.add_row(name if i == 0 else "", str(i), _num(w), _num(f))
        for x in d["replicas"]:
            rt.add_row(
                *([name] if many else []), x["id"], Text(x["state"], style=_STATE_STYLE.get(x["state"], "")),
                _num(x["version"]), f"{x['inflight']}/{x['cap']}",
                _NONE if x["kv_usage"] is None else f"{x['kv_usage']:.0%}", _num(x["tokens_per_s"]),
                _num(x["completed"]), _s(x["heartbeat_age_s"]), _s(x["last_update_s"]), _s(x["last_pause_s"]),
            )
        for rec in v["log"][:5]:
            size = rec.get("nbytes")
            published = rec.get("published_at")
            vt.add_row(
                *([name] if many else []), f"v{rec['version']}", f"{_s(now - published)} ago" if published else _NONE,
                rec.get("transport") or _NONE, _NONE if size is None else f"{size / 2**20:,.1f} MiB",
                rec.get("trainer") or _NONE,
            )
    sampled = [d["sampler"]["last_sample_at"] for d in docs if d["sampler"]["last_sample_at"]]
    head = Text(f"rollq top · {time.strftime('%H:%M:%S', time.localtime(now))}", style="bold")
    if sampled:
        head.append(f" · sampled {max(0.0, now - min(sampled)):.1f}s ago", style="dim")
    parts: list[Any] = [head, *notes, qt]
    if st.row_count:
        parts.append(st)
    parts.append(rt if rt.row_count else Text("no replica registered", style="dim"))
    if vt.row_count:
        parts.append(vt)
    return Group(*parts)


async def run_top(sampler: Sampler, *, once: bool = False, console: Any = None) -> list[dict[str, Any]]:
    """Sample and render every ``sampler.settings.interval`` seconds (one frame with ``once``).

    Returns the last documents shown.
    """
    from rich.console import Console
    from rich.live import Live

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped (or a test): a frame wide enough for every column
            console = Console(width=max(console.width, 160))
    await sampler.sample_all()
    docs = [sampler.document(q, history=False) for q in sampler.queues]
    if once:
        console.print(render_top(docs))
        return docs
    with Live(render_top(docs), console=console, auto_refresh=False, transient=False) as live:
        while True:
            await asyncio.sleep(sampler.settings.interval)
            await sampler.sample_all()
            docs = [sampler.document(q, history=False) for q in sampler.queues]
            live.update(render_top(docs), refresh=True)
