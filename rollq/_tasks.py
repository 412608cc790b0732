"""Stopping a background task even when it swallows its cancellation.

On Python 3.11, :func:`asyncio.wait_for` returns the inner result instead of raising when the
cancellation arrives just as the inner awaitable finishes, so a ``while True`` loop around it
goes on as if nothing had happened and a single ``task.cancel()`` followed by ``await task``
waits forever. :func:`stop_task` cancels again while the task goes on, for a bounded time, and
reports a task that still would not stop. The first cancellation is given
:data:`FIRST_CANCEL_S` before the next, so that cleanup the task does on its way out (awaits
in ``finally`` blocks) is not cut short.

Example:

>>> import asyncio
>>> async def main():
...     async def forever():
...         while True:
...             await asyncio.sleep(1)
...     t = asyncio.create_task(forever())
...     await asyncio.sleep(0)
...     return await stop_task(t)
>>> asyncio.run(main())
True
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

#: How long the first cancellation is given to end the task, and each later one.
FIRST_CANCEL_S, RECANCEL_S = 1.0, 0.2


async def stop_task(task: asyncio.Task | None, grace: float = 10.0) -> bool:
    """Cancel ``task`` and wait until it has ended, cancelling again while it goes on, for at
    most ``grace`` seconds. Returns whether it ended (True for None or an already finished
    task); a task still running after ``grace`` is logged and left behind. Its result or
    exception is consumed."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    wait = FIRST_CANCEL_S
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=max(0.0, min(wait, deadline - loop.time())))
        wait = RECANCEL_S
        if not task.done() and loop.time() >= deadline:
            log.warning("task %s did not stop within %.1fs of being cancelled", task.get_name(), grace)
            return False
    if not task.cancelled():
        task.exception()  # retrieved: an error it ended with is not reported again at exit
    return True
