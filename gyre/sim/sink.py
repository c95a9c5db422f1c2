"""Where simulated events go: a real Gyre log, memory (tests), or nowhere (benchmarks of the model alone)."""

from pathlib import Path
from typing import Protocol

from gyre.events.models import Event
from gyre.log import LogWriter


class EventSink(Protocol):
    def append(self, events: list[Event]) -> None: ...
    def close(self) -> None: ...


class LogSink:
    """Appends to a fresh log directory. It asks for a commit every ``COMMIT_EVENTS`` events without
    waiting for it (a simulated run has no crash to survive, but its events reach the disk in bounded
    frames as it goes, instead of one frame of the whole run at the end) and commits the rest on close."""

    COMMIT_EVENTS = 16_384

    def __init__(self, path: str | Path, run_id: str) -> None:
        path = Path(path)
        if path.exists() and any(path.glob("*.seg")):
            from gyre.errors import ConfigError

            raise ConfigError(f"log directory {path} already holds a log; give an empty or new directory")
        self.writer = LogWriter(path, run_id=run_id)
        self._uncommitted = 0

    def append(self, events: list[Event]) -> None:
        if events:
            self.writer.append(events)
            self._uncommitted += len(events)
            if self._uncommitted >= self.COMMIT_EVENTS:
                self.writer.commit(wait=False)
                self._uncommitted = 0

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
