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
from ._context import ReplicaContext
from ._jobs import Jobs

log = logging.getLogger(__name__)

#: Longest wait for a control message before the listener looks at ``ctx.closed`` again (s).
POLL_S = 1.0
#: Longest wait for a subscription's close (s); see :meth:`ControlListener._close`.
CLOSE_S = 2.0


def _retrieve(task: asyncio.Future) -> None:
    """Read a finished close's outcome, so that a failed close is logged, not reported as
    "exception never retrieved"."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("control channel: closing the subscription failed: %r", task.exception())


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
        """Follow the control channel until the replica closes, resubscribing after an outage.

        The read wakes at least once a second to see ``ctx.closed``, so shutdown ends it without
        a cancel; a cancel ends it too. Either way the subscription is closed with a bound
        (:meth:`_close`): a close that hangs must not keep the replica from stopping.
        """
        ctx = self._ctx
        backoff = ctx.settings.backoff_initial
        while not ctx.closed:
            pubsub = ctx.redis.pubsub()
            lost = False
            try:
                await pubsub.subscribe(ctx.keys.control)
                backoff = ctx.settings.backoff_initial
                while not ctx.closed:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_S)
                    if msg is not None and msg.get("type") == "message":
                        self.on_message(msg["data"].decode(errors="replace"))
            except RETRYABLE as e:
                log.debug("control channel lost (%s)", e)
                lost = True
            finally:
                await self._close(pubsub)
            if lost:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, ctx.settings.backoff_max)

    @staticmethod
    async def _close(pubsub: Any) -> None:
        """Close ``pubsub`` in a task of its own and wait for it at most ``CLOSE_S``.

        redis-py finishes a pub/sub's teardown even when the caller is cancelled, and waits for
        it uncancellably; a teardown that never finishes (a connection stuck mid-close) would
        then hold this task, and the replica's shutdown, forever. Past the bound it is left to
        finish on its own.
        """
        closing = asyncio.ensure_future(pubsub.aclose())
        closing.add_done_callback(_retrieve)
        done, _ = await asyncio.wait({closing}, timeout=CLOSE_S)
        if not done:
            log.warning("control channel: closing the subscription took over %.0fs; left to finish", CLOSE_S)

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
