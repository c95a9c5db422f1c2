"""The one sink protocol: ordered recording, durability, and exactly-once delivery per producer."""

import asyncio
import threading

import pytest

from gyre.events.models import RewardRecorded
from gyre.log import LogReader, LogWriter
from gyre.sink import EventSink, LogSink, MemorySink, NullSink, Producer, SinkError


def reward(execution_id: str, value: float = 0.5) -> RewardRecorded:
    return RewardRecorded(execution_id=execution_id, reward=value)


def test_every_sink_speaks_the_one_protocol(tmp_path):
    with LogSink(LogWriter(tmp_path / "log")) as log_sink:
        sinks = [log_sink, MemorySink(), NullSink(), log_sink.producer("p")]
        assert all(isinstance(s, EventSink) for s in sinks)


def test_a_resent_batch_is_never_doubled_and_a_gap_is_refused(tmp_path):
    with LogSink(LogWriter(tmp_path / "log", run_id="r")) as sink:
        producer = sink.producer("proxy")
        batch = [reward("e1"), reward("e2")]
        producer.record(batch)
        stamped = [e.model_copy(update={"producer": "proxy", "producer_seq": i}) for i, e in enumerate(batch)]
        sink.record(stamped)  # the same batch again, as after a reconnect: dropped whole
        sink.record([*stamped, reward("e3").model_copy(update={"producer": "proxy", "producer_seq": 2})])
        with pytest.raises(SinkError, match="skipped from 2 to 5"):
            sink.record(reward("e6").model_copy(update={"producer": "proxy", "producer_seq": 5}))
        sink.commit()
    events = list(LogReader(tmp_path / "log").events())
    assert [(e.execution_id, e.producer_seq) for e in events] == [("e1", 0), ("e2", 1), ("e3", 2)]


def test_a_reopened_log_remembers_what_each_producer_sent(tmp_path):
    with LogSink(LogWriter(tmp_path / "log")) as sink:
        sink.producer("harness").record([reward("e1"), reward("e2")])
    with LogSink(LogWriter(tmp_path / "log")) as sink:
        assert sink.held("harness") == 1
        again = sink.producer("harness")
        assert again.next_seq == 2  # a restarted producer continues its sequence
        old = Producer(sink, "harness", next_seq=1)  # a producer re-sending its unacknowledged tail
        old.record([reward("e2"), reward("e3")])
    events = list(LogReader(tmp_path / "log").events())
    assert [e.execution_id for e in events] == ["e1", "e2", "e3"]


def test_on_record_sees_exactly_what_the_log_holds_in_seq_order(tmp_path):
    seen: list[tuple[int, list]] = []
    with LogSink(LogWriter(tmp_path / "log"), on_record=lambda first, events: seen.append((first, events))) as sink:
        producers = [sink.producer(f"p{i}") for i in range(4)]

        def produce(p: Producer) -> None:
            for n in range(25):
                p.record(reward(f"{p.producer_id}-{n}"))

        threads = [threading.Thread(target=produce, args=(p,)) for p in producers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    logged = list(LogReader(tmp_path / "log").events())
    folded = [e for _, events in seen for e in events]
    assert [first for first, _ in seen] == list(range(100))
    assert [e.model_dump(exclude={"seq"}) for e in folded] == [e.model_dump(exclude={"seq"}) for e in logged]


def test_durable_waits_for_the_disk(tmp_path):
    writer = LogWriter(tmp_path / "log")
    with LogSink(writer, flush_interval_s=None) as sink:
        position = sink.record(reward("e1"))

        async def wait() -> None:
            await sink.durable(position)

        asyncio.run(wait())
        assert writer.durable_seq >= position
        sink.commit(sink.record(reward("e2")))
        assert writer.durable_seq == writer.next_seq - 1


def _arrow(events: list, producer: str, first: int):
    """A remote producer's batch as the hub receives it (stamped, packed, seq dropped)."""
    from gyre.events.wire import pack_events, unpack_batches

    stamped = [e.model_copy(update={"producer": producer, "producer_seq": first + i}) for i, e in enumerate(events)]
    (batch,) = unpack_batches(pack_events(stamped))
    return batch


def test_an_arrow_batch_is_deduplicated_gap_checked_and_handed_on_as_the_log_holds_it(tmp_path):
    """`record_batch` keeps `record`'s rules on columns: re-sent rows dropped, a gap refused, own times kept,
    and `on_record` gets the rows the log holds, with the times it holds."""
    from datetime import UTC, datetime

    seen: list[tuple[int, object]] = []
    own = datetime(2026, 2, 1, tzinfo=UTC)
    with LogSink(LogWriter(tmp_path / "log", run_id="r"), on_record=lambda first, b: seen.append((first, b))) as sink:
        sink.record_batch(_arrow([reward("e1"), reward("e2").model_copy(update={"ts": own})], "cell", 0))
        sink.record_batch(_arrow([reward("e1"), reward("e2"), reward("e3")], "cell", 0))  # re-sent after a break
        assert sink.held("cell") == 2
        with pytest.raises(SinkError, match="skipped from 2 to 5"):
            sink.record_batch(_arrow([reward("e6")], "cell", 5))
        sink.commit()
    logged = LogReader(tmp_path / "log").table()
    assert logged.column("execution_id").to_pylist() == ["e1", "e2", "e3"]
    assert logged.column("ts").to_pylist()[1] == own
    assert [(first, b.num_rows) for first, b in seen] == [(0, 2), (2, 1)]
    handed = [t for _, b in seen for t in b.column("ts").to_pylist()]
    assert handed == logged.column("ts").to_pylist()
