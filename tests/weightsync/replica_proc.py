"""A replica that follows broadcasts, in its own process, for tests that start one late or kill it.

    python -m tests.weightsync.replica_proc URL QUEUE ID STATUS [--size N] [--pause-at V --marker PATH]

Runs :class:`~rollq.consumer.loop.Consumer` on a :class:`~rollq.testing.fake_workers.FakeWorkerEngine`
(one in-process worker with the real rollq worker extension, so the real broadcast receiver,
listener and swap) and a ``WeightFollower`` with ``WeightSyncSettings(broadcast=True)``, until SIGTERM. Appends one JSON
line to STATUS each time the served version changes (``version`` and the smallest and largest
value of the worker's weights) and ``{"event": "serving"}`` when the consumer starts to pull.

``--pause-at V``: the worker's receive of version V stops after its second broadcast (bucket):
it writes ``--marker`` and sleeps, so a test can SIGKILL the process in the middle of a broadcast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rollq.consumer.loop import Consumer
from rollq.settings import ConsumerSettings
from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.settings import WeightSyncSettings
from rollq.weightsync import WeightFollower


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="replica_proc")
    p.add_argument("url")
    p.add_argument("queue")
    p.add_argument("id")
    p.add_argument("status")
    p.add_argument("--size", type=int, default=32, help="hidden size of the two-layer model")
    p.add_argument("--delay-ms", type=float, default=0.0, help="echo engine: milliseconds per generated token")
    p.add_argument("--max-inflight", type=int, default=2)
    p.add_argument("--pause-at", type=int, default=0)
    p.add_argument("--marker", default="")
    return p.parse_args(argv)


def pause_receive_at(version: int, marker: str) -> None:
    """Make this process's receive of ``version`` stop for good after its second broadcast."""
    from rollq.weightsync import process_group
    from rollq.weightsync.worker import _receiver as receiver

    seen = {"version": 0, "n": 0}
    receive, broadcast = receiver.WorkerReceiver.receive, process_group.Group.broadcast

    def counted_receive(self: Any, offer: Any) -> None:
        seen["version"], seen["n"] = offer.version, 0
        receive(self, offer)

    def paused_broadcast(self: Any, buf: torch.Tensor, timeout: float, *, wait: bool = True) -> Any:
        if seen["version"] == version:
            seen["n"] += 1
            if seen["n"] > 2:
                Path(marker).write_text("paused")
                time.sleep(3600)  # until the test kills the process
        return broadcast(self, buf, timeout, wait=wait)

    receiver.WorkerReceiver.receive = counted_receive
    process_group.Group.broadcast = paused_broadcast


async def main(a: argparse.Namespace) -> int:
    if a.pause_at:
        pause_receive_at(a.pause_at, a.marker)

    def model() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(a.size, a.size), torch.nn.Linear(a.size, 8))
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        return m

    engine = FakeWorkerEngine(model, delay_per_token=a.delay_ms / 1000.0)
    settings = ConsumerSettings(lease_ttl=2.0, heartbeat_interval=0.3, block=0.2, max_inflight=a.max_inflight,
                                initial_inflight=a.max_inflight)
    consumer = Consumer(engine, a.url, a.queue, consumer_id=a.id, settings=settings)
    status = Path(a.status)

    def write(line: dict[str, Any]) -> None:
        with status.open("a") as f:
            f.write(json.dumps(line) + "\n")

    set_version = consumer.set_version

    def set_and_report(version: int, progress: Any = None) -> None:
        set_version(version, progress)
        params = list(engine.workers[0].model_runner.model.named_parameters())
        write({"version": version, "lo": min(float(p.min()) for _, p in params), "hi": max(float(p.max()) for _, p in params)})

    consumer.set_version = set_and_report  # type: ignore[method-assign]
    follower = WeightFollower(consumer, WeightSyncSettings(reconcile_interval=0.3, broadcast=True, load_timeout=120))
    await follower.start()
    write({"event": "serving"})
    try:
        return await consumer.run(install_signal_handlers=True)
    finally:
        await follower.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s [{sys.argv[3]}] %(levelname)s %(name)s %(message)s")
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
