"""A TCP proxy in the test process that can take a database "down" for the workers behind it.

Point the workers' ``leases_database_url`` at ``127.0.0.1:<proxy.port>``: ``stop()`` refuses new
connections and cuts the open ones, like the database going down, without touching the server
other tests use; ``start()`` brings it back on the same port.
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
    refused or cut) and started again on the same port."""

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

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

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
        while self._streams:
            await asyncio.sleep(0.01)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._streams.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self._streams.discard(writer)
            return
        self._streams.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._streams -= {writer, up_writer}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
