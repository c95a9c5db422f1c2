"""A hub over a real `LogSink` in a temporary log, and links to it, over real gRPC on 127.0.0.1; and a failed test's
run directory kept out of pytest's rotation (`tests.cluster.kept`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gyre import auth
from gyre.cluster.hub import Hub
from gyre.cluster.link import ControllerLink
from gyre.cluster.proto import gyre_pb2
from gyre.events.models import Event
from gyre.log import LogReader
from gyre.log.writer import LogWriter
from gyre.sink import LogSink
from tests.cluster.kept import KEEP_ON_FAILURE, kept_copy

RUN_ID = "run-1"


class GatedSink(LogSink):
    """A `LogSink` whose durable acknowledgements wait for ``gate`` (batches stay un-acked while it is shut)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    async def durable(self, position: int) -> None:
        if not self.gate.is_set():
            await asyncio.to_thread(self.gate.wait)
        await super().durable(position)


class Cluster:
    """One hub and the links a test opens; `close` tears everything down in order."""

    def __init__(self, path: Path, **hub_options: Any) -> None:
        self.path = path / "log"
        self.recorded = threading.Condition()
        self.count = 0
        self.sink = GatedSink.create(self.path, RUN_ID, on_record=self._on_record)
        self.secret = auth.mint(auth.RUN_PREFIX)
        self.hub = Hub(self.sink, run_id=RUN_ID, secret=self.secret, **hub_options)
        self.address = self.hub.start()
        self.links: list[ControllerLink] = []

    def _on_record(self, first: int, events: list[Event]) -> None:
        with self.recorded:
            self.count += len(events)
            self.recorded.notify_all()

    def wait_recorded(self, count: int, timeout_s: float = 5.0) -> None:
        """Until the hub's sink has appended ``count`` events in all."""
        with self.recorded:
            assert self.recorded.wait_for(lambda: self.count >= count, timeout_s), (
                f"the sink appended {self.count} events, not {count}")

    def link(self, cell_id: str = "c0", *, handler: Callable[[Any], Mapping[str, float] | None] | None = None,
             producers: tuple[str, ...] | None = None, incarnation: str = "", start: bool = True,
             secret: str | None = None, **options: Any) -> ControllerLink:
        hello = gyre_pb2.CellHello(cell_id=cell_id, slots=2, incarnation=incarnation,
                                   producers=list(producers if producers is not None else (cell_id,)))
        link = ControllerLink(self.address, secret=secret or self.secret, hello=hello,
                              handler=handler or (lambda command: None), **options)
        self.links.append(link)
        if start:
            link.start()
        return link

    def restart(self) -> None:
        """A controller crash and resume: a new sink over the same log (its producer table read back from it)
        and a new hub on the same port."""
        self.hub.stop()
        self.sink.close()
        self.sink = GatedSink(LogWriter(self.path, run_id=RUN_ID), on_record=self._on_record)
        self.hub = Hub(self.sink, run_id=RUN_ID, secret=self.secret, port=int(self.address.rsplit(":", 1)[1]))
        self.hub.start()

    def events(self) -> list[Event]:
        self.sink.commit()
        return list(LogReader(self.path).events())

    def close(self) -> None:
        self.sink.gate.set()
        for link in self.links:
            link.close(timeout_s=5)
        self.hub.stop()
        self.sink.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path)
    yield made
    made.close()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**hub_options: Any) -> Cluster:
        made.append(Cluster(tmp_path, **hub_options))
        return made[-1]

    yield make
    for each in made:
        each.close()


# -- a failed run kept (`tests.cluster.kept`) ---------------------------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    module = item.getparent(pytest.Module)
    root = module.stash.get(KEEP_ON_FAILURE, None) if module is not None else None
    if report.failed and root is not None and root.exists():
        report.sections.append(("kept run directory", str(kept_copy(root))))
    return report
