"""The control-plane streams end to end: a `Hub` over a real `LogSink` and `ControllerLink`s, over gRPC."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from typing import Any

import grpc
import pytest

from gyre import auth
from gyre.cluster.auth import metadata
from gyre.cluster.errors import ClusterError, PeerLost
from gyre.cluster.hub import INGEST_AHEAD, Hub
from gyre.cluster.link import PACK_AHEAD, ControllerLink, Durable
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.events import CellLost, ModelCallFinished
from gyre.events.wire import pack_events
from gyre.sink import LogSink, Producer, SinkError


def _lost(n: int, tag: str = "e") -> list[CellLost]:
    return [CellLost(cell_id="c0", reason=f"{tag}{i}") for i in range(n)]


def _stamps(events: list[Any]) -> list[tuple[str | None, int | None]]:
    return [(e.producer, e.producer_seq) for e in events]


def test_events_go_up_and_are_durable_when_commit_returns(cluster) -> None:
    link = cluster.link("c0")
    assert link.welcome.run_id == "run-1" and dict(link.welcome.held) == {"c0": -1}
    producer = link.producer("c0")
    assert producer is link.producer("c0")  # one numbering per id: two would collide
    first = producer.record(_lost(3))
    second = producer.record(_lost(2, "f"))
    assert (first, second) == (2, 4)  # local positions
    link.sink.commit(second)
    assert cluster.sink.writer.durable_seq >= 4
    events = cluster.events()
    assert [e.reason for e in events] == ["e0", "e1", "e2", "f0", "f1"]
    assert _stamps(events) == [("c0", i) for i in range(5)]


def test_records_from_many_threads_at_once_all_go_up_once_in_order(cluster) -> None:
    """The link wakes its loop once per burst of records (a flag the loop clears before it reads): a record made
    while a wake-up is on its way must still go up, never stranded until the next record."""
    producers = [f"p{i}" for i in range(6)]
    link = cluster.link("c0", producers=tuple(producers))
    barrier = threading.Barrier(len(producers))
    last: dict[str, int] = {}

    def record(name: str) -> None:
        producer = link.producer(name)
        barrier.wait()
        for i in range(150):
            last[name] = producer.record(CellLost(cell_id="c0", reason=f"{name}-{i}"))

    threads = [threading.Thread(target=record, args=(name,)) for name in producers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    link.sink.commit(max(last.values()), remote=True, timeout_s=30)
    events = cluster.events()
    assert len(events) == 6 * 150
    for name in producers:
        mine = [e for e in events if e.producer == name]
        assert [e.producer_seq for e in mine] == list(range(150))
        assert [e.reason for e in mine] == [f"{name}-{i}" for i in range(150)]


def test_durable_can_be_awaited_on_another_loop(cluster) -> None:
    link = cluster.link("c0")
    position = link.producer("c0").record(_lost(1))
    asyncio.run(asyncio.wait_for(link.sink.durable(position), 5))
    assert cluster.sink.writer.durable_seq >= 0


def test_the_sink_refuses_unstamped_and_unnamed_events(cluster) -> None:
    link = cluster.link("c0")
    with pytest.raises(SinkError, match="no producer stamp"):
        link.sink.record(_lost(1))
    with pytest.raises(SinkError, match=r"'other'.*does not name"):
        Producer(link.sink, "other").record(_lost(1))
    with pytest.raises(ValueError, match="not named"):
        link.producer("other")


def test_a_broken_stream_resends_unacked_batches_exactly_once(cluster) -> None:
    hellos: list[str] = []
    cluster.hub.on_cell_hello = lambda hello: hellos.append(hello.cell_id)
    link = cluster.link("c0")
    producer = link.producer("c0")
    cluster.sink.gate.clear()  # the hub records but holds its durable acks
    producer.record(_lost(3, "a"))
    producer.record(_lost(2, "b"))
    cluster.wait_recorded(5)
    assert link.sink.unacked == 2
    cluster.hub.drop("c0")  # the acks of a and b die with the stream
    last = producer.record(_lost(2, "c"))  # sent on the broken stream or the next one
    cluster.sink.gate.set()
    link.sink.commit(last)
    assert link.connections >= 2
    events = cluster.events()
    assert [e.reason for e in events] == ["a0", "a1", "a2", "b0", "b1", "c0", "c1"]
    assert _stamps(events) == [("c0", i) for i in range(7)]
    assert hellos == ["c0"]  # a reconnect of the same incarnation is no new cell


def test_durable_awaited_on_another_loop_across_a_break(cluster) -> None:
    link = cluster.link("c0")
    producer = link.producer("c0")
    cluster.sink.gate.clear()

    async def main() -> None:
        position = producer.record(_lost(2))
        waiting = asyncio.ensure_future(link.sink.durable(position))
        await asyncio.to_thread(cluster.wait_recorded, 2)
        await asyncio.to_thread(cluster.hub.drop, "c0")
        cluster.sink.gate.set()
        await asyncio.wait_for(waiting, 5)

    asyncio.run(main())
    assert _stamps(cluster.events()) == [("c0", 0), ("c0", 1)]


def test_a_restarted_producer_continues_after_what_the_log_holds(cluster) -> None:
    old = cluster.link("c0", incarnation="first")
    old.sink.commit(old.producer("c0").record(_lost(3)))
    old.close()
    new = cluster.link("c0", incarnation="second")
    assert new.welcome.held["c0"] == 2
    producer = new.producer("c0")
    assert producer.next_seq == 3
    new.sink.commit(producer.record(_lost(2, "n")))
    assert _stamps(cluster.events()) == [("c0", i) for i in range(5)]


def test_a_gap_is_refused_and_fails_the_link(cluster) -> None:
    link = cluster.link("c0")
    failed = threading.Event()
    link.on_failed = lambda error: failed.set()
    position = Producer(link.sink, "c0", next_seq=5).record(_lost(1))  # 0..4 never sent
    with pytest.raises(SinkError, match="skipped from -1 to 5"):
        link.sink.commit(position)
    assert failed.wait(5)
    with pytest.raises(SinkError):
        link.producer("c0").record(_lost(1))
    assert cluster.events() == []


def test_commands_return_figures_and_errors_in_order_on_one_thread(cluster) -> None:
    threads: set[int] = set()
    order: list[int] = []
    running = threading.Lock()

    def handler(command: gyre_pb2.CellCommand) -> dict[str, float] | None:
        assert running.acquire(blocking=False), "two commands overlapped"
        try:
            threads.add(threading.get_ident())
            order.append(command.command_id)
            if command.WhichOneof("body") == "pause":
                raise RuntimeError(f"cannot pause ({command.pause.mode})")
            if command.WhichOneof("body") == "train":
                return gyre_pb2.CommandDone(detail=b"weights", figures={"train_s": 2.0})
            return {"load_s": 0.25, "bytes": 1024} if command.WhichOneof("body") == "load_weights" else None
        finally:
            running.release()

    cluster.link("c0", handler=handler)
    futures = [cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())),
               cluster.hub.command_cell("c0", gyre_pb2.CellCommand(load_weights=gyre_pb2.LoadWeights())),
               cluster.hub.command_cell("c0", gyre_pb2.CellCommand(pause=gyre_pb2.Pause(mode="abort"))),
               cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())),
               cluster.hub.command_cell("c0", gyre_pb2.CellCommand(train=gyre_pb2.Train(step=1)))]
    done = [f.result(5) for f in futures]
    ids = [d.command_id for d in done]
    assert ids == sorted(ids) and order == ids and len(threads) == 1
    assert [d.ok for d in done] == [True, True, False, True, True]
    assert dict(done[1].figures) == {"load_s": 0.25, "bytes": 1024.0}
    assert done[2].error == "RuntimeError: cannot pause (abort)"
    assert (done[4].detail, dict(done[4].figures), done[4].ok) == (b"weights", {"train_s": 2.0}, True)


def test_a_cell_asks_mid_command_which_weights_to_load(cluster) -> None:
    """A return to rollout asks, once its leave is over, for the weights the log names at that moment: the hub
    answers down the same stream from ``on_weights_ask``; a failing callback is an answer with its error (the
    cell's command fails with it), and the stream goes on. (The hub also asks it as it sends each ToRollout,
    for the command's plan: `test_a_return_s_plan_follows_the_weights_until_its_done`.)"""
    asked: list[tuple[str, str]] = []
    versions = iter([4, 4, None, None])

    def answer(cell_id: str, incarnation: str) -> tuple[bool, gyre_pb2.WeightsRef]:
        asked.append((cell_id, incarnation))
        version = next(versions)
        if version is None:
            raise RuntimeError("no actuator")
        return True, gyre_pb2.WeightsRef(version=version, location=f"weights/v{version}")

    cluster.hub.on_weights_ask = answer
    links: list[ControllerLink] = []

    def handler(command: gyre_pb2.CellCommand) -> dict[str, float]:
        reply = links[0].ask_weights(timeout_s=10)
        assert reply.ask_id > 0
        return {"load": float(reply.load), "version": float(reply.weights.version), "error": float(bool(reply.error))}

    links.append(cluster.link("c0", handler=handler, incarnation="c0-a"))
    for figures in ({"load": 1.0, "version": 4.0, "error": 0.0}, {"load": 0.0, "version": 0.0, "error": 1.0}):
        sent = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(to_rollout=gyre_pb2.ToRollout(ask=True)))
        assert dict(sent.result(10).figures) == figures
    assert asked == [("c0", "c0-a")] * 4
    proxy = ControllerLink(cluster.address, secret=cluster.secret, hello=gyre_pb2.ProxyHello(proxy_id="p"),
                           handler=lambda command: None)
    with pytest.raises(TypeError, match="only a cell"):  # the proxy has no engine to load
        proxy.ask_weights()


