"""A consumer replica in its own process, for tests that kill it (SIGKILL, SIGTERM).

    python -m tests.helpers.consumer_proc URL QUEUE ID DELAY_MS [options]

Runs :class:`~rollq.consumer.loop.Consumer` with an :class:`EchoEngine` that takes
``DELAY_MS`` milliseconds per generated token, until SIGTERM; exits with the consumer's code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer
from rollq.settings import ConsumerSettings
from rollq.testing.chaos import HistoryLog


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="consumer_proc")
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("delay_ms", type=float)
    p.add_argument("--lease-ttl", type=float, default=2.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--reclaim", type=float, default=0.5)
    p.add_argument("--block", type=float, default=0.2)
    p.add_argument("--drain-timeout", type=float, default=25.0)
    p.add_argument("--max-deliveries", type=int, default=3)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--history", default=None, help="append deliver/finish events to this JSON-lines file")
    return p.parse_args(argv)


class LoggedEcho(EchoEngine):
    """The echo engine, writing a ``deliver`` event when a job reaches it and a ``finish``
    event when it is done with one (rollq.testing.chaos.HistoryLog)."""

    def __init__(self, history: HistoryLog, **kw: object):
        super().__init__(**kw)  # type: ignore[arg-type]
        self.history = history

    def submit(self, request_id: str, job, done) -> None:  # noqa: ANN001
        self.history.event("deliver", [job.id])

        def logged(rid: str, out: object) -> None:
            self.history.event("finish", [job.id])
            done(rid, out)

        super().submit(request_id, job, logged)


async def main(a: argparse.Namespace) -> int:
    settings = ConsumerSettings(
        lease_ttl=a.lease_ttl, heartbeat_interval=a.heartbeat, reclaim_interval=a.reclaim, block=a.block,
        drain_timeout=a.drain_timeout, max_deliveries=a.max_deliveries, max_inflight=a.max_inflight,
        initial_inflight=a.max_inflight, backoff_max=0.5,
    )
    delay = a.delay_ms / 1000.0
    engine = LoggedEcho(HistoryLog(a.history, a.id), delay_per_token=delay) if a.history else EchoEngine(delay_per_token=delay)
    consumer = Consumer(engine, a.url, a.queue, consumer_id=a.id, settings=settings)
    return await consumer.run(install_signal_handlers=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"%(asctime)s [{sys.argv[3]}] %(levelname)s %(message)s")
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
