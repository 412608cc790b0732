"""Whether vLLM's engine core still lives, as the replica sees it, and ending it.

vLLM's client watches its engine-core processes (a thread waits on their sentinels) and
sets ``AsyncLLM.errored`` when one exits. Requests in flight then fail with
``EngineDeadError``; but a call that waits for the engine core's reply (``collective_rpc``,
``pause_generation``, ``reset_prefix_cache``: vLLM's utility calls) is never answered. It
waits forever, or for whatever bound its caller set: a weight update waits ``load_timeout``,
minutes, with the replica paused and its intake closed. :func:`until_dead` ends such a
wait as soon as the engine is seen dead; :func:`core_failure` says what died.
:func:`shut_down` ends an engine without an error in vLLM's log.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Awaitable, Callable, TypeVar

__all__ = ["DEATH_POLL_S", "core_failure", "shut_down", "shut_down_when_built", "until_dead"]

T = TypeVar("T")

#: Seconds between two looks at the engine's life while a call into it waits.
DEATH_POLL_S = 0.2


def core_failure(llm: Any) -> str | None:
    """Why ``llm``'s engine core is gone (``"EngineCore (pid 123) was killed by SIGKILL"``),
    or None while it serves (and for None, an engine not started)."""
    if llm is None or not llm.errored:
        return None
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    ended = []
    for p in getattr(getattr(resources, "engine_manager", None), "processes", None) or ():
        code = p.exitcode
        if code is None:
            continue
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        ended.append(f"{p.name} (pid {p.pid}) {how}")
    return "; ".join(ended) or "vLLM reports its engine core dead"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


async def until_dead(aw: Awaitable[T], failure: Callable[[], BaseException | None],
                     poll: float = DEATH_POLL_S) -> T:
    """``await aw``, unless ``failure()`` returns an exception first: it is raised then and
    ``aw`` cancelled (vLLM would never answer it)."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            err = failure()
            if err is not None:
                raise err
    finally:
        if not task.done():
            task.cancel()


async def shut_down(llm: Any, handler_timeout: float) -> None:
    """Shut ``llm`` down. vLLM's ``AsyncLLM.shutdown`` stops the engine core, then cancels
    its output handler; run in a thread (it blocks up to 5 s on the engine-core process)
    while the loop runs, the handler can see the engine core go first and log an
    ``EngineDeadError`` traceback for a clean stop. So the handler is ended first."""
    handler = getattr(llm, "output_handler", None)
    if isinstance(handler, asyncio.Task) and not handler.done():
        handler.cancel()
        await asyncio.wait([handler], timeout=handler_timeout)
    await asyncio.to_thread(llm.shutdown)


def shut_down_when_built(build: asyncio.Future[Any]) -> None:
    """Done callback of an engine build nobody waits for any more: shut the engine down
    when it comes up."""
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()
