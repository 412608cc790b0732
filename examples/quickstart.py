"""Quickstart: an embedded Redis, one echo replica, a trainer that submits GRPO groups.

    python examples/quickstart.py

Swap ``EchoEngine()`` for ``VllmEngine(VllmEngineConfig(model=...))`` to generate with vLLM.
"""

import asyncio

from rollq import Consumer, EchoEngine, Producer, RedisServer


async def main(url: str) -> None:
    replica = Consumer(EchoEngine(), url, queue="grpo", consumer_id="replica-0")
    serving = asyncio.create_task(replica.run())
    async with Producer(url, queue="grpo") as trainer:
        await trainer.submit_many(
            {"prompt_token_ids": [1, 2, 3, i], "sampling": {"n": 4, "max_tokens": 8}, "meta": {"step": 0}}
            for i in range(16)
        )
        got = 0
        async for result in trainer.results(timeout=30):
            got += 1
            print(result.id, result.policy_version, [s.token_ids[:4] for s in result.samples][:2], result.meta)
            if got == 16:
                break
    replica.stop()
    await serving


if __name__ == "__main__":
    with RedisServer() as server:
        asyncio.run(main(server.url))