def test_a_return_s_plan_follows_the_weights_until_its_done(cluster) -> None:
    """A ToRollout that asks goes down with the ask's answer as it stands (`ToRollout.plan`); until its done, a
    change (`Hub.weights_changed`) that alters the answer goes down too and the cell reads the latest it received
    (`ControllerLink.planned`) instead of asking; after the done nothing follows it, and the next ToRollout
    carries the answer of its own send."""
    version = [4]
    cluster.hub.on_weights_ask = lambda cell_id, incarnation: (
        True, gyre_pb2.WeightsRef(version=version[0], location=f"weights/v{version[0]}"))
    entered, changed = threading.Event(), threading.Event()
    links: list[ControllerLink] = []

    def handler(command: gyre_pb2.CellCommand) -> dict[str, float]:
        to = command.to_rollout
        assert to.HasField("plan")
        figures = {"sent": float(to.plan.weights.version)}
        if not entered.is_set():  # the first return: the weights change while it is under way
            entered.set()
            assert changed.wait(10)
            links[0].ask_weights(timeout_s=10)  # ordering only: its answer comes down after the change's plan
        planned = links[0].planned(command.command_id, to.plan)
        return {**figures, "load": float(planned.load), "version": float(planned.weights.version)}

    links.append(cluster.link("c0", handler=handler, incarnation="c0-a"))
    first = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(to_rollout=gyre_pb2.ToRollout(ask=True)))
    assert entered.wait(10)
    cluster.hub.weights_changed()  # the answer is unchanged: nothing goes down
    version[0] = 5
    cluster.hub.weights_changed()
    changed.set()
    assert dict(first.result(10).figures) == {"sent": 4.0, "load": 1.0, "version": 5.0}
    version[0] = 6
    cluster.hub.weights_changed()  # the first is done: nothing follows it
    second = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(to_rollout=gyre_pb2.ToRollout(ask=True)))
    assert dict(second.result(10).figures) == {"sent": 6.0, "load": 1.0, "version": 6.0}
    assert cluster.hub.received["ask"] == 1  # the ordering ask alone: the returns read their plans
    assert not any(peer.plans for peer in cluster.hub._peers.values())


