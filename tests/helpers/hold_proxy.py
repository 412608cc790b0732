"""A loopback TCP proxy that holds a client's requests once they carry a given byte string,
so a test can see a process block at a known point of its Redis traffic and kill it there.

    proxy = await HoldProxy(redis_port, MIRROR_VERSION.sha).start()
    # ... a process connects to proxy.url and sends EVALSHA <sha> ...
    await proxy.held.wait()   # the request never reached Redis; the process waits for its reply

The chunk that carries the pattern, and everything that connection sends after it, is never
forwarded (Redis drops a partial command when the connection closes). Replies flow as usual.
"""

from __future__ import annotations

import asyncio


class HoldProxy:
    """Forwards to ``127.0.0.1:upstream_port`` until a client sends ``pattern``."""

    def __init__(self, upstream_port: int, pattern: bytes):
        self.upstream_port = upstream_port
        self.pattern = pattern
        #: Set once a connection sent ``pattern`` (and it was held back).
        self.held = asyncio.Event()
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> HoldProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_w}

        async def requests() -> None:
            tail = b""  # the pattern may straddle two reads
            try:
                while data := await reader.read(65536):
                    if self.pattern in tail + data:
                        self.held.set()
                        await reader.read(-1)  # swallow the rest until the client goes
                        return
                    tail = (tail + data)[-len(self.pattern):]
                    up_w.write(data)
                    await up_w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                up_w.close()

        async def replies() -> None:
            try:
                while data := await up_r.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        try:
            await asyncio.gather(requests(), replies())
        finally:
            self._writers -= {writer, up_w}

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                if w.transport is not None:
                    w.transport.abort()
            await self._server.wait_closed()
            self._server = None
