"""`RemoteSink` without a stream: how records coalesce into wire batches and what an ack covers."""

import pytest

from gyre.cluster.link import RemoteSink
from gyre.cluster.proto import gyre_pb2
from gyre.events import CellLost, ModelCallFinished
from gyre.sink import Producer, SinkError


def _sink() -> tuple[RemoteSink, Producer]:
    sink = RemoteSink(["p"], notify=lambda: None)
    return sink, Producer(sink, "p")


def test_records_coalesce_within_the_limits() -> None:
    sink, producer = _sink()
    sink.BATCH_EVENTS = 5
    for n in (2, 2, 2, 1, 3):
        producer.record([CellLost(cell_id="c0")] * n)
    groups = sink._batches(0)
    assert [[r.record_id for r in group] for group in groups] == [[1, 2], [3, 4], [5]]
    assert [[r.record_id for r in group] for group in sink._batches(3)] == [[4, 5]]


def test_a_heavy_record_travels_alone() -> None:
    sink, producer = _sink()
    sink.BATCH_WEIGHT = 1000
    call = ModelCallFinished(execution_id="e", call_id="k", cell_id="c0", output_ids=[1] * 600,
                             output_logprobs=[-0.5] * 600)
    producer.record([CellLost(cell_id="c0")])
    producer.record([call])
    producer.record([CellLost(cell_id="c0")])
    assert [[r.record_id for r in group] for group in sink._batches(0)] == [[1], [2], [3]]


def test_an_ack_covers_every_record_up_to_it() -> None:
    sink, producer = _sink()
    positions = [producer.record([CellLost(cell_id="c0")] * 2) for _ in range(4)]
    assert positions == [1, 3, 5, 7]
    sink._ack(gyre_pb2.EventAck(batch_id=3, durable=True))
    sink.commit(positions[2])  # returns at once: records 1..3 are durable
    assert sink.unacked == 1
    sink._ack(gyre_pb2.EventAck(batch_id=2, durable=True))  # a late, smaller ack changes nothing
    assert sink.unacked == 1
    sink._ack(gyre_pb2.EventAck(batch_id=4, error="gap"))
    with pytest.raises(SinkError, match="refused event batch 4: gap"):
        sink.commit()
    with pytest.raises(ValueError, match="never returned by this sink"):
        sink.commit(99)
