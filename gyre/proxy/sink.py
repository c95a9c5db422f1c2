"""Where the proxy records events. The contract: `record` orders, `durable` waits for the disk.

A call's `model_call_finished` must be durable before the harness gets the response (an acknowledged call
is never lost), yet the latency benchmark counts every microsecond. `LogSink` therefore appends in the
caller's thread (cheap: the writer only buffers) and leaves fsyncs to one committer thread that commits
everything pending at once (group commit): with many calls finishing together, one fsync covers them all.
Events nobody waits for (`model_call_started`, `call_redirected`) ride along with the next commit, or are
committed within `flush_interval_s`: one commit per call instead of two.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Protocol, runtime_checkable

from gyre.errors import LogError
from gyre.events.models import Event
from gyre.log.writer import LogWriter

log = logging.getLogger(__name__)


@runtime_checkable
class CallSink(Protocol):
    """Ordered, durable recording of proxy events."""

    def record(self, event: Event) -> int:
        """Buffer `event` after everything recorded before it; returns its position (the log seq)."""
        ...

    async def durable(self, position: int) -> None:
        """Return once the event at `position`, and all before it, is durable; raise if it cannot be."""
        ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps events in a list (tests, and embedding without a log); `durable` returns at once."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def record(self, event: Event) -> int:
        with self._lock:
            self.events.append(event)
            return len(self.events) - 1

    async def durable(self, position: int) -> None:
        return None

    def close(self) -> None:
        return None


class LogSink:
    """Records into a `LogWriter`; a committer thread group-commits and wakes the waiting calls."""

    def __init__(self, writer: LogWriter, *, close_writer: bool = True, flush_interval_s: float = 0.2) -> None:
        self.writer = writer
        self.flush_interval_s = flush_interval_s
        self._close_writer = close_writer
        self._cond = threading.Condition()
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._pending = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gyre-proxy-committer", daemon=True)
        self._thread.start()

    def record(self, event: Event) -> int:
        return self.writer.append(event).last

    async def durable(self, position: int) -> None:
        if self.writer.durable_seq >= position:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._error is not None:
                raise LogError(f"the proxy's log committer failed: {self._error!r}") from self._error
            self._waiters.append((position, loop, future))
            self._pending = True
            self._cond.notify()
        await future

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(self.flush_interval_s)
                if self._closed and not self._waiters and self.writer.durable_seq >= self.writer.next_seq - 1:
                    return
                self._pending = False
            if self.writer.durable_seq >= self.writer.next_seq - 1:
                continue
            try:
                durable = self.writer.commit()
            except LogError as e:  # the writer is closed or failed: every waiter must learn it
                log.error("proxy log commit failed: %r", e)
                self._fail(e)
                return
            self._wake(durable)

    def _wake(self, durable: int) -> None:
        with self._cond:
            ready = [w for w in self._waiters if w[0] <= durable]
            self._waiters = [w for w in self._waiters if w[0] > durable]
        for _, loop, future in ready:
            _call_in(loop, future, None)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            waiters, self._waiters = self._waiters, []
        failure = LogError(f"the proxy's log committer failed: {error!r}")
        for _, loop, future in waiters:
            _call_in(loop, future, failure)

    def close(self) -> None:
        """Commit what is pending, stop the committer, and close the writer if this sink owns it."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        if self._close_writer:
            self.writer.close()


def _call_in(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, future, error)
    except RuntimeError:  # that loop is closed: its server stopped and nobody waits any more
        return


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