def test_a_change_between_a_plan_s_read_and_its_send_is_not_lost(cluster) -> None:
    """The plan is read on the sender's thread; a change that lands after that read but before the loop sends the
    command (its push pass finding no plan to follow yet) is caught on the loop: the plan is read again there."""
    version = [4]
    calls: list[int] = []

    def answer(cell_id: str, incarnation: str) -> tuple[bool, gyre_pb2.WeightsRef]:
        calls.append(version[0])
        read = version[0]
        if len(calls) == 1:  # the sender's read: the log names v5 right after it
            version[0] = 5
            cluster.hub.weights_changed()
        return True, gyre_pb2.WeightsRef(version=read, location=f"weights/v{read}")

    cluster.hub.on_weights_ask = answer
    links: list[ControllerLink] = []
    links.append(cluster.link("c0", handler=lambda command: {
        "version": float(links[0].planned(command.command_id, command.to_rollout.plan).weights.version)},
        incarnation="c0-a"))
    sent = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(to_rollout=gyre_pb2.ToRollout(ask=True)))
    assert dict(sent.result(10).figures) == {"version": 5.0}
    assert calls == [4, 5]


def test_commands_from_many_threads_at_once_arrive_numbered_in_order(cluster) -> None:
    """As at a publish, when every actuator thread sends at once: each command reaches the cell once, a peer runs
    its commands in command_id order, and each thread's own commands keep the order it sent them in."""
    ran: list[tuple[int, int, int]] = []

    def handler(command: gyre_pb2.CellCommand) -> None:
        ran.append((command.command_id, command.join_step.weights.version, int(command.join_step.weights.location)))

    cluster.link("c0", handler=handler)
    threads, each = 16, 25
    start = threading.Barrier(threads)
    futures: dict[tuple[int, int], Any] = {}

    def send(thread: int) -> None:
        start.wait(5)
        for i in range(each):
            weights = gyre_pb2.WeightsRef(version=thread, location=str(i))
            futures[thread, i] = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(
                join_step=gyre_pb2.JoinStep(weights=weights)))

    senders = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(10)
    done = {key: future.result(10) for key, future in futures.items()}
    assert len(ran) == threads * each and all(d.ok for d in done.values())
    ids = [command_id for command_id, _, _ in ran]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for thread in range(threads):
        assert [i for _, t, i in ran if t == thread] == list(range(each))
        assert [done[thread, i].command_id for i in range(each)] == sorted(done[thread, i].command_id
                                                                         for i in range(each))


def test_a_command_pending_over_a_reconnect_runs_once(cluster) -> None:
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def handler(command: gyre_pb2.CellCommand) -> dict[str, float]:
        runs.append(command.command_id)
        started.set()
        assert release.wait(5)
        return {"s": 1.0}

    link = cluster.link("c0", handler=handler)
    future = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve()))
    assert started.wait(5)
    cluster.hub.drop("c0")  # the hub re-sends the command on the next stream: the link must not run it again
    release.set()
    assert future.result(5).ok
    # another command after the reconnect proves the link is back and the re-sent one was not re-run
    assert cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5).ok
    assert len(runs) == len(set(runs)) == 2
    assert link.connections >= 2


