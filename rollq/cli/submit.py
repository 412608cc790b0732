"""``rollq submit``: jobs from a JSONL file (or stdin), optionally waiting for their results."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .common import common_options, err_console, log, out


def _read_specs(path: str) -> list[dict[str, Any]]:
    from ..errors import InvalidJob

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

    from ..producer.client import Producer
    from ..settings import ProducerSettings

    specs = _read_specs(a.file)
    p = Producer(a.url, a.queue, settings=ProducerSettings(shards=a.shards))
    jobs = [p.build_job(s) for s in specs]  # validate everything before connecting or sending
    async with p:
        handles = await p.submit_many(jobs)
        if not a.wait:
            for h in handles:
                out({"id": h.id, "duplicate": h.duplicate})
            return 0
        failed = 0
        with Progress(console=err_console(), transient=False) as prog:
            task = prog.add_task(f"{a.queue}: results", total=len(handles))
            pending = {h.id for h in handles}
            async for r in p.results(timeout=a.timeout):
                if r.id not in pending:
                    continue
                pending.discard(r.id)
                failed += r.error is not None
                out(result_to_json(r))
                prog.advance(task)
                if not pending:
                    break
        if pending:
            log.error("%d jobs got no result within %.0fs", len(pending), a.timeout)
            return 2
        return 1 if failed else 0


def cmd_submit(a: argparse.Namespace) -> int:
    from ..errors import InvalidJob

    try:
        return asyncio.run(_submit(a))
    except InvalidJob as e:
        err_console().print(f"rollq submit: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2

def register(sub: Any) -> None:
    """Add submit to the ``rollq`` subcommands."""
    s = sub.add_parser("submit", help="submit jobs from a JSONL file ('-': stdin)")
    common_options(s)
    s.add_argument("file")
    s.add_argument("--wait", action="store_true", help="print one JSON line per result")
    s.add_argument("--timeout", type=float, default=600.0, help="--wait: give up after this many idle seconds")
    s.add_argument("--shards", type=int, default=None,
                   help="the queue's shard count (default: follow its record; see `rollq queue create`)")
    s.set_defaults(fn=cmd_submit)
