"""A TorchRL user's burst (one ``AsyncVLLM.generate()`` of 64 prompts x 8 samples) is spread
over two idle replicas, here echo engines (rollq/consumer/_share.py; before it, 64 jobs went
to one replica and 0 to the other)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

pytest.importorskip("torchrl")
vllm = pytest.importorskip("vllm")

from rollq.consumer.engine import EchoEngine  # noqa: E402
from rollq.consumer.loop import Consumer  # noqa: E402
from rollq.settings import ConsumerSettings  # noqa: E402
from rollq.torchrl import AsyncVLLM  # noqa: E402


def _serve(url: str, queue: str, consumers: list, stop: threading.Event) -> None:
    """Two echo replicas of ``queue`` in this thread's event loop until ``stop``."""

    async def main() -> None:
        settings = ConsumerSettings(max_inflight=128, initial_inflight=128, adaptive=False, heartbeat_interval=0.2)
        cs = [Consumer(EchoEngine(delay_per_token=0.01), url, queue, consumer_id=f"e{i}", settings=settings) for i in range(2)]
        consumers.extend(cs)
        tasks = [asyncio.create_task(c.run()) for c in cs]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for c in cs:
            c.stop()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_generate_of_64_prompts_x_8_samples_is_spread_over_two_replicas(redis_url, queue, tiny_model_path):
    consumers: list = []
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(redis_url, queue, consumers, stop), daemon=True)
    t.start()
    engine = AsyncVLLM(redis_url, queue, tokenizer=str(tiny_model_path))
    try:
        deadline = time.monotonic() + 10
        while not (len(consumers) == 2 and all(c._ctx.peers_free > 0 for c in consumers)):
            assert time.monotonic() < deadline, "the replicas never saw each other's free slots"
            time.sleep(0.05)
        time.sleep(1.2)  # a blocking read issued before that (block 1 s) has ended
        sp = vllm.SamplingParams(n=8, max_tokens=4)
        for _ in range(2):
            outs = engine.generate(prompt_token_ids=[[5, 6, 7, i] for i in range(64)], sampling_params=sp, use_tqdm=False)
            assert len(outs) == 64 and all(len(o.outputs) == 8 for o in outs)
            per_replica = Counter(o.replica for o in outs)
            assert max(per_replica.values()) <= 0.6 * 64, per_replica
            time.sleep(0.5)
    finally:
        engine.shutdown()
        stop.set()
        t.join(20)