def test_a_done_that_waits_for_durable_events_does_not_hold_the_next_command(cluster) -> None:
    """A handler's `Durable` answer goes up once what it recorded is durable, and the command thread takes the
    next command meanwhile (a proxy's queue no longer holds the routings behind it); `wait_deferred` (a Sync)
    waits for it."""
    synced = threading.Event()

    def handler(command: gyre_pb2.CellCommand) -> Durable | dict[str, float] | None:
        if command.WhichOneof("body") == "serve":
            return Durable({"queued": 1.0}, link.producer("c0").record(_lost(1, "queued")))
        if command.WhichOneof("body") == "sync":
            link.wait_deferred()
            synced.set()
        return None

    link = cluster.link("c0", handler=handler)
    cluster.sink.gate.clear()  # recorded, not yet durable
    queued = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve()))
    cluster.wait_recorded(1)
    assert cluster.hub.command_cell("c0", gyre_pb2.CellCommand(pause=gyre_pb2.Pause())).result(5).ok
    sync = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(sync=gyre_pb2.Sync()))
    assert not queued.done() and not sync.done() and not synced.is_set()  # both wait for the event's ack
    cluster.sink.gate.set()
    assert queued.result(5).figures["queued"] == 1.0
    assert sync.result(5).ok and synced.is_set()


def test_a_silent_cell_is_lost_and_its_commands_fail(make_cluster) -> None:
    cluster = make_cluster(heartbeat_s=0.05, dead_after_s=0.5)
    lost: list[tuple[str, str]] = []
    gone = threading.Event()
    cluster.hub.on_cell_lost = lambda cell_id, reason: (lost.append((cell_id, reason)), gone.set())
    release = threading.Event()
    link = cluster.link("c7", handler=lambda command: release.wait(5) and None)
    future = cluster.hub.command_cell("c7", gyre_pb2.CellCommand(serve=gyre_pb2.Serve()))
    link.stop_heartbeats()
    assert gone.wait(5)
    assert lost[0][0] == "c7" and "nothing arrived" in lost[0][1]
    with pytest.raises(ClusterError, match="c7 was lost"):
        future.result(5)
    assert not cluster.hub.connected("c7")
    with pytest.raises(ClusterError, match="c7 was lost"):
        cluster.hub.command_cell("c7", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5)
    release.set()


class _Clock:
    """The hub's clock, set by the test: a peer's silence ages only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_link_lives_without_heartbeats_and_a_silent_one_is_lost(make_cluster) -> None:
    """Any message tells the hub a process lives (a busy link skips its heartbeats): events alone keep a link
    alive over many times ``dead_after_s``, and ``dead_after_s`` without a message loses it. The hub ages
    silence on the test's clock, so only the order of events matters, not how fast the machine runs."""
    clock = _Clock()
    cluster = make_cluster(heartbeat_s=0.05, dead_after_s=1.0, clock=clock)
    lost: list[tuple[str, str]] = []
    cluster.hub.on_cell_lost = lambda cell_id, reason: lost.append((cell_id, reason))
    link = cluster.link("c0")
    link.stop_heartbeats()  # only its events go up
    producer = link.producer("c0")
    for i in range(5):  # 3 s of the hub's clock in all, 0.6 s between messages
        clock.now += 0.6
        link.sink.commit(producer.record(_lost(1, f"busy{i}")), remote=True)  # it arrived: acked
        cluster.hub.swept()
        assert not lost and cluster.hub.connected("c0")
    clock.now += 1.1
    cluster.hub.swept()
    assert lost == [("c0", "nothing arrived for 1.1 s (heartbeats every 0.05 s; dead after 1.0 s)")]
    assert not cluster.hub.connected("c0")


