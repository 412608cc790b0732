"""``rollq dashboard`` and ``rollq top``, registered into the main CLI by :func:`register`.

    rollq dashboard [--queue Q ...] [--host H] [--port P] [--token T]   web page, JSON API, /metrics
    rollq top [--queue Q ...] [--once] [--json]                         live terminal view

Without ``--queue`` both watch every queue in use (rollq/registry.py), a queue used later too.

``rollq/cli/main.py`` calls ``register(sub)`` with its subparsers; ``python -m rollq.dashboard.cli``
runs the two commands on their own. Heavy imports (starlette, uvicorn) happen only when a
command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any

from ..settings import ENV_URL
from . import DEFAULT_PORT, ENV_TOKEN

log = logging.getLogger("rollq.dashboard")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"Redis URL (default: ${ENV_URL} or redis://127.0.0.1:6379/0)")
    p.add_argument("--queue", "-q", action="append", default=None, dest="queues", metavar="QUEUE",
                   help="queue to watch; repeat for several (default: every queue in use)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default: %(default)s)")


def _sampler(a: argparse.Namespace, **settings: Any) -> Any:
    from .sampler import DashboardSettings, Sampler

    return Sampler(a.url, a.queues, DashboardSettings(interval=a.interval, **settings))  # None: every queue


def cmd_dashboard(a: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app, resolve_token

    token = resolve_token(a.token)
    sampler = _sampler(a, history=a.history_minutes * 60)
    app = create_app(sampler, token=token)
    log.info(
        "dashboard of %s on http://%s:%d/ (JSON: /api/queues, Prometheus: /metrics; writes %s)",
        "every queue in use" if sampler.discovering else ", ".join(sampler.queues), a.host, a.port,
        "need the bearer token" if token else "disabled",
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False)
    return 0


async def _top(a: argparse.Namespace) -> int:
    from .top import run_top

    sampler = _sampler(a)
    async with sampler:
        if a.json:
            await sampler.sample_all()
            for q in sampler.queues:
                sys.stdout.write(json.dumps(sampler.document(q, history=False)) + "\n")
            return 0 if all(sampler.sampler_info(q)["ok"] for q in sampler.queues) else 1
        docs = await run_top(sampler, once=a.once)
        return 0 if all(d["sampler"]["ok"] for d in docs) else 1


def cmd_top(a: argparse.Namespace) -> int:
    try:
        return asyncio.run(_top(a))
    except KeyboardInterrupt:
        return 0


def register(sub: Any) -> None:
    """Add ``dashboard`` and ``top`` to the subparsers of ``rollq``'s parser."""
    s = sub.add_parser("dashboard", help="web dashboard of queues and replicas, JSON API, Prometheus /metrics")
    _common(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    s.add_argument("--token", default=None,
                   help=f"bearer token write endpoints require (default: ${ENV_TOKEN}; none: writes disabled)")
    s.add_argument("--history-minutes", type=float, default=10.0, help="chart history kept per queue")
    s.set_defaults(fn=cmd_dashboard)

    s = sub.add_parser("top", help="live terminal view of queues, replicas and policy versions")
    _common(s)
    s.add_argument("--once", action="store_true", help="render one frame and exit (rates need two samples: '-')")
    s.add_argument("--json", action="store_true",
                   help="print one JSON document per queue (as GET /api/queues/QUEUE) and exit")
    s.set_defaults(fn=cmd_top)


def main(argv: list[str] | None = None) -> int:
    """The two commands without the rest of ``rollq`` (``python -m rollq.dashboard.cli``)."""
    p = argparse.ArgumentParser(prog="rollq")
    register(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return a.fn(a) or 0


if __name__ == "__main__":
    sys.exit(main())
