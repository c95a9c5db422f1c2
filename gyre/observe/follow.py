"""Feeding exporters from the log: once over a finished run, or live beside a running one."""

import threading
from collections.abc import Sequence
from pathlib import Path

from gyre.events.codec import decode
from gyre.events.models import Event, RunFinished
from gyre.log import LogReader
from gyre.observe.exporters import Exporter
from gyre.observe.metrics import KINDS, scalars

FOLLOWED = (*KINDS, RunFinished.kind)


def export_log(log: str | Path, exporters: Sequence[Exporter], *, from_seq: int = 0) -> int:
    """Write every metric of a log to ``exporters`` (not closed here); returns the next seq to read."""
    next_seq = from_seq
    for event in LogReader(log).events(from_seq=from_seq, kinds=KINDS):
        _write(exporters, event)
        assert event.seq is not None
        next_seq = event.seq + 1
    return next_seq


class LogFollower:
    """A thread that follows a log and exports each metric as its event is committed.

    ``close`` stops following, exports whatever was committed since (so an export is complete whether the
    follower kept up or not), closes the exporters and re-raises what the thread failed with, if anything.
    With ``until_finished`` the thread ends by itself after the run's ``run_finished`` event.
    """

    def __init__(self, log: str | Path, exporters: Sequence[Exporter], *, poll_s: float = 0.2,
                 until_finished: bool = False) -> None:
        self.log = Path(log)
        self.exporters = list(exporters)
        self.poll_s = poll_s
        self.until_finished = until_finished
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._next_seq = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gyre-export", daemon=True)

    def start(self) -> "LogFollower":
        self._thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for ``run_finished`` (with ``until_finished``); True when the run finished."""
        return self.finished.wait(timeout_s)

    def _run(self) -> None:
        try:
            reader = LogReader(self.log)
            for batch in reader.follow(from_seq=self._next_seq, kinds=FOLLOWED, poll_s=self.poll_s, stop=self._stop):
                for event in decode(batch):
                    if event.kind == RunFinished.kind:
                        self.finished.set()
                    else:
                        _write(self.exporters, event)
                    assert event.seq is not None
                    self._next_seq = event.seq + 1
                if self.finished.is_set() and self.until_finished:
                    return
        except BaseException as error:  # re-raised by close(), in the caller's thread
            self._error = error
            self.finished.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            if self._error is None:
                self._next_seq = export_log(self.log, self.exporters, from_seq=self._next_seq)
        finally:
            for exporter in self.exporters:
                exporter.close()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> "LogFollower":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write(exporters: Sequence[Exporter], event: Event) -> None:
    values = scalars(event)
    if values:
        for exporter in exporters:
            exporter.write(values)
