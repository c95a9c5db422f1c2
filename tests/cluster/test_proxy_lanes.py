"""The proxy's two streams of one incarnation (`ProxyHello.lanes`): its events up one, its commands and their
dones on the other, so a done does not wait behind the events sent before it — and the pair lives, is lost and
leaves as one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from gyre.cluster.errors import ClusterError
from gyre.cluster.link import COMMANDS_LANE, ControllerLink, Durable
from gyre.cluster.proto import gyre_pb2
from gyre.events import CellLost

ROUTING = gyre_pb2.ProxyCommand(routing=gyre_pb2.Routing(cells=[gyre_pb2.CellRoute(cell_id="c0")]))


def _lanes(cluster: Any, handler: Callable[[Any], Any] = lambda command: None, *, incarnation: str = "p-1",
           commands: bool = True, producers: tuple[str, ...] = ()) -> tuple[ControllerLink, ControllerLink]:
    """The proxy's events lane (started) and its commands lane (started if ``commands``)."""
    hello = gyre_pb2.ProxyHello(proxy_id="proxy", incarnation=incarnation, producers=["proxy"], lanes=[COMMANDS_LANE])
    events = ControllerLink(cluster.address, secret=cluster.secret, hello=hello)
    lane = gyre_pb2.ProxyHello(proxy_id="proxy", incarnation=incarnation, lanes=[COMMANDS_LANE], lane=COMMANDS_LANE,
                               producers=list(producers))
    command_link = ControllerLink(cluster.address, secret=cluster.secret, hello=lane, handler=handler,
                                  connect_timeout_s=5)
    cluster.links += [events, command_link]
    events.start()
    if commands:
        command_link.start()
    return events, command_link


def _lost(n: int, tag: str = "e") -> list[CellLost]:
    return [CellLost(cell_id="c0", reason=f"{tag}{i}") for i in range(n)]


def test_a_done_on_the_commands_lane_does_not_wait_for_the_events_lanes_batches(cluster) -> None:
    """While a batch of the events lane is being recorded, a routing goes down the commands lane and its done
    takes effect: on one stream it waited for that batch (and every one before it)."""
    entered, release = threading.Event(), threading.Event()
    recorded = cluster.sink.on_record
    routed: list[str] = []

    def slow(first: int, events: Any) -> None:
        entered.set()
        assert release.wait(10), "the test never released the batch"
        recorded(first, events)

    def handler(command: gyre_pb2.ProxyCommand) -> dict[str, float]:
        routed.append(threading.current_thread().name)
        return {"admitting": 1.0}

    cluster.sink.on_record = slow
    events, _ = _lanes(cluster, handler)
    cluster.hub.wait_for([], proxy=True, timeout_s=5)
    position = events.producer("proxy").record(_lost(2))
    assert entered.wait(5)
    done = cluster.hub.command_proxy(ROUTING).result(5)
    assert done.ok and done.figures["admitting"] == 1.0
    assert routed == [f"gyre-commands-proxy-{COMMANDS_LANE}"]  # the commands lane's thread ran it
    release.set()
    events.sink.commit(position, remote=True)
    assert [(e.producer, e.producer_seq) for e in cluster.events()] == [("proxy", 0), ("proxy", 1)]


def test_a_done_whose_command_recorded_goes_up_once_the_controller_holds_its_events(cluster) -> None:
    """A command that records on the events lane answers `Durable(remote=True)` over that lane's sink: its done
    takes effect only once the hub acknowledged the events (no order holds between the two streams), and the
    commands behind it go on meanwhile; a Sync (`wait_deferred`) follows it."""
    links: list[ControllerLink] = []

    def handler(command: gyre_pb2.ProxyCommand) -> Durable | dict[str, float] | None:
        events, commands = links
        body = command.WhichOneof("body")
        if body == "queue":
            position = events.producer("proxy").record(_lost(3, "queued"))
            return Durable({"queued": 3.0}, position, sink=events.sink, remote=True)
        if body == "sync":
            events.sink.commit(remote=True)
            commands.wait_deferred()
        return None

    links += _lanes(cluster, handler)
    cluster.sink.gate.clear()  # recorded, not yet durable: no acknowledgement goes down
    queued = cluster.hub.command_proxy(gyre_pb2.ProxyCommand(queue=gyre_pb2.QueueExecutions()))
    cluster.wait_recorded(3)
    assert cluster.hub.command_proxy(ROUTING).result(5).ok  # not held by the queue's wait
    sync = cluster.hub.command_proxy(gyre_pb2.ProxyCommand(sync=gyre_pb2.Sync()))
    assert not queued.done() and not sync.done()
    cluster.sink.gate.set()
    assert queued.result(5).figures["queued"] == 3.0 and sync.result(5).ok
    assert [e.reason for e in cluster.events()] == ["queued0", "queued1", "queued2"]


