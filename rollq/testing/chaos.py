"""Fault tools for system tests and soak benchmarks: a TCP proxy that cuts connections, a
history of queue events, and a checker of that history against the final Redis state.

Loopback only: the proxy listens on 127.0.0.1 and forwards to a loopback upstream; every loop
is bounded by its caller.

>>> import asyncio
>>> async def main():                                    # doctest: +SKIP
...     proxy = await CutProxy(upstream_port=6379).start()
...     proxy.cut()                                      # drop every connection through it now
...     await proxy.stop()

The history is one JSON object per line (``{"e": event, "id": job id, ...}``), appended by
any process that takes part (producers log ``submit`` for each handle a submission returned,
``maybe`` for jobs whose submission is in doubt, and ``result``; consumers ``deliver`` when
a job reaches the engine and ``finish`` when the engine is done with it), so a test can kill processes and still read what each of them did. The
checker (:func:`check_history`) reports what the guarantees forbid: a job submitted (its
handle returned) that never produced a result (``lost``), a result the trainer received twice
(``duplicates``), entries still pending or queued after the run (``stuck``); deliveries of one
job to several replicas (``redelivered``) are allowed (at-least-once processing) and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger(__name__)

__all__ = ["CutProxy", "HistoryLog", "HistoryReport", "check_history", "read_history"]


class CutProxy:
    """A loopback TCP proxy whose connections can be cut at will (or every few ms).

    ``cut()`` closes every connection through it (both sides); ``start_cutting(lo, hi)``
    does that every ``lo``-``hi`` seconds until ``stop_cutting()``; ``pause(s)`` refuses new
    connections for ``s`` seconds, and ``dark = True`` until it is set back (a partition).
    ``port`` is where clients connect.
    """

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", port: int = 0):
        if upstream_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("CutProxy forwards to loopback addresses only")
        self.upstream = (upstream_host, upstream_port)
        self.port = port
        self.cuts = 0
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._cutter: asyncio.Task | None = None
        self._refuse_until = 0.0
        #: While set, connections are refused as they come (Redis unreachable).
        self.dark = False

    async def start(self) -> CutProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.dark or time.monotonic() < self._refuse_until:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_w)
        self._pipes.add(pair)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        try:
            await asyncio.gather(pump(reader, up_w), pump(up_r, writer))
        finally:
            self._pipes.discard(pair)

    def cut(self) -> int:
        """Close every connection through the proxy now; returns how many."""
        n = 0
        for a, b in list(self._pipes):
            for w in (a, b):
                tr = w.transport
                if tr is not None:
                    tr.abort()  # RST: as a dropped link, not a clean close
            n += 1
        self._pipes.clear()
        self.cuts += n > 0
        return n

    def pause(self, seconds: float) -> None:
        """Cut everything and refuse new connections for ``seconds`` (a short partition)."""
        self._refuse_until = time.monotonic() + seconds
        self.cut()

    def start_cutting(self, lo: float, hi: float, seed: int = 0) -> None:
        rng = random.Random(seed)

        async def loop() -> None:
            while True:
                await asyncio.sleep(rng.uniform(lo, hi))
                self.cut()

        self.stop_cutting()
        self._cutter = asyncio.get_running_loop().create_task(loop())

    def stop_cutting(self) -> None:
        if self._cutter is not None:
            self._cutter.cancel()
            self._cutter = None

    async def stop(self) -> None:
        self.stop_cutting()
        if self._server is not None:
            self._server.close()
            self.cut()
            await self._server.wait_closed()
            self._server = None


class HistoryLog:
    """Appends events to a JSON-lines file shared by several processes (one ``write`` per
    line on a file opened for appending: lines of different processes do not interleave)."""

    def __init__(self, path: str | os.PathLike[str], who: str):
        self.path = str(path)
        self.who = who
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def event(self, kind: str, ids: Iterable[str], **extra: Any) -> None:
        t = time.time()
        lines = "".join(json.dumps({"e": kind, "id": i, "by": self.who, "t": t, **extra}) + "\n" for i in ids)
        if lines:
            data = lines.encode()
            with self._lock:
                while data:  # O_APPEND writes of a few KB go in one piece; loop for the rest
                    data = data[os.write(self._fd, data):]

    def close(self) -> None:
        os.close(self._fd)


def read_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a history file (a torn last line, of a killed process, is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@dataclass
class HistoryReport:
    submitted: int = 0
    results: int = 0
    lost: list[str] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)
    unknown_results: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stuck: int = 0
    stuck_detail: dict[str, int] = field(default_factory=dict)
    deliveries: int = 0
    redelivered: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicates or self.unknown_results or self.stuck)

    def summary(self) -> dict[str, Any]:
        return {
            "submitted": self.submitted, "results": self.results, "lost": len(self.lost),
            "duplicates": len(self.duplicates), "unknown_results": len(self.unknown_results),
            "failed": len(self.failed), "stuck": self.stuck, "deliveries": self.deliveries,
            "redelivered": self.redelivered, "ok": self.ok,
        }


def check_history(events: list[dict[str, Any]], stuck: dict[str, int] | None = None) -> HistoryReport:
    """Check a history (see the module doc); ``stuck``: what the final Redis state still
    holds for the queue (entries pending or queued, by place), all of which should be 0.

    >>> ev = [{"e": "submit", "id": "a"}, {"e": "submit", "id": "b"}, {"e": "result", "id": "a"},
    ...       {"e": "result", "id": "a"}, {"e": "deliver", "id": "a"}]
    >>> r = check_history(ev)
    >>> r.lost, r.duplicates, r.ok
    (['b'], {'a': 2}, False)
    """
    submitted = {e["id"] for e in events if e["e"] == "submit"}
    maybe = {e["id"] for e in events if e["e"] == "maybe"}  # sent, reply lost: either way is right
    results = Counter(e["id"] for e in events if e["e"] == "result")
    deliveries = Counter(e["id"] for e in events if e["e"] == "deliver")
    rep = HistoryReport(submitted=len(submitted), results=sum(results.values()))
    rep.lost = sorted(submitted - set(results))
    rep.duplicates = {i: n for i, n in results.items() if n > 1}
    rep.unknown_results = sorted(set(results) - submitted - maybe)
    rep.failed = {e["id"]: e.get("error", "") for e in events if e["e"] == "result" and e.get("error")}
    rep.deliveries = sum(deliveries.values())
    rep.redelivered = sum(1 for n in deliveries.values() if n > 1)
    if stuck:
        rep.stuck_detail = dict(stuck)
        rep.stuck = sum(stuck.values())
    return rep
