"""The control listener: it hears the channel, survives an outage, and always lets the replica stop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rollq.connection import connect
from rollq.consumer._control import ControlListener
from rollq.keys import QueueKeys
from rollq.protocol import Control, control_message
from rollq.settings import ConsumerSettings


class _Jobs:
    def __init__(self) -> None:
        self.cancelled_ids: list[str] = []
        self.heard = asyncio.Event()

    def cancelled(self, job_id: str) -> None:
        self.cancelled_ids.append(job_id)
        self.heard.set()


def _listener(url: str, queue: str) -> tuple[ControlListener, SimpleNamespace, _Jobs]:
    ctx = SimpleNamespace(
        redis=connect(url), keys=QueueKeys(queue), settings=ConsumerSettings(), closed=False, id="replica-a", engine=None
    )
    jobs = _Jobs()
    return ControlListener(ctx, jobs, on_handback=lambda: None), ctx, jobs  # type: ignore[arg-type]


async def _subscribed(r, channel: str) -> None:
    while (await r.pubsub_numsub(channel))[0][1] < 1:
        await asyncio.sleep(0.01)


async def _unsubscribed(r, channel: str) -> None:
    while (await r.pubsub_numsub(channel))[0][1] > 0:
        await asyncio.sleep(0.01)


async def test_a_cancel_is_heard_and_closing_ends_the_listener_without_a_cancel(redis_url, queue, redis_client):
    listener, ctx, jobs = _listener(redis_url, queue)
    task = asyncio.create_task(listener.run())
    await asyncio.wait_for(_subscribed(redis_client, ctx.keys.control), 30)
    await redis_client.publish(ctx.keys.control, control_message(Control.CANCEL, "job-7"))
    await asyncio.wait_for(jobs.heard.wait(), 30)
    assert jobs.cancelled_ids == ["job-7"]
    ctx.closed = True
    await asyncio.wait_for(asyncio.shield(task), 30)  # ends by itself: no cancel was sent
    # the subscription's connection is closed: Redis drops it once it sees the socket go
    await asyncio.wait_for(_unsubscribed(redis_client, ctx.keys.control), 30)
    await ctx.redis.aclose()


async def test_a_subscription_whose_close_hangs_does_not_hold_the_replica(redis_url, queue, redis_client, monkeypatch):
    """redis-py waits for a pub/sub teardown even through a cancel; one that never finishes
    used to keep ControlListener.run, and the replica's shutdown, pending forever."""
    from redis.asyncio.client import PubSub

    never = asyncio.Event()
    closes = []

    async def hanging_aclose(self):
        closes.append(self)
        await asyncio.shield(asyncio.ensure_future(never.wait()))

    listener, ctx, _ = _listener(redis_url, queue)
    task = asyncio.create_task(listener.run())
    await asyncio.wait_for(_subscribed(redis_client, ctx.keys.control), 30)
    monkeypatch.setattr(PubSub, "aclose", hanging_aclose)
    ctx.closed = True
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=60)
    assert task in done and task.cancelled()
    assert closes, "the listener closed its subscription"
    never.set()
    monkeypatch.undo()
    await ctx.redis.aclose()


async def test_the_listener_resubscribes_after_redis_is_killed_and_restarted(fresh_redis, queue):
    listener, ctx, jobs = _listener(fresh_redis.url, queue)
    task = asyncio.create_task(listener.run())
    probe = connect(fresh_redis.url)
    await asyncio.wait_for(_subscribed(probe, ctx.keys.control), 30)
    fresh_redis.restart(hard=True)
    await asyncio.wait_for(_subscribed(probe, ctx.keys.control), 60)
    await probe.publish(ctx.keys.control, control_message(Control.CANCEL, "job-9"))
    await asyncio.wait_for(jobs.heard.wait(), 30)
    assert jobs.cancelled_ids == ["job-9"]
    ctx.closed = True
    await asyncio.wait_for(task, 30)
    await probe.aclose()
    await ctx.redis.aclose()


async def test_a_background_task_that_swallows_its_cancellation_is_cancelled_again_at_shutdown(make_consumer, queue):
    """Python 3.11's ``wait_for`` can swallow a cancellation that lands as the inner wait ends;
    a background loop that goes on after it (and does not look at ``closed``) must still be
    ended by the consumer's shutdown, not left running behind a stopped replica."""
    c = make_consumer(queue)
    swallowed = asyncio.Event()

    async def swallow_once() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # goes on as if the wait had ended
        await asyncio.Event().wait()

    c.control.run = swallow_once  # type: ignore[method-assign]
    make_consumer.start(c)
    await asyncio.wait_for(_serving(c), 30)
    task = next(t for t in c._tasks if t.get_name() == "rollq-control")
    assert await make_consumer.stop(c, timeout=30) == 0
    assert swallowed.is_set() and task.done()


async def _serving(c) -> None:
    while c.state != "serving" or not c._tasks:
        await asyncio.sleep(0.01)
