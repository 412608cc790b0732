"""Shared pieces of the command modules: logging, the URL and queue options, JSON output."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..settings import DEFAULT_QUEUE, ENV_URL, ENV_URL_FILE

log = logging.getLogger("rollq.cli")

#: Longest log message the CLI prints; the rest is cut (messages carry untrusted job fields).
MAX_LOG_CHARS = 2000


class CutLongMessages(logging.Filter):
    """Cut log messages to :data:`MAX_LOG_CHARS` before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if len(msg) > MAX_LOG_CHARS:
            from ..protocol import cut

            record.msg, record.args = cut(msg, MAX_LOG_CHARS), None
        return True


def setup_logging(level: str) -> None:
    from rich.highlighter import NullHighlighter
    from rich.logging import RichHandler

    # Log lines carry untrusted strings (job ids, error messages): no markup, and no
    # highlighting either (rich's highlighter took seconds on a 40,000-character id).
    handler = RichHandler(console=err_console(), show_path=False, rich_tracebacks=True, markup=False,
                          highlighter=NullHighlighter())
    handler.addFilter(CutLongMessages())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="%(name)s: %(message)s",
                        handlers=[handler])


def err_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def common_options(p: argparse.ArgumentParser) -> None:
    url_options(p)
    p.add_argument("--queue", "-q", default=DEFAULT_QUEUE, help="queue name (default: %(default)s)")


def url_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"Redis URL (default: ${ENV_URL} or redis://127.0.0.1:6379/0; "
                   "a password given here shows in ps: use --url-file or the environment)")
    p.add_argument("--url-file", default=None, metavar="PATH",
                   help=f"read the Redis URL from the first line of PATH (also ${ENV_URL_FILE})")


def out(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def every_queue_by_default(p: argparse.ArgumentParser) -> None:
    """``--queue`` of ``p`` defaults to every queue in use (rollq/registry.py)."""
    for action in p._actions:
        if action.dest == "queue":
            action.default = None
            action.help = "queue name (default: every queue in use)"
