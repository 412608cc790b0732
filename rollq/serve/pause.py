"""``POST /pause`` and ``/resume`` of ``rollq serve``: a gate on this server's submissions.

vLLM's ``/pause`` stops its scheduler; rollq's replicas are behind a queue and apply weight
updates by the queue's own policy (``keep``, ``abort``, ``drain``), so ``rollq serve`` pauses
what it owns: while paused, requests that arrive wait at the door (accepted, not submitted)
until ``/resume``, as vLLM's paused scheduler holds new requests. The ``mode`` acts on the
jobs this server has in flight: ``keep`` leaves them running, ``wait`` answers once they
finished, ``abort`` cancels them (their requests answer with the job's cancellation error, not
vLLM's partial output with ``finish_reason="abort"``). Other clients of the queue are not
paused.

>>> gate = Gate()
>>> gate.paused
False
"""

from __future__ import annotations

import asyncio
from typing import Any

from .responses import cancel_all

#: vLLM's ``PauseMode`` values.
PAUSE_MODES = ("abort", "wait", "keep")
_POLL_S = 0.05


class Gate:
    """The pause state and the jobs this server has in flight."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._inflight: set[Any] = set()
        self._pruned_at = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def wait_open(self) -> None:
        """Return at once unless paused; else when ``resume`` is called."""
        await self._open.wait()

    def track(self, handle: Any) -> None:
        """Note a submitted job (a :class:`~rollq.producer.JobHandle`); finished ones are
        dropped as the set grows, so it stays about the size of what runs."""
        self._inflight.add(handle)
        if len(self._inflight) > 2 * self._pruned_at + 64:
            self._inflight = {h for h in self._inflight if not h.done()}
            self._pruned_at = len(self._inflight)

    def running(self) -> list[Any]:
        return [h for h in self._inflight if not h.done()]

    async def pause(self, mode: str) -> None:
        """Close the gate, then act on the jobs in flight by ``mode`` (see the module doc)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode[:40]!r}")
        self._open.clear()
        if mode == "abort":
            await cancel_all(self.running())
        elif mode == "wait":
            while self.running():
                await asyncio.sleep(_POLL_S)

    def resume(self) -> None:
        self._open.set()
