"""A TCP proxy in the test process that can take a database "down" for the workers behind it.

Point the workers' ``leases_database_url`` at ``127.0.0.1:<proxy.port>``: ``stop()`` refuses new
connections and cuts the open ones, like the database going down, without touching the server
other tests use; ``start()`` brings it back on the same port.

``blackhole()`` cuts the network instead, as a partition does: the open connections stay open
but no byte goes through them, in either direction, and a new connection is accepted but not
taken to the server. Nothing is dropped: what the client and the server send meanwhile
(statements, replies, a close) is held, and ``heal()`` delivers it late, in order, then
forwards as usual (new connections go on to the server then). So a worker behind it sees no
error, only statements that never answer, and its writes sent during the partition land after
it heals: the worst case for fencing. ``stop()`` during a black hole cuts every connection
(what was held is dropped) and ends the black hole.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any


class TcpProxy:
    """A TCP forwarder on 127.0.0.1 to ``target`` that can be stopped (every connection is
    refused or cut) and started again on the same port, or black-holed (every connection held,
    nothing forwarded) and healed."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._streams: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())

    def blackhole(self) -> None:
        """Forward nothing more, either way, until :meth:`heal`; hold what arrives."""
        self._call(self._set_flowing(False))

    def heal(self) -> None:
        """Deliver what the black hole held, and forward as usual again."""
        self._call(self._set_flowing(True))

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _set_flowing(self, flowing: bool) -> None:
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._forward, "127.0.0.1", self.port, reuse_address=True
            )

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for stream in list(self._streams):
            stream.transport.abort()
        self._flowing.set()  # the held data's connections are cut: nothing of it is sent
        while self._streams:
            await asyncio.sleep(0.01)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._streams.add(writer)
        await self._flowing.wait()  # a black hole holds a new connection too
        upstream = None
        if not writer.transport.is_closing():
            with contextlib.suppress(OSError):
                upstream = await asyncio.open_connection(*self.target)
        if upstream is None:
            writer.transport.abort()
            self._streams.discard(writer)
            return
        up_reader, up_writer = upstream
        self._streams.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._streams -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while True:
                try:
                    data = await reader.read(65536)
                except OSError:
                    data = b""  # a reset is held by a black hole too, as the end of the stream
                await self._flowing.wait()
                if not data or writer.transport.is_closing():
                    break
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
