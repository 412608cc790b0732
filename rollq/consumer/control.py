"""Control: pub/sub hints that make the replica react at once.

The channel carries :class:`~rollq.protocol.Control` verbs: ``CANCEL`` ends a running job
(and refuses it if it is read later), ``HANDBACK`` (a peer stopped) starts a reclaim now,
``RESET_PREFIX_CACHE`` drops the engine's prefix cache; handlers added with
:meth:`ControlListener.add_handler` (weight sync) see every verb. Pub/sub is only a hint: the
durable state behind each verb is also checked by the heartbeat and the reclaimer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from ..connection import RETRYABLE
from ..protocol import Control, parse_control
from .context import ReplicaContext
from .jobs import Jobs

log = logging.getLogger(__name__)


class ControlListener:
    """The subscription task (:meth:`run`) and the dispatch of each message."""

    def __init__(self, ctx: ReplicaContext, jobs: Jobs, on_handback: Callable[[], None]) -> None:
        self._ctx = ctx
        self._jobs = jobs
        self._on_handback = on_handback
        self._handlers: list[Callable[[Control, str], Any]] = []
        self._tasks: set[asyncio.Task] = set()

    def add_handler(self, cb: Callable[[Control, str], Any]) -> None:
        """Call ``cb(verb, arg)`` for every control message of a known verb."""
        self._handlers.append(cb)

    async def run(self) -> None:
        ctx = self._ctx
        backoff = ctx.settings.backoff_initial
        while not ctx.closed:
            pubsub = ctx.redis.pubsub()
            try:
                await pubsub.subscribe(ctx.keys.control)
                backoff = ctx.settings.backoff_initial
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    self.on_message(msg["data"].decode(errors="replace"))
            except asyncio.CancelledError:
                await pubsub.aclose()
                raise
            except RETRYABLE as e:
                log.debug("control channel lost (%s)", e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, ctx.settings.backoff_max)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def on_message(self, text: str) -> None:
        verb, arg = parse_control(text)
        if verb is None:
            return
        if verb is Control.CANCEL:
            self._jobs.cancelled(arg)
        elif verb is Control.HANDBACK and arg != self._ctx.id:
            self._on_handback()
        elif verb is Control.RESET_PREFIX_CACHE:  # a trainer asked (rollq.torchrl); every weight load resets it too
            task = asyncio.create_task(self._ctx.engine.reset_prefix_cache(), name="rollq-reset-prefix-cache")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for cb in list(self._handlers):
            cb(verb, arg)