def test_a_link_beats_only_after_a_heartbeat_period_with_nothing_sent(make_cluster) -> None:
    """While events go up more often than ``heartbeat_s`` the link sends no heartbeat; idle, it beats again.
    Robust to a stalled machine: a heartbeat is allowed for each ``heartbeat_s`` between two sends that the
    test saw (a send happens between its record and its ack)."""
    every_s = 0.3
    cluster = make_cluster(heartbeat_s=every_s, dead_after_s=60.0)
    link = cluster.link("c0")
    producer = link.producer("c0")
    recorded, acked = [], []
    for i in range(40):  # ~1.2 s: four heartbeat periods
        recorded.append(time.monotonic())
        link.sink.commit(producer.record(_lost(1, f"e{i}")), remote=True)
        acked.append(time.monotonic())
        if i == 0:
            beats = link.sent["heartbeat"]  # the first event is written: a heartbeat before it is counted
        time.sleep(every_s / 10)  # pacing only: a longer stall is allowed for below
    beats = link.sent["heartbeat"] - beats
    seen = time.monotonic()
    allowed = sum(int((acked[i + 1] - recorded[i]) // every_s) for i in range(len(recorded) - 1))
    allowed += int((seen - recorded[-1]) // every_s)
    assert beats <= allowed, f"{beats} heartbeats while events went up (allowed {allowed} for stalls)"
    assert link.sent["events"] >= 40
    idle = link.sent["heartbeat"]
    deadline = time.monotonic() + 30
    while link.sent["heartbeat"] == idle and time.monotonic() < deadline:  # idle now: it beats again
        time.sleep(every_s / 3)
    assert link.sent["heartbeat"] > idle


def test_a_new_incarnation_replaces_the_old(cluster) -> None:
    hellos: list[str] = []
    lost: list[tuple[str, str]] = []
    cluster.hub.on_cell_hello = lambda hello: hellos.append(hello.incarnation)
    cluster.hub.on_cell_lost = lambda cell_id, reason: lost.append((cell_id, reason))
    old = cluster.link("c0", incarnation="one")
    failed = threading.Event()
    old.on_failed = lambda error: failed.set()
    cluster.link("c0", incarnation="two")
    assert failed.wait(5) and "FAILED_PRECONDITION" in str(old.error)
    assert hellos == ["one", "two"] and lost == [("c0", "replaced by incarnation 'two'")]
    assert cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5).ok


def test_a_newer_incarnation_fences_the_older(cluster) -> None:
    """A process cut off (a partition) never acts beside its replacement: once the new incarnation is in,
    commands decided for the old one and the old one's events are refused."""
    ran: list[str] = []
    serve = gyre_pb2.CellCommand(serve=gyre_pb2.Serve())
    old = cluster.link("c0", incarnation="one", handler=lambda command: ran.append("one"))
    old.sink.commit(old.producer("c0").record(_lost(1, "old")))
    assert cluster.hub.command_cell("c0", serve, incarnation="one").result(5).ok
    failed = threading.Event()
    old.on_failed = lambda error: failed.set()
    new = cluster.link("c0", incarnation="two", handler=lambda command: ran.append("two"))
    assert failed.wait(5)
    with pytest.raises(PeerLost, match="incarnation 'one' was replaced by 'two'"):
        cluster.hub.command_cell("c0", serve, incarnation="one").result(5)
    assert cluster.hub.command_cell("c0", serve, incarnation="two").result(5).ok
    assert ran == ["one", "two"]
    with pytest.raises(SinkError):  # what the old process records now goes nowhere
        old.producer("c0").record(_lost(1, "stale"))
    back = cluster.link("c0", incarnation="one", start=False, connect_timeout_s=5)  # its partition heals
    with pytest.raises(ClusterError, match="was declared lost"):
        back.start()
    new.sink.commit(new.producer("c0").record(_lost(1, "new")))
    assert [e.reason for e in cluster.events()] == ["old0", "new0"]


def test_wait_for_names_the_missing(cluster) -> None:
    cluster.link("c0")
    cluster.hub.wait_for(["c0"], proxy=False, timeout_s=5)
    with pytest.raises(TimeoutError, match="cell 'c1', the proxy"):
        cluster.hub.wait_for(["c0", "c1"], proxy=True, timeout_s=0.05)
    assert cluster.hub.heartbeat_age("c0") is not None and cluster.hub.heartbeat_age("c1") is None


def test_the_proxy_stream(cluster) -> None:
    seen: list[str] = []
    cluster.hub.on_proxy_hello = lambda hello: seen.append(hello.url)
    got: list[str] = []

    def handler(command: gyre_pb2.ProxyCommand) -> None:
        got.extend(c.cell_id for c in command.routing.cells)

    link = ControllerLink(cluster.address, secret=cluster.secret, handler=handler,
                          hello=gyre_pb2.ProxyHello(proxy_id="proxy", url="http://127.0.0.1:1", producers=["proxy"]))
    cluster.links.append(link)
    link.start()
    cluster.hub.wait_for([], proxy=True, timeout_s=5)
    routing = gyre_pb2.Routing(cells=[gyre_pb2.CellRoute(cell_id="c0"), gyre_pb2.CellRoute(cell_id="c1")])
    assert cluster.hub.command_proxy(gyre_pb2.ProxyCommand(routing=routing)).result(5).ok
    link.sink.commit(link.producer("proxy").record(_lost(2)))
    assert seen == ["http://127.0.0.1:1"] and got == ["c0", "c1"]
    assert _stamps(cluster.events()) == [("proxy", 0), ("proxy", 1)]


def test_a_wrong_secret_fails_start_clearly(cluster) -> None:
    link = cluster.link("c0", start=False, secret=auth.mint(auth.RUN_PREFIX), connect_timeout_s=5)
    with pytest.raises(ClusterError, match=r"refused the run secret.*UNAUTHENTICATED"):
        link.start()


def test_no_controller_fails_start_after_the_timeout(cluster) -> None:
    link = ControllerLink("127.0.0.1:1", secret=cluster.secret, hello=gyre_pb2.CellHello(cell_id="c0"),
                          handler=lambda command: None, connect_timeout_s=0.3)
    with pytest.raises(ClusterError, match=re.escape("no Welcome from the controller at 127.0.0.1:1 within 0.3 s")):
        link.start()


def test_the_first_message_must_be_hello(cluster) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            call = gyre_pb2_grpc.CellStub(channel).Connect(metadata=metadata(cluster.secret))
            await call.write(gyre_pb2.CellUp(heartbeat=gyre_pb2.Heartbeat()))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "first message on a cell stream must be hello, got heartbeat" in refused.value.details()

    asyncio.run(main())


def test_admin_status_needs_the_secret(cluster) -> None:
    cluster.link("c0")

    async def status(secret_metadata: Any) -> gyre_pb2.StatusReply:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            return await gyre_pb2_grpc.AdminStub(channel).Status(gyre_pb2.StatusRequest(), metadata=secret_metadata)

    reply = asyncio.run(status(metadata(cluster.secret)))
    assert reply.run_id == "run-1" and [(c.cell_id, c.connected, c.slots) for c in reply.cells] == [("c0", True, 2)]
    cluster.hub.status = lambda: gyre_pb2.StatusReply(watermark=3, policy="elastic")
    reply = asyncio.run(status(metadata(cluster.secret)))
    assert (reply.run_id, reply.watermark, reply.policy) == ("run-1", 3, "elastic")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(status(()))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_cell_whose_stream_ends_for_good_is_lost(make_cluster) -> None:
    cluster = make_cluster(heartbeat_s=0.05, dead_after_s=0.5)
    gone = threading.Event()
    lost: list[tuple[str, str]] = []
    cluster.hub.on_cell_lost = lambda cell_id, reason: (lost.append((cell_id, reason)), gone.set())
    link = cluster.link("c3")
    link.sever()  # a killed process: no goodbye
    assert gone.wait(5)
    assert lost[0][0] == "c3" and "did not reconnect within 0.5 s" in lost[0][1]


def test_a_closed_log_refuses_the_batch(cluster) -> None:
    link = cluster.link("c0")
    cluster.sink.close()
    position = link.producer("c0").record(_lost(1))
    with pytest.raises(SinkError, match=r"refused event batch 1.*closed"):
        link.sink.commit(position)


def test_stopping_the_hub_fails_pending_commands(cluster) -> None:
    started, release = threading.Event(), threading.Event()

    def handler(command: gyre_pb2.CellCommand) -> None:
        started.set()
        release.wait(5)

    cluster.link("c0", handler=handler)
    future = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve()))
    assert started.wait(5)
    cluster.hub.stop()
    with pytest.raises(ClusterError, match="the hub stopped"):
        future.result(5)
    with pytest.raises(ClusterError, match="not running"):
        cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5)
    release.set()


