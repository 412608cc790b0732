"""Reading a producer's result stream (``QueueKeys.results``) and delivering what it holds.

One task per producer reads the stream with a blocking XREAD, hands each result to the
:class:`~rollq.producer.handles.Ledger`, and deletes the entries it has taken, so Redis
keeps nothing once a result is consumed. The deletion of one batch travels in the same
round trip as the next blocking read.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import msgpack
from redis.exceptions import ResponseError

from ..connection import RETRYABLE, Client, deadline
from ..protocol import Result, decode_result

log = logging.getLogger(__name__)

#: Milliseconds one XREAD blocks for.
READ_BLOCK_MS = 1000
#: Backoff between failed reads: first delay and cap, in seconds.
READ_BACKOFF = (0.05, 5.0)


class ResultReader:
    """Reads ``key`` on ``client`` until :meth:`stop`, handing each result to ``deliver``
    and setting ``arrived`` after each batch.

    ``client`` returns XREAD's reply unparsed (``connection.raw_replies``): a list of
    ``[stream, [[entry id, [field, value, ...]], ...]]`` (a dict of streams on RESP3). On one
    server the reader keeps a connection of its own and writes XDEL + XREAD as one packet,
    without redis-py's pipeline machinery; a ``cluster`` client pipelines them.
    """

    def __init__(self, client: Client, key: str, *, count: int, command_timeout: float, cluster: bool,
                 deliver: Callable[[Result], None], arrived: asyncio.Event):
        self.client = client
        self.key = key
        self.count = count
        self.cluster = cluster
        self.deliver = deliver
        self.arrived = arrived
        self.read_deadline = deadline(1.0 + command_timeout, "a blocking read of the result stream")
        self.stopped = False

    def stop(self) -> None:
        """Read no more (the task is cancelled by its owner)."""
        self.stopped = True

    async def run(self) -> None:
        last = b"0-0"
        backoff = READ_BACKOFF[0]
        taken: list[bytes] = []
        conn = None
        try:
            while not self.stopped:
                try:
                    async with self.read_deadline:
                        if not self.cluster:
                            if conn is None:
                                conn = await self.client.connection_pool.get_connection()
                            resp = await self._read_once(conn, last, taken)
                        else:
                            resp = await self._read_pipelined(last, taken)
                    taken = []
                    backoff = READ_BACKOFF[0]
                except (*RETRYABLE, ResponseError) as e:
                    log.warning("result stream read failed (%s); retrying in %.2fs", e, backoff)
                    if conn is not None:
                        await conn.disconnect()  # replies may be left unread: start clean
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, READ_BACKOFF[1])
                    continue
                last = self._take(resp, taken) or last
                if resp:
                    # Let the tasks waiting for these results run before the next read is
                    # sent: they are the latency that counts; the read can go a moment later.
                    await asyncio.sleep(0)
        finally:
            if conn is not None:
                await self.client.connection_pool.release(conn)

    async def _read_once(self, conn: Any, last: bytes, taken: list[bytes]) -> Any:
        """XDEL what was taken (if any) and a blocking XREAD, in one write; the XREAD's reply."""
        key = self.key
        cmds: list[tuple[Any, ...]] = [("XDEL", key, *taken)] if taken else []
        cmds.append(("XREAD", "COUNT", self.count, "BLOCK", READ_BLOCK_MS, "STREAMS", key, last))
        await conn.send_packed_command(conn.pack_commands(cmds))
        if taken:
            await conn.read_response()
        return await conn.read_response()

    async def _read_pipelined(self, last: bytes, taken: list[bytes]) -> Any:
        """XDEL what was taken (if any) and a blocking XREAD, pipelined (a cluster client)."""
        if not taken:
            return await self.client.xread({self.key: last}, count=self.count, block=READ_BLOCK_MS)
        pipe = self.client.pipeline(transaction=False)
        pipe.xdel(self.key, *taken)
        pipe.xread({self.key: last}, count=self.count, block=READ_BLOCK_MS)
        return (await pipe.execute())[-1]

    def _take(self, resp: Any, taken: list[bytes]) -> bytes | None:
        """Deliver the results of an XREAD reply; returns the last entry id read."""
        if not resp:
            return None
        deliver = self.deliver
        for _, entries in resp.items() if isinstance(resp, dict) else resp:
            for eid, fields in entries:
                taken.append(eid)
                try:
                    if type(fields) is dict:  # a client that parsed the reply anyway
                        fields = [x for kv in fields.items() for x in kv]
                    if fields[0] == b"d":
                        deliver(decode_result(fields[1]))
                    else:
                        for data in msgpack.unpackb(fields[1], raw=True):
                            deliver(decode_result(data))
                except Exception as e:  # a corrupt result must not stop the reader
                    log.error("dropping unreadable result entry %s: %s", eid, e)
        self.arrived.set()
        return taken[-1] if taken else None
