"""Where simulated events go: a real Gyre log, memory (tests), or nowhere (benchmarks of the model alone)."""

from pathlib import Path
from typing import Protocol

from gyre.events.models import Event
from gyre.log import LogWriter


class EventSink(Protocol):
    def append(self, events: list[Event]) -> None: ...
    def close(self) -> None: ...


class LogSink:
    """Appends to a fresh log directory; commits once at the end (a simulated run has no crash to survive)."""

    def __init__(self, path: str | Path, run_id: str) -> None:
        path = Path(path)
        if path.exists() and any(path.glob("*.seg")):
            from gyre.errors import ConfigError

            raise ConfigError(f"log directory {path} already holds a log; give an empty or new directory")
        self.writer = LogWriter(path, run_id=run_id)

    def append(self, events: list[Event]) -> None:
        if events:
            self.writer.append(events)

    def close(self) -> None:
        self.writer.close()


class MemorySink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def append(self, events: list[Event]) -> None:
        self.events.extend(events)

    def close(self) -> None:
        pass


class NullSink:
    def append(self, events: list[Event]) -> None:
        pass

    def close(self) -> None:
        pass