def test_commands_to_unknown_cells_fail_at_once(cluster) -> None:
    with pytest.raises(ClusterError, match="cell 'c9' has not connected"):
        cluster.hub.command_cell("c9", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5)
    with pytest.raises(ClusterError, match="the proxy has not connected"):
        cluster.hub.command_proxy(gyre_pb2.ProxyCommand(stop=gyre_pb2.Stop())).result(5)
    with pytest.raises(ValueError, match="without a body"):
        cluster.hub.command_cell("c9", gyre_pb2.CellCommand())


def test_two_processes_cannot_share_a_producer(cluster) -> None:
    cluster.link("c0", producers=("shared",))
    with pytest.raises(ClusterError, match=r"malformed.*\['shared'\], which cell c0 records as"):
        cluster.link("c1", producers=("shared",), connect_timeout_s=5)


def test_a_taken_port_is_a_clear_error(cluster) -> None:

    port = int(cluster.address.rsplit(":", 1)[1])
    hub = Hub(cluster.sink, run_id="run-1", secret=cluster.secret, port=port)
    with pytest.raises(ClusterError, match=f"cannot listen on 127.0.0.1:{port}"):
        hub.start()


def test_a_failing_status_is_internal(cluster) -> None:
    def broken() -> gyre_pb2.StatusReply:
        raise RuntimeError("no fold yet")

    cluster.hub.status = broken

    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await gyre_pb2_grpc.AdminStub(channel).Status(gyre_pb2.StatusRequest(),
                                                              metadata=metadata(cluster.secret))
            assert failed.value.code() == grpc.StatusCode.INTERNAL and "no fold yet" in failed.value.details()

    asyncio.run(main())


def test_concurrent_producers_across_repeated_breaks_land_exactly_once(cluster) -> None:
    link = cluster.link("c0", producers=("a", "b"))
    rounds, per_round = 4, 6
    barrier = threading.Barrier(3)

    def produce(name: str) -> None:
        producer = link.producer(name)
        for r in range(rounds):
            for i in range(per_round):
                producer.record(_lost(1 + i % 3, f"{name}{r}.{i}."))
            barrier.wait(5)  # the main thread breaks the stream between rounds
            barrier.wait(5)

    threads = [threading.Thread(target=produce, args=(name,)) for name in ("a", "b")]
    cluster.sink.gate.clear()  # the first rounds stay un-acked: they are re-sent after each break
    for thread in threads:
        thread.start()
    for r in range(rounds):
        barrier.wait(5)
        cluster.hub.drop("c0")
        if r == rounds // 2:
            cluster.sink.gate.set()
        barrier.wait(5)
    for thread in threads:
        thread.join(5)
    link.sink.commit()
    per_producer = rounds * sum(1 + i % 3 for i in range(per_round))
    events = cluster.events()
    assert len(events) == 2 * per_producer
    for name in ("a", "b"):
        mine = [e for e in events if e.producer == name]
        assert [e.producer_seq for e in mine] == list(range(per_producer))
        assert [e.reason for e in mine] == [f"{name}{r}.{i}.{k}" for r in range(rounds) for i in range(per_round)
                                            for k in range(1 + i % 3)]


