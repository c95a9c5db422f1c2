"""The cluster's membership thread (`gyre.cluster.run.Cluster`): what the hub reports while the run starts is
applied, in order, once it has started, against what the start recorded — over a fake hub and supervisor."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gyre.cluster.actuator import Commands
from gyre.cluster.proto import gyre_pb2
from gyre.cluster.run import Cluster
from gyre.events.models import CellLost, CellRegistered
from tests.cluster.test_failures import FakeHub, ListSink


class Supervisor:
    def __init__(self) -> None:
        self.killed: list[str] = []

    def starts(self, name: str) -> int:
        return 1

    def said_hello(self, name: str) -> None:
        pass

    def kill(self, name: str) -> None:
        self.killed.append(name)


def _started_cluster(registered: dict[str, str]) -> tuple[Cluster, ListSink, list[str]]:
    """A cluster whose start recorded ``registered`` (cell -> incarnation; c0 the core), not started yet."""
    sink = ListSink()
    sink.record([CellRegistered(cell_id=c, role="rollout", is_core=c == "c0", slots=2, incarnation=inc)
                 for c, inc in registered.items()])
    sink.events.clear()
    forgotten: list[str] = []
    cluster = Cluster()
    cluster.live, cluster.membership_sink, cluster.supervisor = sink.live, sink, Supervisor()  # type: ignore[assignment]
    cluster.controller = SimpleNamespace(cells={}, fail=lambda error: forgotten.append(f"failed: {error}"),  # type: ignore[assignment]
                                         forget_training=lambda: forgotten.append("training"))
    cluster.progress = lambda *args: None  # type: ignore[assignment]
    cluster.commands = Commands(FakeHub(), sink.live, sink)  # type: ignore[arg-type]
    cluster._open_membership()
    return cluster, sink, forgotten


def _drain(cluster: Cluster) -> None:
    done = threading.Event()
    cluster._membership.put(done.set)
    assert done.wait(10), "the membership thread did not finish"
    cluster.close()


def _hello(cell_id: str, incarnation: str) -> gyre_pb2.CellHello:
    return gyre_pb2.CellHello(cell_id=cell_id, incarnation=incarnation, is_core=cell_id == "c0", slots=2)


def test_a_core_lost_while_the_run_starts_is_recorded_lost_once_it_has() -> None:
    """Chaos seed 8: the core died while a resumed controller reattached; the loss the hub reported then was
    dropped, and the policy paused the dead core 1,108 times until its successor said hello."""
    cluster, sink, forgotten = _started_cluster({"c0": "core-a", "c1": "c1-a"})
    cluster._on_cell_hello(_hello("c0", "core-a"))
    cluster._on_cell_hello(_hello("c1", "c1-a"))
    cluster._on_cell_lost("c0", "its process exited with status -9")
    assert sink.events == []  # held until the start is over
    cluster._started.set()
    _drain(cluster)
    [lost] = sink.events
    assert isinstance(lost, CellLost) and lost.cell_id == "c0" and forgotten == ["training"]
    assert sink.live.cell("c0").lost and not sink.live.cell("c1").lost  # type: ignore[union-attr]
    assert cluster.supervisor.killed == ["c0"]  # type: ignore[union-attr]


def test_a_hello_overtaken_while_the_run_starts_does_not_lose_its_successor() -> None:
    """c1 restarted while the run started, which registered its second incarnation: the first one's hello,
    applied late, neither registers it again nor declares the second one replaced."""
    cluster, sink, forgotten = _started_cluster({"c0": "core-a", "c1": "c1-b"})
    cluster._on_cell_hello(_hello("c1", "c1-a"))
    cluster._on_cell_hello(_hello("c1", "c1-b"))
    cluster._started.set()
    _drain(cluster)
    assert sink.events == [] and forgotten == []
    assert sink.live.cell("c1").incarnation == "c1-b" and not sink.live.cell("c1").lost  # type: ignore[union-attr]


def test_a_cell_lost_during_a_resumes_sync_is_synced_again_once_it_is_back() -> None:
    """Chaos: a resumed controller's Sync on an adopted cell failed because the cell was lost meanwhile, and
    the controller exited. Its supervisor starts the cell again: the sync goes to the next incarnation."""
    from gyre.cluster.errors import PeerLost

    hub = FakeHub(sync=[PeerLost("cell c2 was lost before command 1 (sync) was done")])
    waited: list[list[str]] = []
    hub.wait_for = lambda cell_ids, proxy, timeout_s: waited.append(list(cell_ids))  # type: ignore[attr-defined]
    cluster = Cluster()
    cluster.hub = hub  # type: ignore[assignment]
    cluster.config = SimpleNamespace(cluster=SimpleNamespace(start_timeout_s=5))  # type: ignore[assignment]
    first = hub.command_cell("c2", gyre_pb2.CellCommand(sync=gyre_pb2.Sync()))
    cluster._synced("c2", first)
    assert waited == [["c2"]] and [kind for _, kind, _ in hub.sent] == ["sync", "sync"]

    lost_again = FakeHub(sync=[PeerLost("lost")] * 2)
    lost_again.wait_for = lambda cell_ids, proxy, timeout_s: None  # type: ignore[attr-defined]
    cluster.hub = lost_again  # type: ignore[assignment]
    with pytest.raises(PeerLost):  # lost at every attempt: the resume fails, naming it
        cluster._synced("c2", lost_again.command_cell("c2", gyre_pb2.CellCommand(sync=gyre_pb2.Sync())), attempts=2)


def test_routings_asked_while_one_is_in_flight_go_as_one_that_carries_their_changes() -> None:
    """A routing is a snapshot: asks made while one is in flight are answered by one more routing, built after
    they asked (so it holds what they recorded), not by one each (256 cells: a publish made every rollout
    cell's actuator send the whole table in turn, queued on the proxy's one stream)."""
    import time

    sink = ListSink()
    sink.record([CellRegistered(cell_id="c0", role="rollout", is_core=True, slots=2, incarnation="a")])
    hub = FakeHub()
    sent: list[list[str]] = []
    first_sent, release = threading.Event(), threading.Event()
    answer = hub.command_proxy

    def command_proxy(command: gyre_pb2.ProxyCommand):
        sent.append([route.cell_id for route in command.routing.cells])
        if len(sent) == 1:
            first_sent.set()
            assert release.wait(10)
        return answer(command)

    hub.command_proxy = command_proxy  # type: ignore[method-assign]
    commands = Commands(hub, sink.live, sink)  # type: ignore[arg-type]
    first = threading.Thread(target=commands.route)
    first.start()
    assert first_sent.wait(10)
    sink.record([CellRegistered(cell_id="c1", role="rollout", is_core=False, slots=2, incarnation="b")])
    later = [threading.Thread(target=commands.route) for _ in range(5)]
    for thread in later:
        thread.start()
    deadline = time.monotonic() + 10
    while commands._routes_asked < 6 and time.monotonic() < deadline:  # every ask is in before the release
        time.sleep(0.01)
    release.set()
    for thread in [first, *later]:
        thread.join(10)
        assert not thread.is_alive()
    assert sent == [["c0"], ["c0", "c1"]]
