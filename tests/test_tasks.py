"""rollq._tasks: a background task is stopped even when it swallows a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from rollq._tasks import stop_task


async def test_a_loop_that_swallows_one_cancellation_is_still_stopped():
    swallowed = 0

    async def stubborn():
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                if swallowed == 0:  # as asyncio.wait_for does on 3.11 when the inner one just finished
                    swallowed += 1
                    asyncio.current_task().uncancel()
                    continue
                raise

    t = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await asyncio.wait_for(stop_task(t), 5)
    assert t.cancelled() and swallowed == 1


async def test_a_task_that_never_stops_is_given_up_after_the_grace(caplog):
    stop = asyncio.Event()

    async def deaf():
        while not stop.is_set():
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()

    t = asyncio.create_task(deaf(), name="deaf")
    await asyncio.sleep(0)
    assert not await asyncio.wait_for(stop_task(t, grace=0.3), 5)
    assert "task deaf did not stop within 0.3s" in caplog.text
    stop.set()
    await asyncio.wait_for(t, 5)


async def test_a_finished_or_failed_task_is_taken_as_stopped():
    assert await stop_task(None)

    async def fail():
        raise ValueError("x")

    t = asyncio.create_task(fail())
    await asyncio.sleep(0)
    assert await stop_task(t)
    with pytest.raises(ValueError):
        t.result()


async def test_cleanup_after_the_first_cancellation_is_not_cut_short():
    cleaned = asyncio.Event()

    async def tidy():
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.3)  # e.g. resuming a paused engine
            cleaned.set()

    t = asyncio.create_task(tidy())
    await asyncio.sleep(0)
    assert await asyncio.wait_for(stop_task(t), 5)
    assert cleaned.is_set() and t.cancelled()