def test_a_link_outlives_a_controller_restart(cluster) -> None:
    link = cluster.link("c0", backoff_s=(0.01, 0.1))
    producer = link.producer("c0")
    link.sink.commit(producer.record(_lost(2, "a")))
    cluster.sink.gate.clear()
    producer.record(_lost(1, "b"))
    cluster.wait_recorded(3)
    cluster.sink.gate.set()
    cluster.restart()  # b's ack may die with the first controller: then b is re-sent and dropped as held
    last = producer.record(_lost(2, "c"))  # recorded during or after the restart
    link.sink.commit(last)
    events = cluster.events()
    assert [e.reason for e in events] == ["a0", "a1", "b0", "c0", "c1"]
    assert _stamps(events) == [("c0", i) for i in range(5)]
    assert cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5).ok


def test_a_link_started_before_its_controller_waits_for_it(tmp_path) -> None:
    with socket.socket() as probe:  # a port nobody listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    secret = auth.mint(auth.RUN_PREFIX)
    link = ControllerLink(f"127.0.0.1:{port}", secret=secret, hello=gyre_pb2.CellHello(cell_id="c0"),
                          handler=lambda command: None, backoff_s=(0.01, 0.05), connect_timeout_s=10)
    welcomes: list[gyre_pb2.Welcome] = []
    starter = threading.Thread(target=lambda: welcomes.append(link.start()))
    starter.start()
    sink = LogSink.create(tmp_path / "log", "run-1")
    hub = Hub(sink, run_id="run-1", secret=secret, port=port)
    try:
        hub.start()
        starter.join(10)
        assert welcomes and welcomes[0].run_id == "run-1"
        hub.wait_for(["c0"], proxy=False, timeout_s=5)
    finally:
        link.close(timeout_s=5)
        hub.stop()
        sink.close()


def test_a_stream_without_hello_is_ended(make_cluster) -> None:
    cluster = make_cluster(heartbeat_s=0.05, dead_after_s=0.3)

    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            call = gyre_pb2_grpc.CellStub(channel).Connect(metadata=metadata(cluster.secret))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(call.read(), 5)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no hello on the cell stream within 0.3 s" in ended.value.details()

    asyncio.run(main())


def test_a_call_larger_than_grpcs_default_message_limit(cluster) -> None:
    link = cluster.link("c0")
    n = 600_000  # int32 ids and float32 log-probs: 4.8 MB, over gRPC's default 4 MiB
    call = ModelCallFinished(execution_id="e", call_id="k", cell_id="c0", output_ids=[7] * n,
                             output_logprobs=[-0.5] * n)
    link.sink.commit(link.producer("c0").record([call]))
    [logged] = cluster.events()
    assert len(logged.output_ids) == n and logged.producer_seq == 0


def test_a_stopped_cell_leaves_without_being_lost(cluster) -> None:
    lost: list[tuple[str, str]] = []
    cluster.hub.on_cell_lost = lambda cell_id, reason: lost.append((cell_id, reason))
    link = cluster.link("c0")
    assert cluster.hub.command_cell("c0", gyre_pb2.CellCommand(stop=gyre_pb2.Stop())).result(5).ok
    link.close(timeout_s=5)  # returns once the hub has ended the stream (and seen the cell leave)
    with pytest.raises(ClusterError, match=r"c0 was lost \(it stopped"):
        cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5)
    assert lost == [] and not cluster.hub.connected("c0")


def test_a_batch_being_recorded_holds_no_other_stream(cluster) -> None:
    """Decoding and recording a batch happen off the hub's loop: while one cell's batch is being recorded,
    another cell's command is sent, done and answered."""
    entered, release = threading.Event(), threading.Event()
    recorded = cluster.sink.on_record

    def slow(first: int, events: Any) -> None:  # the batch as it arrived (columnar ingest)
        if "c0" in events.column("producer").to_pylist():
            entered.set()
            assert release.wait(10), "the test never released the batch"
        recorded(first, events)

    cluster.sink.on_record = slow
    c0, _ = cluster.link("c0"), cluster.link("c1")
    position = c0.producer("c0").record(_lost(2))
    assert entered.wait(5)
    done = cluster.hub.command_cell("c1", gyre_pb2.CellCommand(serve=gyre_pb2.Serve())).result(5)
    assert done.ok
    release.set()
    c0.sink.commit(position)
    assert _stamps(cluster.events()) == [("c0", 0), ("c0", 1)]


def test_a_done_waits_for_the_batches_sent_before_it(cluster) -> None:
    """The hub reads on while a batch is recorded, but a command's done sent after its events takes effect only
    once they are in the log: the caller never learns of a command before what it recorded."""
    entered, release, read = threading.Event(), threading.Event(), threading.Event()
    recorded = cluster.sink.on_record

    def slow(first: int, events: Any) -> None:
        entered.set()
        assert release.wait(10), "the test never released the batch"
        recorded(first, events)

    after_ingest = cluster.hub._after_ingest

    def done_read(*args: Any) -> None:
        after_ingest(*args)
        read.set()

    def handler(command: gyre_pb2.CellCommand) -> None:  # records, then is done: the done follows the events
        link.producer("c0").record(_lost(2))

    cluster.hub._after_ingest = done_read
    cluster.sink.on_record = slow
    link = cluster.link("c0", handler=handler)
    future = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve()))
    assert entered.wait(5) and read.wait(5)  # the batch is being recorded, and the done behind it was read
    assert not future.done()
    release.set()
    assert future.result(5).ok
    assert _stamps(cluster.events()) == [("c0", 0), ("c0", 1)]


