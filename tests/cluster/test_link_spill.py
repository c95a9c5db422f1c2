"""The link's spill: events stay durable while the controller is down, and survive a kill of the process.

A real `Hub` over a `LogSink` and `ControllerLink`s over gRPC, as in test_hub. The controller goes down with
``Hub.stop`` and comes back as a new sink over the same log and a new hub on the same port (the producer
table read back from the log), which is what ``gyre run --resume`` does after a kill -9.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.cluster.errors import ClusterError
from gyre.cluster.hub import Hub
from gyre.cluster.link import ControllerLink
from gyre.cluster.spill import SUFFIX, Spill, spill_path
from gyre.events import CellLost
from gyre.log.writer import LogWriter
from tests.cluster.conftest import RUN_ID, Cluster, GatedSink

FAST = {"backoff_s": (0.01, 0.1)}
WAIT_S = 20.0  # generous: CI is a loaded 2-core machine; nothing here waits for a timeout to pass


def _lost(n: int, tag: str) -> list[CellLost]:
    return [CellLost(cell_id="c0", reason=f"{tag}{i}") for i in range(n)]


def _stamped(seqs: range, tag: str = "s") -> list[CellLost]:
    return [CellLost(cell_id="c0", reason=f"{tag}{i}", producer="c0", producer_seq=i) for i in seqs]


def _stamps(events: list[Any]) -> list[tuple[str | None, int | None]]:
    return [(e.producer, e.producer_seq) for e in events]


def _segments(path: Path) -> list[Path]:
    return sorted(path.glob(f"*{SUFFIX}"))


def _down(cluster: Cluster) -> None:
    """The controller dies: its streams end, its log is closed."""
    cluster.hub.stop()
    cluster.sink.close()


def _up(cluster: Cluster) -> None:
    """The controller resumes: a sink over the same log (its producer table rebuilt) and a hub on the same port."""
    cluster.sink = GatedSink(LogWriter(cluster.path, run_id=RUN_ID), on_record=cluster._on_record)
    cluster.hub = Hub(cluster.sink, run_id=RUN_ID, secret=cluster.secret, port=int(cluster.address.rsplit(":", 1)[1]))
    cluster.hub.start()


def test_events_stay_durable_while_the_controller_is_down_and_land_once_after(cluster, tmp_path) -> None:
    spill_dir = spill_path(tmp_path, "c0")
    link = cluster.link("c0", spill_dir=spill_dir, **FAST)
    producer = link.producer("c0")
    link.sink.commit(producer.record(_lost(2, "a")))
    assert _segments(spill_dir) == []  # acknowledged by the controller: nothing was spilled

    _down(cluster)
    first = producer.record(_lost(2, "b0."))
    asyncio.run(asyncio.wait_for(link.sink.durable(first), WAIT_S))  # durable in the spill, with no controller
    positions = [first] + [producer.record(_lost(2, f"b{i}.")) for i in (1, 2)]
    link.sink.commit(positions[-1], timeout_s=WAIT_S)
    assert _segments(spill_dir) and link.sink.unacked == 3
    with pytest.raises(TimeoutError, match="in the controller"):
        link.sink.commit(remote=True, timeout_s=0.01)

    _up(cluster)
    last = producer.record(_lost(1, "c"))  # before or after the link is back
    link.sink.commit(last, remote=True, timeout_s=WAIT_S)
    assert link.sink.unacked == 0 and link.connections >= 2
    link.close(timeout_s=WAIT_S)  # lets the spill writer finish dropping what was acknowledged
    assert _segments(spill_dir) == []
    events = cluster.events()
    assert [e.reason for e in events] == ["a0", "a1", "b0.0", "b0.1", "b1.0", "b1.1", "b2.0", "b2.1", "c0"]
    assert _stamps(events) == [("c0", i) for i in range(9)]


def test_a_killed_process_hands_its_spill_to_the_next_incarnation(cluster, tmp_path) -> None:
    spill_dir = spill_path(tmp_path, "c0")
    old = cluster.link("c0", incarnation="one", spill_dir=spill_dir, **FAST)
    producer = old.producer("c0")
    old.sink.commit(producer.record(_lost(2, "a")))
    _down(cluster)
    old.sink.commit(producer.record(_lost(3, "b")), timeout_s=WAIT_S)  # in the spill only
    old.sever()  # kill -9: no flush, no goodbye
    _up(cluster)

    new = cluster.link("c0", incarnation="two", spill_dir=spill_dir, **FAST)
    assert new.welcome.held["c0"] == 1  # the log holds a only
    producer = new.producer("c0")
    assert producer.next_seq == 5  # after the spilled b, not after what the log holds
    new.sink.commit(producer.record(_lost(1, "c")), remote=True, timeout_s=WAIT_S)
    new.close(timeout_s=WAIT_S)
    assert _segments(spill_dir) == []
    events = cluster.events()
    assert [e.reason for e in events] == ["a0", "a1", "b0", "b1", "b2", "c0"]
    assert _stamps(events) == [("c0", i) for i in range(6)]


def test_a_spill_the_controller_already_holds_is_not_doubled(cluster, tmp_path) -> None:
    spill_dir = spill_path(tmp_path, "c0")
    old = cluster.link("c0", incarnation="one", spill_dir=spill_dir, **FAST)
    producer = old.producer("c0")
    cluster.sink.gate.clear()  # the hub records a but holds its acknowledgement
    position = producer.record(_lost(2, "a"))
    cluster.wait_recorded(2)
    cluster.hub.drop("c0")  # the break spills a, unacknowledged
    old.sink.commit(position, timeout_s=WAIT_S)
    assert _segments(spill_dir)
    old.sever()
    cluster.sink.gate.set()

    new = cluster.link("c0", incarnation="two", spill_dir=spill_dir, **FAST)
    assert new.welcome.held["c0"] == 1
    producer = new.producer("c0")
    assert producer.next_seq == 2
    new.sink.commit(producer.record(_lost(1, "b")), remote=True, timeout_s=WAIT_S)  # a re-sent first, dropped
    new.close(timeout_s=WAIT_S)
    events = cluster.events()
    assert [e.reason for e in events] == ["a0", "a1", "b0"]
    assert _stamps(events) == [("c0", i) for i in range(3)]
    assert _segments(spill_dir) == []


def test_a_close_while_the_controller_is_down_keeps_the_spill(cluster, tmp_path) -> None:
    spill_dir = spill_path(tmp_path, "c0")
    old = cluster.link("c0", incarnation="one", spill_dir=spill_dir, **FAST)
    producer = old.producer("c0")
    _down(cluster)
    producer.record(_lost(2, "a"))
    with pytest.raises(ClusterError, match=r"not acknowledged durable within 0\.05 s of close.*stay in the spill"):
        old.close(timeout_s=0.05)
    assert _segments(spill_dir)
    _up(cluster)
    new = cluster.link("c0", incarnation="two", spill_dir=spill_dir, **FAST)
    assert new.producer("c0").next_seq == 2
    new.close(timeout_s=WAIT_S)  # the flush waits for the controller to hold the spilled a
    assert [e.reason for e in cluster.events()] == ["a0", "a1"]
    assert _segments(spill_dir) == []


def test_a_torn_spill_tail_is_ignored(cluster, tmp_path) -> None:
    spill_dir = spill_path(tmp_path, "c0")
    spill = Spill(spill_dir)
    spill.append([(1, _stamped(range(0, 2))), (2, _stamped(range(2, 3)))])
    spill.append([(3, _stamped(range(3, 5)))])
    spill.close()
    [segment] = _segments(spill_dir)
    data = segment.read_bytes()
    segment.write_bytes(data[:-7])  # killed mid-append: the last frame is torn
    again = Spill(spill_dir)
    assert [(r.record_id, [e.producer_seq for e in r.events]) for r in again.load()] == [(1, [0, 1]), (2, [2])]
    again.close()

    link = cluster.link("c0", spill_dir=spill_dir, **FAST)  # takes over records 1 and 2, continues after them
    producer = link.producer("c0")
    assert producer.next_seq == 3
    link.sink.commit(producer.record(_lost(1, "n")), remote=True, timeout_s=WAIT_S)
    link.close(timeout_s=WAIT_S)
    events = cluster.events()
    assert [e.reason for e in events] == ["s0", "s1", "s2", "n0"]
    assert _stamps(events) == [("c0", i) for i in range(4)]


def test_a_corrupt_frame_ends_its_segment(tmp_path) -> None:
    spill = Spill(tmp_path / "s")
    spill.append([(1, _stamped(range(0, 1))), (2, _stamped(range(1, 2)))])
    spill.close()
    [segment] = _segments(tmp_path / "s")
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF  # a flipped payload byte of the last frame: its checksum no longer matches
    segment.write_bytes(bytes(data))
    again = Spill(tmp_path / "s")
    assert [r.record_id for r in again.load()] == [1]
    again.close()
    segment.write_bytes(b"GSP")  # not even a whole header: the segment holds nothing, and goes
    again = Spill(tmp_path / "s")
    assert again.load() == [] and again.empty and _segments(tmp_path / "s") == []
    again.close()


def test_segments_roll_and_go_once_acknowledged(tmp_path) -> None:
    spill = Spill(tmp_path / "s", segment_bytes=1)  # every append opens a segment
    for record_id in (1, 2, 3):
        spill.append([(record_id, _stamped(range(record_id, record_id + 1)))])
    assert len(_segments(tmp_path / "s")) == 3
    with pytest.raises(ValueError, match="not after 3"):
        spill.append([(3, _stamped(range(9, 10)))])
    spill.drop_upto(2)
    assert [r.record_id for r in spill.load()] == [3] and len(_segments(tmp_path / "s")) == 1
    with pytest.raises(ClusterError, match="held by another live process"):
        Spill(tmp_path / "s")
    spill.drop_upto(3)
    assert spill.empty and _segments(tmp_path / "s") == []
    spill.append([(4, _stamped(range(4, 5)))])  # a fresh segment after everything went
    spill.close()
    again = Spill(tmp_path / "s")
    assert [r.record_id for r in again.load()] == [4]
    again.close()


def test_no_spill_is_written_while_the_controller_is_up(cluster, tmp_path) -> None:
    spill_dir = spill_path(tmp_path, "c0")
    link = cluster.link("c0", spill_dir=spill_dir, **FAST)
    producer = link.producer("c0")
    cluster.sink.gate.clear()  # unacknowledged, but the stream is live: only the controller can make it durable
    position = producer.record(_lost(2, "a"))
    cluster.wait_recorded(2)
    with pytest.raises(TimeoutError):
        link.sink.commit(position, timeout_s=0.05)
    assert _segments(spill_dir) == [] and link.sink.online
    cluster.sink.gate.set()
    link.sink.commit(position, timeout_s=WAIT_S)
    link.close(timeout_s=WAIT_S)
    assert _segments(spill_dir) == []


STEPS = st.lists(st.sampled_from(["record", "record", "commit", "drop", "down", "up", "restart"]), max_size=10)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_any_interleaving_lands_each_durable_event_exactly_once(tmp_path, steps: list[str]) -> None:
    """Records, breaks, controller restarts and process kills in any order: the log holds every event that was
    durable when its process died and every event of the last incarnation, each once, producer_seq gapless."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # hypothesis reuses tmp_path across examples
    cluster = Cluster(root)
    spill_dir = spill_path(root, "c0")
    incarnations = itertools.count()
    up = True
    recorded: list[str] = []  # every reason recorded, in order
    durable: set[str] = set()  # the reasons a commit returned for
    pending: list[str] = []  # recorded by the current incarnation since its last commit
    tags = itertools.count()

    def start() -> ControllerLink:
        return cluster.link("c0", incarnation=f"i{next(incarnations)}", spill_dir=spill_dir, **FAST)

    link = start()
    producer = link.producer("c0")
    try:
        for step in steps:
            if step == "record":
                tag = next(tags)
                reasons = [f"r{tag}.{i}" for i in range(1 + tag % 3)]
                producer.record([CellLost(cell_id="c0", reason=r) for r in reasons])
                recorded += reasons
                pending += reasons
            elif step == "commit":
                link.sink.commit(timeout_s=WAIT_S)
                durable.update(pending)
                pending = []
            elif step == "drop" and up:
                cluster.hub.drop("c0")
            elif step == "down" and up:
                _down(cluster)
                up = False
            elif step == "up" and not up:
                _up(cluster)
                up = True
            elif step == "restart" and up:  # kill -9, then the process restarts (it needs its controller)
                link.sever()
                pending = []  # never made durable: a killed process may lose them
                link = start()
                producer = link.producer("c0")
        if not up:
            _up(cluster)
            up = True
        link.sink.commit(remote=True, timeout_s=WAIT_S)
        durable.update(pending)
        link.close(timeout_s=WAIT_S)
        assert _segments(spill_dir) == []
        events = cluster.events()
        logged = [e.reason for e in events]
        assert _stamps(events) == [("c0", i) for i in range(len(events))]  # gapless, none twice
        assert len(set(logged)) == len(logged)
        assert durable <= set(logged)
        order = {reason: i for i, reason in enumerate(recorded)}
        assert [order[r] for r in logged] == sorted(order[r] for r in logged)  # in the order recorded
    finally:
        cluster.sink.gate.set()
        if not up:
            _up(cluster)
        cluster.close()
