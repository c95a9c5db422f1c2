"""Where the runner sends its events. A protocol, so the runner is testable without a log.

Any object with `record(event)` fits, including the proxy's `LogSink` (which returns the seq): the runner
ignores the return value, so one log writer can serve the proxy and the runner alike.
"""

from __future__ import annotations

import threading
from typing import Protocol, TypeVar, runtime_checkable

from gyre.events.models import Event
from gyre.log.writer import LogWriter

E = TypeVar("E", bound=Event)


@runtime_checkable
class EventSink(Protocol):
    """Records events in the order of the calls; safe to call from several threads."""

    def record(self, event: Event) -> object: ...


class MemorySink:
    """Events in a list: tests and embedding without a log."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def record(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def of(self, kind: type[E], execution_id: str | None = None) -> list[E]:
        """The recorded events of one type (and execution), in order."""
        return [e for e in self.events
                if isinstance(e, kind) and (execution_id is None or e.execution_id == execution_id)]


class LogSink:
    """Appends to a `LogWriter` and commits each event before `record` returns.

    Execution events are few (a handful per execution, minutes apart), so an fsync each costs nothing that
    matters, and the writer's group commit merges those of concurrent executions.
    """

    def __init__(self, writer: LogWriter) -> None:
        self.writer = writer

    def record(self, event: Event) -> int:
        seq = self.writer.append(event).last
        self.writer.commit(seq)
        return seq
