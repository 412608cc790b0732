"""Rank 0's side of the broadcast group: the call to the registered replicas, the members
that answered, and the process group they form with the trainer.

Membership follows the live replicas. Every replica that follows broadcasts registers in
``QueueKeys.weights_members`` (with its worker count and a token new at each start). A group
is formed by a *call*: the sender names a new group id (``wgroup`` field ``call``,
``wgroup <id>`` on pub/sub), each registered replica answers (``QueueKeys.weights_answers``),
and the group is made of those that answered within ``join_window`` seconds (sooner once every
registered replica did), each given its first rank in :attr:`GroupInfo.ranks
<rollq.weightsync.wire.GroupInfo.ranks>`. A registered replica that stays silent is removed
from the members (it registers again when it is back). Before each send
(:meth:`SenderGroup.regroup_reason`) the group is compared with the registered replicas and the
members' consumer leases, and formed anew when one joined, left or died: a replica that starts
while the trainer publishes joins at the next version, no restart.

The broadcast itself is :class:`~rollq.weightsync.trainer.sender.BroadcastSender`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import msgspec
import torch

from ...connection import text
from ...errors import WeightSyncTimeout
from ...protocol import Control, control_message
from ...replicas import heartbeating
from ..process_group import Group, free_port, in_daemon_thread, make_group
from ..wire import GroupInfo, member_workers

log = logging.getLogger(__name__)


class SenderGroup:
    """The broadcast group as rank 0 (the trainer) holds it: its info, process group and
    members (see the module docstring for how it is formed and when it is formed anew).

    The arguments are :class:`~rollq.weightsync.trainer.sender.BroadcastSender`'s of the same names.
    """

    def __init__(
        self, *, num_workers: int, backend: str, host: str, port: int, timeout: float, min_ctas: int,
        join_window: float, device: torch.device,
    ):
        self.num_workers = num_workers
        self.backend = backend
        self.host = host
        self.port = port
        self.timeout = timeout
        self.min_ctas = min_ctas
        self.join_window = join_window
        self.device = device
        self.info: GroupInfo | None = None
        self.pg: Group | None = None
        #: The current group's members: ``{replica id: workers}``.
        self.members: dict[str, int] = {}
        self._entries: dict[str, str] = {}  # their registrations (a restart changes its entry)
        #: A member failed to ack: form the group anew before the next send.
        self.stale = False

    @property
    def workers(self) -> int:
        """Workers in the current group (ranks other than this one)."""
        return sum(self.members.values())

    async def open(self, client: Any, keys: Any) -> GroupInfo:
        """Call the replicas, form the group of those that answered, and wait (``timeout``)
        until every one of their workers has joined it."""
        gid = uuid.uuid4().hex[:12]
        entries = await self._call(client, keys, gid)
        members = {r: member_workers(e) for r, e in entries.items()}
        ranks, world = {}, 1
        for r in sorted(members):
            ranks[r], world = world, world + members[r]
        info = GroupInfo(
            id=gid, host=self.host, port=self.port or free_port(self.host), world_size=world, backend=self.backend,
            timeout=self.timeout, min_ctas=self.min_ctas, ranks=ranks,
        )
        pipe = client.pipeline(transaction=False)
        pipe.delete(keys.weights_layouts)  # the members report their layouts anew
        pipe.hset(keys.weights_group, mapping={"d": msgspec.msgpack.encode(info)})
        pipe.execute_command("PUBLISH", keys.control, control_message(Control.WGROUP, info.id))
        await pipe.execute()
        try:
            self.pg = await asyncio.wait_for(in_daemon_thread(self._form, info), self.timeout + 5)
        except (asyncio.TimeoutError, RuntimeError) as e:
            await client.delete(keys.weights_group)
            raise WeightSyncTimeout(
                f"{world - 1} workers of {len(members)} replicas did not all join broadcast group {gid} within {self.timeout}s (timeout)"
            ) from e
        self.info, self.members, self._entries, self.stale = info, members, entries, False
        log.info("broadcast group %s ready: %d workers of %d replicas over %s", gid, world - 1, len(members), self.backend)
        return info

    async def _call(self, client: Any, keys: Any, gid: str) -> dict[str, str]:
        """Call the registered replicas to group ``gid``; the entries (:func:`~rollq.weightsync.
        wire.member_entry`) of those that answered (see the module docstring). The silent ones
        are unregistered."""
        expected = await self.registered(client, keys)
        answers = keys.weights_answers(gid)
        pipe = client.pipeline(transaction=False)
        pipe.delete(keys.weights_group)
        pipe.hset(keys.weights_group, mapping={"call": gid})
        pipe.execute_command("PUBLISH", keys.control, control_message(Control.WGROUP, gid))
        await pipe.execute()
        need = max(1, self.num_workers)
        t0 = time.monotonic()
        # without an expected count the call lasts at most the join window
        deadline = t0 + (self.timeout if self.num_workers else self.join_window)
        while True:
            got = {text(k): text(v) for k, v in (await client.hgetall(answers)).items()}
            workers = sum(member_workers(e) for e in got.values())
            now = time.monotonic()
            if workers >= need and (expected.keys() <= got.keys() or now >= t0 + self.join_window):
                break
            if now >= deadline:
                await client.delete(keys.weights_group)
                setting = "num_workers, timeout" if self.num_workers else "join_window"
                raise WeightSyncTimeout(
                    f"{workers} workers of {len(got)} replicas answered the call of broadcast group {gid} "
                    f"within {deadline - t0:.1f}s, {need} needed ({len(expected)} replicas registered; BroadcastSender {setting})"
                )
            await asyncio.sleep(0.02)
        silent = sorted(expected.keys() - got.keys())
        pipe = client.pipeline(transaction=False)
        pipe.expire(answers, 600)  # late answers may still come
        if silent:
            pipe.hdel(keys.weights_members, *silent)
        await pipe.execute()
        if silent:
            log.warning("replicas %s did not answer the call of broadcast group %s within %.1fs (join_window); left out",
                        ", ".join(r[:64] for r in silent[:5]), gid, self.join_window)
        return got

    async def registered(self, client: Any, keys: Any) -> dict[str, str]:
        """The replicas registered as following broadcasts: ``{replica: entry}``
        (:func:`~rollq.weightsync.wire.member_entry`)."""
        return {text(k): text(v) for k, v in (await client.hgetall(keys.weights_members)).items()}

    async def regroup_reason(self, client: Any, keys: Any) -> str | None:
        """Why the group must be formed (again) before the next send; None: it is current."""
        if self.pg is None:
            return "no group"
        if self.stale:
            return "a member did not ack the last version"
        now = await self.registered(client, keys)
        if now != self._entries:
            joined, left = sorted(now.keys() - self._entries.keys()), sorted(self._entries.keys() - now.keys())
            again = sorted(r for r in now.keys() & self._entries.keys() if now[r] != self._entries[r])
            return f"members changed (joined: {joined or '-'}, left: {left or '-'}, restarted: {again or '-'})"
        names = list(self.members)
        pipe = client.pipeline(transaction=False)
        for n in names:
            pipe.hexists(keys.consumers, n)
        entries = await pipe.execute()
        # a replica still loading its first version has no consumer entry yet (or an old one
        # of the same id): the group's call, which a dead one does not answer, settles it
        dead = [n for n, e, alive in zip(names, entries, await heartbeating(client, keys, names)) if e and not alive]
        if dead:
            return f"consumer leases expired: {', '.join(n[:64] for n in dead[:5])}"
        return None

    def _form(self, info: GroupInfo) -> Group:
        pg = make_group(info, 0, self.device)
        pg.prove(self.device, info.timeout)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return pg

    async def reset(self) -> None:
        """Drop the group (after a failure); the next send forms a new one."""
        pg, self.pg, self.info, self.members, self._entries, self.stale = self.pg, None, None, {}, {}, False
        if pg is not None:
            await in_daemon_thread(pg.destroy)

    def close(self) -> None:
        """Forget the group without destroying it (the process is ending)."""
        self.pg = None
