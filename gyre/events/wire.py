"""Events on the wire: an Arrow IPC stream holding one record batch of the log's event schema.

The batch is the log's own encoding (`gyre.events.codec`), so what the controller appends is bit for bit
what the producer built. ``seq`` is the log's to assign: it travels as 0.. and comes back as ``None``.
An event without a ``ts`` is stamped when packed (the sender's clock, as `LogSink` would stamp it);
`RemoteSink` stamps at ``record`` already, so a record re-packed after a reconnect keeps its time.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from gyre.errors import EventValidationError
from gyre.events.codec import check_events, decode, encode
from gyre.events.models import Event
from gyre.events.schema import event_schema


def pack_events(events: Sequence[Event]) -> bytes:
    """One Arrow IPC stream of ``events`` (an empty sequence packs as a stream with no batch)."""
    checked = check_events(events)
    out = pa.BufferOutputStream()
    if not checked:
        with pa.ipc.new_stream(out, event_schema()):
            pass
        return out.getvalue().to_pybytes()
    batch = encode(checked, 0)
    with pa.ipc.new_stream(out, batch.schema) as writer:
        writer.write_batch(batch)
    return out.getvalue().to_pybytes()


def unpack_events(data: bytes) -> list[Event]:
    """The events of a packed batch, ``seq`` cleared; a malformed buffer is an `EventValidationError`."""
    try:
        batches = list(pa.ipc.open_stream(pa.py_buffer(data)))
    except (pa.ArrowInvalid, OSError) as e:
        raise EventValidationError(f"an event batch of {len(data)} bytes is not an Arrow IPC stream: {e}") from e
    return [event.model_copy(update={"seq": None}) for batch in batches for event in decode(batch)]


def unpack_batches(data: bytes) -> list[pa.RecordBatch]:
    """A packed stream's batches as they arrived, ``seq`` dropped (the log assigns it): what the controller
    appends without decoding a row. A malformed buffer is an `EventValidationError`."""
    try:
        batches = list(pa.ipc.open_stream(pa.py_buffer(data)))
    except (pa.ArrowInvalid, OSError) as e:
        raise EventValidationError(f"an event batch of {len(data)} bytes is not an Arrow IPC stream: {e}") from e
    return [b.drop_columns(["seq"]) if "seq" in b.schema.names else b for b in batches if b.num_rows]


def batch_to_ipc(batch: pa.RecordBatch) -> bytes:
    """A log record batch (seqs kept) as one Arrow IPC stream: how the controller serves its log."""
    out = pa.BufferOutputStream()
    with pa.ipc.new_stream(out, batch.schema) as writer:
        writer.write_batch(batch)
    return out.getvalue().to_pybytes()


def ipc_to_batch(data: bytes) -> pa.RecordBatch:
    """The record batch of `batch_to_ipc`'s bytes."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
    except (pa.ArrowInvalid, OSError, StopIteration) as e:
        raise EventValidationError(f"a log batch of {len(data)} bytes is not an Arrow IPC stream: {e}") from e