def test_nothing_a_stream_sent_after_a_refused_batch_is_recorded(cluster) -> None:
    """Batches read ahead of a refusal are dropped with it: the first is unstamped (refused), the second valid.
    The hub's one ingest thread is held until it has read both (else the refusal could end the stream before the
    second write, which then fails: the test raced the hub)."""
    ingest_free = threading.Event()
    cluster.hub._ingest.submit(ingest_free.wait)

    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            call = gyre_pb2_grpc.CellStub(channel).Connect(metadata=metadata(cluster.secret))
            await call.write(gyre_pb2.CellUp(hello=gyre_pb2.CellHello(cell_id="c0", slots=1, incarnation="i",
                                                                      producers=["c0"])))
            assert (await call.read()).WhichOneof("body") == "welcome"
            stamped = [e.model_copy(update={"producer": "c0", "producer_seq": 0, "run_id": "run-1"})
                       for e in _lost(1)]
            await call.write(gyre_pb2.CellUp(events=gyre_pb2.EventBatch(batch_id=1, arrow_ipc=pack_events(_lost(1)))))
            await call.write(gyre_pb2.CellUp(events=gyre_pb2.EventBatch(batch_id=2, arrow_ipc=pack_events(stamped))))
            deadline = time.monotonic() + 30
            while cluster.hub.received["events"] < 2 and time.monotonic() < deadline:  # both read, neither ingested
                await asyncio.sleep(0.01)
            read = cluster.hub.received["events"]
            ingest_free.set()
            assert read == 2, f"the hub read {read} of the 2 batches"
            ack = (await call.read()).ack
            assert ack.batch_id == 1 and "has no producer stamp" in ack.error
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(main())
    assert cluster.events() == []


def test_records_made_while_batches_are_out_go_up_as_one_batch_and_before_a_later_done(cluster) -> None:
    """`PACK_AHEAD`: while that many event batches are out unacknowledged (held here at the link's packer),
    what is recorded meanwhile stays in the sink and goes as one batch; a done made meanwhile still goes up
    after every record made before it, so its command's events are in the log when its caller learns it is
    done."""
    assert PACK_AHEAD == INGEST_AHEAD  # never more out than the hub reads ahead
    producer_ref: list[Producer] = []
    link = cluster.link("c0", handler=lambda command: producer_ref[0].record(_lost(1, "command")) and None)
    producer = link.producer("c0")
    producer_ref.append(producer)
    gate = threading.Event()
    link._packer.submit(gate.wait, 30)  # the packer is one thread: every batch waits behind this

    def on_loop() -> None:  # what the link's loop was asked before now has run (its callbacks are in order)
        link._thread.submit(asyncio.sleep(0)).result(5)

    sent = link.sent["events"]
    for i in range(PACK_AHEAD):  # a batch each, of one record: sent at once
        producer.record(_lost(1, f"out{i}"))
        on_loop()
        assert link._conn is not None and len(link._conn.window) == i + 1
    for i in range(5):  # these wait in the sink
        producer.record(_lost(1, f"held{i}"))
    on_loop()
    assert len(link._conn.window) == PACK_AHEAD
    done = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(serve=gyre_pb2.Serve()))
    deadline = time.monotonic() + 10  # the handler records, then its done takes the held records with it
    while len(link._conn.window) == PACK_AHEAD and time.monotonic() < deadline:
        on_loop()
    assert len(link._conn.window) == PACK_AHEAD + 1 and not done.done()
    gate.set()
    assert done.result(10).ok
    assert cluster.sink.writer.next_seq == PACK_AHEAD + 6  # the done took effect with its command's event logged
    reasons = [*(f"out{i}0" for i in range(PACK_AHEAD)), *(f"held{i}0" for i in range(5)), "command0"]
    assert [e.reason for e in cluster.events()] == reasons
    assert link.sent["events"] - sent == PACK_AHEAD + 1


def test_a_link_behind_sends_what_waits_at_each_acknowledgement(cluster) -> None:
    """Records that wait for the window (`PACK_AHEAD`) go up when an acknowledgement makes room, with no done
    or later record to push them: nothing is stranded in the sink."""
    link = cluster.link("c0")
    producer = link.producer("c0")
    gate = threading.Event()
    link._packer.submit(gate.wait, 30)
    for i in range(PACK_AHEAD):
        producer.record(_lost(1, f"out{i}"))
        link._thread.submit(asyncio.sleep(0)).result(5)
    last = producer.record(_lost(3, "held"))
    gate.set()
    link.sink.commit(last, remote=True, timeout_s=10)
    assert len(cluster.events()) == PACK_AHEAD + 3
