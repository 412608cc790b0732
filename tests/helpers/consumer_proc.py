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
    return p.parse_args(argv)


async def main(a: argparse.Namespace) -> int:
    settings = ConsumerSettings(
        lease_ttl=a.lease_ttl, heartbeat_interval=a.heartbeat, reclaim_interval=a.reclaim, block=a.block,
        drain_timeout=a.drain_timeout, max_deliveries=a.max_deliveries, max_inflight=a.max_inflight,
        initial_inflight=a.max_inflight, backoff_max=0.5,
    )
    consumer = Consumer(
        EchoEngine(delay_per_token=a.delay_ms / 1000.0), a.url, a.queue, consumer_id=a.id, settings=settings
    )
    return await consumer.run(install_signal_handlers=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"%(asctime)s [{sys.argv[3]}] %(levelname)s %(message)s")
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
