"""Reading a producer's result streams (``QueueKeys.results``) and delivering what they hold.

A producer has one result stream in each shard of its queue (a replica writes a job's result
in the job's shard, rollq/shards.py). On one server one task reads all of them with one
blocking XREAD (one stream when the queue has one shard); on a cluster the shards live in
different slots, so the producer runs one reader per shard. Each reader hands each result to
the :class:`~rollq.producer._handles.Ledger` and deletes the entries it has taken, so Redis
keeps nothing once a result is consumed. The deletion of one batch travels in the same round
trip as the next blocking read.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import msgpack
from redis.exceptions import ResponseError

from ..connection import RETRYABLE, Client, deadline
from ..protocol import Result, decode_result

log = logging.getLogger(__name__)

#: Milliseconds one XREAD blocks for.
READ_BLOCK_MS = 1000
#: Backoff between failed reads while Redis does not answer: first delay and cap, in seconds.
READ_BACKOFF = (0.05, 5.0)
#: Most seconds between reads once Redis answers (the failed read had its connection): after
#: a run of cut connections, results flow again within this of the last cut. While a longer
#: backoff runs, Redis is asked this often whether it answers again (one server).
ANSWERED_BACKOFF = 0.2


class ResultReader:
    """Reads the streams ``keys`` on ``client`` until :meth:`stop`, handing each result to
    ``deliver`` and setting ``arrived`` after each batch (on a ``cluster`` client, ``keys``
    must share one slot: one shard's stream).

    ``client`` returns XREAD's reply unparsed (``connection.raw_replies``): a list of
    ``[stream, [[entry id, [field, value, ...]], ...]]`` (a dict of streams on RESP3). On one
    server the reader keeps a connection of its own and writes XDEL + XREAD as one packet,
    without redis-py's pipeline machinery; a ``cluster`` client pipelines them.
    """

    def __init__(self, client: Client, keys: Sequence[str], *, count: int, command_timeout: float, cluster: bool,
                 deliver: Callable[[Result], None], arrived: asyncio.Event):
        self.client = client
        self.keys = list(keys)
        # XREAD names each stream of its reply (bytes on these unparsed replies).
        self._names = {k.encode(): k for k in self.keys}
        self.count = count
        self.cluster = cluster
        self.deliver = deliver
        self.arrived = arrived
        self.read_deadline = deadline(1.0 + command_timeout, "a blocking read of the result stream(s)")
        self.stopped = False
        #: Seconds to wait after the next failed read (see :meth:`_failed`).
        self.delay = READ_BACKOFF[0]
        self._answered = False  # the current read's connection was made (Redis answered)

    def stop(self) -> None:
        """Read no more (the task is cancelled by its owner)."""
        self.stopped = True

    async def run(self) -> None:
        last = dict.fromkeys(self.keys, b"0-0")  # stream -> last entry id read
        taken: dict[str, list[bytes]] = {}  # stream -> entries delivered, to delete
        conn = None
        try:
            while not self.stopped:
                self._answered = False
                try:
                    async with self.read_deadline:
                        if not self.cluster:
                            if conn is None:
                                conn = await self.client.connection_pool.get_connection()
                            resp = await self._read_once(conn, last, taken)
                        else:
                            resp = await self._read_pipelined(last, taken)
                    taken = {}
                    self.delay = READ_BACKOFF[0]
                except (*RETRYABLE, ResponseError) as e:
                    delay = self._failed()
                    log.warning("result stream read failed (%s); retrying in %.2fs", e, delay)
                    if conn is not None:
                        await conn.disconnect()  # replies may be left unread: start clean
                    await self._wait(delay, conn)
                    continue
                except Exception:
                    # Anything else (a client library's own error): a reader that ended here
                    # would leave its streams' results unread for good, so it reads on.
                    delay = self._failed()
                    log.exception("result stream read of %s failed unexpectedly; retrying in %.2fs", self.keys, delay)
                    if conn is not None:
                        await conn.disconnect()
                    await self._wait(delay, conn)
                    continue
                self._take(resp, taken, last)
                if resp:
                    # Let the tasks waiting for these results run before the next read is
                    # sent: they are the latency that counts; the read can go a moment later.
                    await asyncio.sleep(0)
        finally:
            if conn is not None:
                await self.client.connection_pool.release(conn)

    def _failed(self) -> float:
        """The wait after a failed read; sets :attr:`delay` for the next one. It doubles from
        ``READ_BACKOFF[0]`` up to ``READ_BACKOFF[1]`` while Redis does not answer; once it
        answers (the read had its connection and was cut, or timed out), it is at most
        :data:`ANSWERED_BACKOFF`, so a long run of cuts leaves no long wait behind."""
        if self._answered:
            delay = min(self.delay, ANSWERED_BACKOFF)
            self.delay = min(2 * delay, ANSWERED_BACKOFF)
        else:
            delay = self.delay
            self.delay = min(2 * delay, READ_BACKOFF[1])
        return delay

    async def _wait(self, delay: float, conn: Any) -> None:
        """Sleep ``delay`` seconds; on one server, ask every :data:`ANSWERED_BACKOFF` seconds
        whether Redis answers again (a connection), and end the wait once it does."""
        loop = asyncio.get_running_loop()
        end = loop.time() + delay
        while (left := end - loop.time()) > 0:
            await asyncio.sleep(min(left, ANSWERED_BACKOFF))
            if conn is None or loop.time() >= end:
                continue
            try:
                await conn.connect()
            except RETRYABLE:
                continue
            self.delay = min(self.delay, ANSWERED_BACKOFF)
            return

    async def _read_once(self, conn: Any, last: dict[str, bytes], taken: dict[str, list[bytes]]) -> Any:
        """XDEL what was taken (one per stream, if any) and a blocking XREAD of every stream,
        in one write; the XREAD's reply."""
        cmds: list[tuple[Any, ...]] = [("XDEL", key, *eids) for key, eids in taken.items()]
        cmds.append(("XREAD", "COUNT", self.count, "BLOCK", READ_BLOCK_MS, "STREAMS", *last, *last.values()))
        await conn.send_packed_command(conn.pack_commands(cmds))
        self._answered = True  # connected (handshake done) and sent: a failure now is a cut
        for _ in taken:
            await conn.read_response()
        return await conn.read_response()

    async def _read_pipelined(self, last: dict[str, bytes], taken: dict[str, list[bytes]]) -> Any:
        """XDEL what was taken (if any) and a blocking XREAD, pipelined (a cluster client)."""
        if not taken:
            return await self.client.xread(last, count=self.count, block=READ_BLOCK_MS)
        pipe = self.client.pipeline(transaction=False)
        for key, eids in taken.items():
            pipe.xdel(key, *eids)
        pipe.xread(last, count=self.count, block=READ_BLOCK_MS)
        return (await pipe.execute())[-1]

    def _take(self, resp: Any, taken: dict[str, list[bytes]], last: dict[str, bytes]) -> None:
        """Deliver the results of an XREAD reply; note what was read in ``taken`` and the
        last entry id read of each stream in ``last``."""
        if not resp:
            return
        deliver = self.deliver
        for name, entries in resp.items() if isinstance(resp, dict) else resp:
            if not entries:
                continue
            key = self._names.get(name) or (name.decode() if isinstance(name, bytes) else name)
            got = taken.setdefault(key, [])
            for eid, fields in entries:
                got.append(eid)
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
            last[key] = got[-1]
        self.arrived.set()
