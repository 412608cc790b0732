"""A stray value at one of a sharded queue's keys takes down neither a replica nor the queue.

Anything that can write Redis can ``SET`` over a key rollq keeps: the replicas name the key,
skip it (retrying with backoff), and serve every other stream; a replica started while the
key is bad serves too, and once the key is repaired its shard is served again.
"""

from __future__ import annotations

import asyncio
import logging

from rollq.keys import QueueKeys
from rollq.shards import home_shard, shard_of_id
from tests.helpers import bounded, until

K = 3
BAD = 1  # the shard whose job stream holds a string


def _ids(shards: set[int], n: int, prefix: str) -> list[str]:
    """``n`` caller-chosen job ids that the producer routes to one of ``shards``."""
    return [j for j in (f"{prefix}{i}" for i in range(10 * n + 100)) if shard_of_id(j, K) in shards][:n]


def _homed(shard: int, prefix: str) -> str:
    """A replica name whose home shard is ``shard``."""
    return next(c for c in (f"{prefix}{i}" for i in range(1000)) if home_shard(c, K) == shard)


def _named(caplog, key: str) -> bool:
    """An error line names ``key`` as holding a string."""
    return any(key in r.getMessage() and "string" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


async def test_a_string_at_one_shards_job_stream_stops_no_replica(
        queue, make_producer, make_consumer, redis_client, caplog):
    """Used to: an uncaught WRONGTYPE in XREADGROUP ended every replica at once, and one
    started while the key was bad exited at start."""
    caplog.set_level(logging.INFO, logger="rollq")
    bad_key = QueueKeys(queue).shard(BAD).jobs
    # One replica at home on the bad shard (its blocking read names the bad stream), one not.
    first = make_consumer(queue, consumer_id=_homed(BAD, "home-bad-"), shards=K)
    other = make_consumer(queue, consumer_id=_homed(0, "home-ok-"), shards=K)
    tasks = [make_consumer.start(first), make_consumer.start(other)]
    await until(lambda: first.state == "serving" and other.state == "serving", 15, "both replicas serving")
    p = await make_producer(queue, shards=K)
    await bounded(p.gather([await p.submit(prompt_token_ids=[1], id="warm")], timeout=15), 20, "a first result")

    await redis_client.delete(bad_key)
    await redis_client.set(bad_key, b"garbage")
    await until(lambda: any(t.done() for t in tasks) or _named(caplog, bad_key), 15,
                "the replica at home on shard 1 to meet the string")
    handles = await p.submit_many([{"prompt_token_ids": [2], "id": j} for j in _ids({0, 2}, 30, "a")])
    rs = await bounded(p.gather(handles), 30, "the other shards' results while shard 1's stream is a string")
    assert all(r.ok for r in rs)
    assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
    assert first.state == other.state == "serving"

    late = make_consumer(queue, consumer_id=_homed(BAD, "late-"), shards=K)
    late_task = make_consumer.start(late)
    await until(lambda: late.state == "serving" or late_task.done(), 15, "a replica started meanwhile to serve")
    assert not late_task.done(), late_task.exception()
    handles = await p.submit_many([{"prompt_token_ids": [3], "id": j} for j in _ids({0, 2}, 30, "b")])
    assert all(r.ok for r in await bounded(p.gather(handles), 30, "results with three replicas"))
    assert not any(t.done() for t in [*tasks, late_task])
    assert _named(caplog, bad_key)
    assert not any(r.exc_info for r in caplog.records), "a stray value is an error line, not a traceback"

    # Repaired: the shard's jobs are served again (its group is made anew).
    await redis_client.delete(bad_key)
    handles = await p.submit_many([{"prompt_token_ids": [4], "id": j} for j in _ids({BAD}, 10, "c")])
    assert all(r.ok for r in await bounded(p.gather(handles), 30, "shard 1's results once its key is repaired"))
    # The replicas that met the string say the key is usable again at their next try (their
    # back-off may still be running when another replica has already served the shard).
    await until(lambda: any(bad_key in r.getMessage() and "usable again" in r.getMessage() for r in caplog.records), 30,
                "a replica that met the string to find the key usable again")
    for c in (first, other, late):
        assert await make_consumer.stop(c) == 0
    await asyncio.sleep(0)
