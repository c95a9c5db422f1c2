"""The runner's side of a sandbox's only way out: per-execution Unix sockets relayed to the proxy's TCP port.

A sandboxed harness has no network but loopback. `sandbox_init` listens on the proxy's port inside and
connects each connection to the Unix socket bound into the sandbox; here, one asyncio loop (a thread of
the runner) accepts on every execution's socket and opens a TCP connection to the proxy for each. The
proxy is the one address a sandbox can reach; a socket closed at the execution's end takes its live
connections with it.

Socket paths must fit `sun_path` (108 bytes), so they live in a short private directory under the
system's temporary directory, not beside the (arbitrarily deep) workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import threading
from pathlib import Path

CHUNK = 1 << 16


class ProxyRelay:
    """Forwards connections from per-execution Unix sockets to `host:port` (the proxy)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.dir = Path(tempfile.mkdtemp(prefix="gyre-relay-"))
        os.chmod(self.dir, 0o711)  # sockets are reached by their path only; the listing stays private
        self._names = itertools.count()
        self._servers: dict[Path, tuple[asyncio.AbstractServer, set[asyncio.StreamWriter]]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-proxy-relay", daemon=True)
        self._thread.start()

    def open(self, uid: int | None = None) -> Path:
        """A new socket (owned by `uid`, so that the sandbox's unprivileged process may connect to it)."""
        path = self.dir / f"{next(self._names)}.sock"
        asyncio.run_coroutine_threadsafe(self._open(path), self._loop).result()
        if uid is not None:
            os.chown(path, uid, uid)
        os.chmod(path, 0o600)
        return path

    def close(self, path: Path) -> None:
        """Stop accepting on `path`, cut its live connections and remove it."""
        asyncio.run_coroutine_threadsafe(self._close(path), self._loop).result()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def stop(self) -> None:
        for path in list(self._servers):
            self.close(path)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        with contextlib.suppress(OSError):
            self.dir.rmdir()

    async def _open(self, path: Path) -> None:
        writers: set[asyncio.StreamWriter] = set()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.add(writer)
            try:
                up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                writers.discard(writer)
                writer.close()
                return
            writers.add(up_writer)
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                for w in (writer, up_writer):
                    writers.discard(w)
                    w.close()

        server = await asyncio.start_unix_server(relay, path)
        self._servers[path] = (server, writers)

    async def _close(self, path: Path) -> None:
        entry = self._servers.pop(path, None)
        if entry is None:
            return
        server, writers = entry
        server.close()
        for writer in list(writers):
            writer.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close: an HTTP client may shut its sending side and still read."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