def test_the_proxy_is_connected_with_both_lanes_and_lost_when_one_never_comes(make_cluster) -> None:
    cluster = make_cluster(heartbeat_s=0.05, dead_after_s=0.5)
    gone = threading.Event()
    cluster.hub.on_proxy_lost = lambda proxy_id: gone.set()
    _, commands = _lanes(cluster, commands=False)
    with pytest.raises(TimeoutError, match="the proxy"):  # its events lane alone: no command could go down
        cluster.hub.wait_for([], proxy=True, timeout_s=0.05)
    future = cluster.hub.command_proxy(ROUTING)  # waits for the commands lane, as for a reconnect
    assert gone.wait(5)
    with pytest.raises(ClusterError, match=r"proxy was lost \(its commands lane did not connect within 0.5 s"):
        future.result(5)
    with pytest.raises(ClusterError, match="declared lost"):  # the fenced incarnation cannot open its lane now
        commands.start()


def test_a_proxy_whose_commands_lane_dies_is_lost_with_its_events_lane(make_cluster) -> None:
    cluster = make_cluster(heartbeat_s=0.05, dead_after_s=0.5)
    gone = threading.Event()
    cluster.hub.on_proxy_lost = lambda proxy_id: gone.set()
    failed = threading.Event()
    events, commands = _lanes(cluster)
    events.on_failed = lambda error: failed.set()
    cluster.hub.wait_for([], proxy=True, timeout_s=5)
    commands.sever()  # its events lane keeps beating
    assert gone.wait(5) and failed.wait(5)  # the hub ended the live lane too: the process is fenced
    assert not cluster.hub.proxy_connected()
    assert "ended the stream for good" in str(events.error)


def test_a_new_incarnation_fences_both_lanes_of_the_old(cluster) -> None:
    failed = threading.Event()
    _, old_commands = _lanes(cluster, incarnation="p-1")
    old_commands.on_failed = lambda error: failed.set()
    _lanes(cluster, lambda command: {"new": 1.0}, incarnation="p-2")
    assert failed.wait(5)
    assert cluster.hub.command_proxy(ROUTING).result(5).figures["new"] == 1.0


def test_a_stopped_proxy_leaves_once_both_lanes_have_ended(cluster) -> None:
    lost: list[str] = []
    cluster.hub.on_proxy_lost = lost.append
    events, commands = _lanes(cluster)
    assert cluster.hub.command_proxy(gyre_pb2.ProxyCommand(stop=gyre_pb2.Stop())).result(5).ok
    events.close(timeout_s=5)
    with cluster.hub._cond:  # the hub has seen the events lane end: its end is not the process's
        assert cluster.hub._cond.wait_for(lambda: not cluster.hub._live(("proxy", "")), 5)
    assert not cluster.hub.is_lost("proxy", "proxy", "p-1") and commands.error is None
    commands.close(timeout_s=5)  # returns once the hub has ended the stream (and seen the proxy leave)
    with pytest.raises(ClusterError, match=r"proxy was lost \(it stopped"):
        cluster.hub.command_proxy(ROUTING).result(5)
    assert lost == [] and commands.error is None


def test_a_commands_lane_records_nothing(cluster) -> None:
    with pytest.raises(ClusterError, match=r"malformed.*commands lane names producers \['proxy'\]"):
        _lanes(cluster, producers=("proxy",))
