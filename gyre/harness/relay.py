"""The runner's side of a sandbox's only way out: per-execution Unix sockets relayed to the proxy's TCP port.

A sandboxed harness has no network but loopback. `sandbox_init` listens on the proxy's port inside and
connects each connection to the Unix socket bound into the sandbox; here, one asyncio loop (a thread of
the runner) accepts on every execution's socket and opens a TCP connection to the proxy for each. The
proxy is the one address a sandbox can reach; a socket closed at the execution's end takes its live
connections with it.

Socket paths must fit `sun_path` (108 bytes), so they live in a short private directory under the
system's temporary directory (or /tmp when that is too deep), not beside the (arbitrarily deep) workspace.

The directory's lifetime: each socket goes when its execution ends; the directory goes with `stop`, at the
interpreter's exit when nobody stopped the relay, and, when its process was killed (SIGKILL leaves no
chance to clean up), at the start of the next relay on the host: its name carries its owner's pid and that
process's start time, so a directory whose owner is gone (or whose pid now names another process) is stale.
Trap: pids are those of this PID namespace; runners in other PID namespaces must not share this /tmp (give
each its own TMPDIR), or one would sweep the other's live directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

CHUNK = 1 << 16
PREFIX = "gyre-relay-"
SUN_PATH_MAX = 107
"""`sun_path` is 108 bytes with its terminating NUL."""
SOCKET_NAME_MAX = len("/1048575.sock")


class ProxyRelay:
    """Forwards connections from per-execution Unix sockets to `host:port` (the proxy)."""

    def __init__(self, host: str, port: int, *, tmp_dir: Path | None = None) -> None:
        """`tmp_dir`: where relay directories live (default: the system's temporary directory)."""
        self.host, self.port = host, port
        base = relay_base(tmp_dir)
        sweep_stale(base)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{owner_tag(os.getpid())}-", dir=base))
        os.chmod(self.dir, 0o711)  # sockets are reached by their path only; the listing stays private
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)  # also at exit
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
        self._remove_dir()

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


def relay_base(tmp_dir: Path | None = None) -> Path:
    """Where relay directories go: a socket path below it must fit `sun_path` whatever TMPDIR says."""
    base = Path(tmp_dir or tempfile.gettempdir())
    longest = len(str(base)) + 1 + len(PREFIX) + len(f"{2**22}-{2**64}") + 1 + 8 + SOCKET_NAME_MAX
    return base if longest <= SUN_PATH_MAX else Path("/tmp")


def owner_tag(pid: int) -> str:
    """`pid-starttime`: names one process, even after its pid is reused (the start time is in clock ticks)."""
    return f"{pid}-{start_time(pid) or 0}"


def start_time(pid: int) -> int | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def sweep_stale(base: Path) -> list[Path]:
    """Remove the relay directories under `base` whose owner process is gone; returns what it removed."""
    removed = []
    for path in base.glob(f"{PREFIX}*"):
        fields = path.name[len(PREFIX):].split("-")
        if len(fields) != 3 or not (fields[0].isdigit() and fields[1].isdigit()) or not path.is_dir():
            continue  # not one of ours
        if owner_tag(int(fields[0])) != f"{fields[0]}-{fields[1]}":
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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
