"""Events <-> Arrow record batches under the log schema.

``encode`` is the hot path of the one-event-at-a-time API: it builds each column once per batch from
plain attribute reads (no ``model_dump`` per event, no row dictionaries), then places each kind's compact
struct array at its rows with one ``take``.
"""

import math
import sys
import time
from array import array
from base64 import b64decode, b64encode
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache, lru_cache
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ValidationError

from gyre.errors import EventValidationError
from gyre.events.models import ENVELOPE_FIELDS, EVENT_TYPES, Event, event_type
from gyre.events.schema import (
    ENVELOPE_TYPES,
    TS_TYPE,
    current_column,
    event_schema,
    payload_type,
    required_envelope,
)


def now_us() -> int:
    return time.time_ns() // 1000


@cache
def _dumped_fields(kind: str) -> frozenset[str]:
    """Payload fields holding nested models, which Arrow needs as dictionaries."""
    model = EVENT_TYPES[kind]
    out = set()
    for name in model.payload_fields():
        sample_type = payload_type(kind).field(name).type
        if pa.types.is_struct(sample_type) or (
            pa.types.is_list(sample_type) and pa.types.is_struct(sample_type.value_type)
        ):
            out.add(name)
    return frozenset(out)


def _dump(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(t: datetime) -> int:
    """Microseconds since the epoch, exactly (float seconds would round some microseconds away)."""
    if t.tzinfo is None:
        raise EventValidationError(f"event ts {t.isoformat()} has no time zone; Gyre stores UTC timestamps")
    return (t - _EPOCH) // timedelta(microseconds=1)


def check_events(events: Iterable[Any]) -> list[Event]:
    """Refuse anything that is not a validated event, naming the offending position."""
    out = events if isinstance(events, list) else list(events)
    for index, event in enumerate(out):
        if not isinstance(event, Event) or type(event) is Event:
            raise EventValidationError(
                f"item {index} is a {type(event).__name__}, not a Gyre event; build events with the models "
                f"in gyre.events (or parse dictionaries with gyre.events.parse_event)"
            )
    return out


def encode(events: Sequence[Event], first_seq: int, stamps_us: Sequence[int] | int | None = None,
           run_id: str | None = None) -> pa.RecordBatch:
    """Encode validated events as one *sparse* record batch: the envelope plus the kinds present.

    Seqs are ``first_seq ..``, consecutive. An event's own ``ts`` wins over ``stamps_us`` (the time the
    writer accepted it), so simulated and replayed runs keep their clocks.

    Each kind's events are transposed once into columns (a model's ``__dict__`` holds its fields in
    declaration order: the envelope first, then the payload); envelope columns of several kinds are
    concatenated and put back in row order with one ``take``.
    """
    if len(events) < ROWS_ENCODE_BELOW:
        return _encode_rows(events, first_seq, stamps_us, run_id)
    return _encode_columns(events, first_seq, stamps_us, run_id)


def _encode_columns(events: Sequence[Event], first_seq: int, stamps_us: Sequence[int] | int | None,
                    run_id: str | None) -> pa.RecordBatch:
    """``encode`` for a large batch: one Arrow conversion per field of each kind."""
    n = len(events)
    groups: dict[str, list[int]] = {}
    for index, event in enumerate(events):
        groups.setdefault(event.kind, []).append(index)
    envelope: list[list[pa.Array]] = [[] for _ in ENVELOPE_FIELDS]
    payloads: dict[str, pa.StructArray] = {}
    for kind in sorted(groups, key=_KIND_ORDER.__getitem__):  # schema order
        members = [events[i] for i in groups[kind]] if len(groups) > 1 else events
        fields = list(zip(*[e.__dict__.values() for e in members], strict=True))
        for position, name in enumerate(ENVELOPE_FIELDS[1:], start=1):  # seq is assigned, not read
            envelope[position].append(_envelope_array(name, fields[position]))
        struct_type = payload_type(kind)
        dumped = _dumped_fields(kind)
        children = []
        for field, values in zip(struct_type, fields[len(ENVELOPE_FIELDS):], strict=True):
            if field.name in dumped:
                values = [_dump(v) for v in values]
            children.append(pa.array(values, field.type))
        payloads[kind] = pa.StructArray.from_arrays(children, fields=list(struct_type))

    order = None
    if len(groups) > 1:
        grouped = np.concatenate([np.asarray(groups[k]) for k in sorted(groups, key=_KIND_ORDER.__getitem__)])
        order = pa.array(np.argsort(grouped, kind="stable"))
    columns: dict[str, pa.Array] = {
        "seq": pa.array(np.arange(first_seq, first_seq + n, dtype=np.int64)),
        "ts": _stamps(envelope[1], order, n, stamps_us),
        "kind": pa.array([e.kind for e in events], pa.string()),
    }
    for position, name in enumerate(ENVELOPE_FIELDS[2:], start=2):
        array = envelope[position][0] if order is None else pa.concat_arrays(envelope[position]).take(order)
        if name == "run_id" and run_id is not None and array.null_count:
            array = pc.fill_null(array, pa.scalar(run_id, pa.string()))
        columns[name] = array
    for kind, compact in payloads.items():
        rows = groups[kind]
        if len(rows) == n:
            columns[kind] = compact
        else:
            positions = np.full(n, -1, dtype=np.int64)
            positions[rows] = np.arange(len(rows), dtype=np.int64)
            columns[kind] = compact.take(pa.array(positions, mask=positions < 0))
    return _sparse_batch(columns, event_schema())


_KIND_ORDER = {kind: index for index, kind in enumerate(EVENT_TYPES)}

ROWS_ENCODE_BELOW = 128
"""Batches smaller than this are encoded row by row in one Arrow conversion: a column per field costs
a fixed ~5 µs of Arrow call each (~30 columns: 0.7 ms for a call's two events, the proxy's whole batch),
while rows cost per value; the two meet at ~200 rows of model calls."""

_EVENT_ENVELOPE = ENVELOPE_FIELDS[2:]  # what a row copies from the event as is (seq and ts are assigned)


@lru_cache(maxsize=256)
def _row_schema(kinds: frozenset[str]) -> tuple[pa.StructType, pa.Schema]:
    """The sparse schema of a batch holding ``kinds``, and the struct type of one of its rows."""
    full = event_schema()
    fields = [f for f in full if f.name in ENVELOPE_TYPES or f.name == "kind" or f.name in kinds]
    return pa.struct(fields), pa.schema(fields, metadata=full.metadata)


def _encode_rows(events: Sequence[Event], first_seq: int, stamps_us: Sequence[int] | int | None,
                 run_id: str | None) -> pa.RecordBatch:
    """``encode`` for a small batch: row dictionaries converted by one Arrow call (the same conversions)."""
    rows, kinds = _rows(events, first_seq, stamps_us, run_id)
    row_type, schema = _row_schema(kinds)
    return rows_batch(rows, row_type, schema.metadata)


def _rows(events: Sequence[Event], first_seq: int, stamps_us: Sequence[int] | int | None,
          run_id: str | None) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """The events as the rows of their sparse batch (``seq`` and ``ts`` as integers), and the kinds present."""
    if stamps_us is None:
        stamps_us = now_us()
    rows = []
    kinds = set()
    skip = len(ENVELOPE_FIELDS)
    for index, event in enumerate(events):
        values = event.__dict__
        kind = event.kind
        row = {name: values[name] for name in _EVENT_ENVELOPE}
        if run_id is not None and row["run_id"] is None:
            row["run_id"] = run_id
        own = values["ts"]
        row["seq"] = first_seq + index
        row["ts"] = to_us(own) if own is not None else stamps_us if isinstance(stamps_us, int) else stamps_us[index]
        row["kind"] = kind
        payload = dict(list(values.items())[skip:])
        for name in _dumped_fields(kind):
            payload[name] = _dump(payload[name])
        row[kind] = payload
        kinds.add(kind)
        rows.append(row)
    return rows, frozenset(kinds)


def rows_batch(rows: list[dict[str, Any]], row_type: pa.StructType, metadata: Any) -> pa.RecordBatch:
    """The record batch of ``rows`` (as `_rows` builds them) whose columns are ``row_type``'s fields."""
    return pa.RecordBatch.from_struct_array(pa.array(rows, row_type)).replace_schema_metadata(metadata)


def encode_json_rows(events: Sequence[Event], first_seq: int, stamps_us: Sequence[int] | int | None = None,
                     run_id: str | None = None) -> tuple[bytes, tuple[str, ...]] | None:
    """``encode``'s rows as a JSON array, and the names of the columns they fill (in schema order): what
    `decode_json_rows` turns back into exactly the batch ``encode`` gives. Token ids and log-probabilities
    (``list<int32>``, ``list<float32>``) travel packed, as base64 of their little-endian values, so that
    neither side converts them number by number. ~20 us for a model call's two events where Arrow's
    conversion and IPC message cost ~100 us (several times that from a cold cache, as a lone call's commit
    is). None where JSON cannot carry every value exactly: a kind with nested or timestamp fields, a float
    field that is not finite (JSON has no NaN or infinity), an id beyond int32."""
    for event in events:
        if _json_fields(event.kind) is None:
            return None
    rows, kinds = _rows(events, first_seq, stamps_us, run_id)
    for row in rows:
        kind = row["kind"]
        floats, packed = _json_fields(kind)  # type: ignore[misc]
        payload = row[kind]
        for name in floats:
            value = payload[name]
            if value is not None and not math.isfinite(value):
                return None
        for name, code in packed:
            value = payload[name]
            if value is not None:
                try:
                    values = array(code, value)
                except (TypeError, OverflowError):
                    return None
                if _BIG_ENDIAN:
                    values.byteswap()
                payload[name] = b64encode(values.tobytes()).decode("ascii")
    try:  # (integers beyond 2**53 and strings that are not UTF-8 are left to Arrow, which says what it takes)
        data = orjson.dumps(rows, option=orjson.OPT_STRICT_INTEGER)
    except orjson.JSONEncodeError:
        return None
    return data, tuple(_row_schema(kinds)[1].names)


def decode_json_rows(data: bytes | memoryview, row_type: pa.StructType, metadata: Any) -> pa.RecordBatch:
    """The batch of `encode_json_rows`'s JSON (``row_type``: the struct of its columns, as stored)."""
    return rows_batch(json_rows(data), row_type, metadata)


def json_rows(data: bytes | memoryview) -> list[Any]:
    """`encode_json_rows`'s rows, its packed lists as numpy views: what `rows_batch` converts (the rows of
    several frames of one column set in one conversion: its fixed cost, ~0.1 ms, is most of a call's)."""
    rows = orjson.loads(data)
    if not isinstance(rows, list):
        raise pa.ArrowInvalid("a rows body that is not a JSON array")
    for row in rows:
        kind = row.get("kind") if isinstance(row, dict) else None
        fields = _json_fields(kind) if kind in EVENT_TYPES else None
        payload = row.get(kind) if fields is not None else None
        if not isinstance(payload, dict):
            continue  # (Arrow's conversion says what is wrong with such a row)
        for name, code in fields[1]:  # type: ignore[index]
            value = payload.get(name)
            if isinstance(value, str):
                payload[name] = np.frombuffer(b64decode(value, validate=True), dtype=_PACKED_DTYPES[code])
    return rows


_JSON_SCALARS = (pa.types.is_integer, pa.types.is_string, pa.types.is_boolean)
_PACKED_CODES = {pa.int32(): "i", pa.float32(): "f"}
_PACKED_DTYPES = {"i": np.dtype("<i4"), "f": np.dtype("<f4")}
_BIG_ENDIAN = sys.byteorder == "big"


@cache
def _json_fields(kind: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None:
    """For a kind whose payload JSON carries exactly (integers, strings, booleans, floats, lists of them),
    the names of its float fields (checked for NaN and infinity) and its packed lists (name, array code);
    None for any other kind."""
    floats, packed = [], []
    for field in payload_type(kind):
        if pa.types.is_list(field.type):
            item = field.type.value_type
            if item in _PACKED_CODES:
                packed.append((field.name, _PACKED_CODES[item]))
            elif not any(test(item) for test in _JSON_SCALARS):
                return None
        elif pa.types.is_floating(field.type):
            floats.append(field.name)
        elif not any(test(field.type) for test in _JSON_SCALARS):
            return None
    return tuple(floats), tuple(packed)


def _envelope_array(name: str, values: tuple) -> pa.Array:
    if name == "ts":  # datetimes or None: converted exactly in _stamps
        return pa.array([None if t is None else to_us(t) for t in values], pa.int64())
    return pa.array(values, ENVELOPE_TYPES[name])


def _stamps(own: list[pa.Array], order: pa.Array | None, n: int,
            stamps_us: Sequence[int] | int | None) -> pa.Array:
    """``ts``: the event's own time where it has one, else the time the writer accepted it."""
    mine = own[0] if order is None else pa.concat_arrays(own).take(order)
    if stamps_us is None or isinstance(stamps_us, int):
        fallback = pa.scalar(now_us() if stamps_us is None else stamps_us, pa.int64())
    else:
        fallback = pa.array(np.asarray(stamps_us, dtype=np.int64))
    if mine.null_count == n:
        merged = fallback if isinstance(fallback, pa.Array) else pa.repeat(fallback, n)
    else:
        merged = pc.coalesce(mine, fallback)
    return merged.cast(TS_TYPE)


def stamped_ts(own: pa.Array | None, rows: int, stamp_us: int) -> pa.Array:
    """A producer batch's ``ts`` (``encode``'s rule, for Arrow batches): a row's own time where it has
    one, else ``stamp_us``, the time the log accepted it."""
    if own is not None and own.null_count == 0:
        return own
    stamps = pa.Array.from_buffers(TS_TYPE, rows, [None, pa.py_buffer(np.full(rows, stamp_us, dtype=np.int64))])
    return stamps if own is None or own.null_count == rows else pc.coalesce(own.cast(TS_TYPE), stamps)


def decode_kinds(batch: pa.RecordBatch, kinds: frozenset[str] | None) -> list[tuple[int, Event]]:
    """The events of the rows whose kind is in ``kinds`` (None: every row), each with its row index: a
    columnar consumer decodes only what it reads as objects."""
    if kinds is None:
        return list(enumerate(decode(batch)))
    wanted = pc.is_in(batch.column("kind"), value_set=pa.array(sorted(kinds), pa.string()))
    rows = np.flatnonzero(wanted.to_numpy(zero_copy_only=False))
    if not len(rows):
        return []
    chosen = batch if len(rows) == batch.num_rows else batch.filter(wanted)
    return list(zip(rows.tolist(), decode(chosen), strict=True))


def _sparse_batch(columns: dict[str, pa.Array], schema: pa.Schema) -> pa.RecordBatch:
    fields = [f for f in schema if f.name in columns]
    return pa.RecordBatch.from_arrays([columns[f.name] for f in fields],
                                      schema=pa.schema(fields, metadata=schema.metadata))


def decode(batch: pa.RecordBatch) -> Iterator[Event]:
    """Events of a batch, in row order. Null payload fields take the model's default (additive evolution)."""
    # Only the columns read are brought to the current schema (``evolve`` of the whole batch would build
    # null columns for every absent kind: half the cost of decoding a few rows).
    rows = batch.num_rows
    envelope = {}
    for name in ENVELOPE_FIELDS:
        column = current_column(batch, name)
        envelope[name] = [None] * rows if column is None else column.to_pylist()
    kinds = batch.column("kind").to_pylist()
    payloads: dict[str, Iterator[dict]] = {}
    for kind in set(kinds):
        column = current_column(batch, kind)
        mask = pc.equal(batch.column("kind"), kind)
        payloads[kind] = iter([None] * rows if column is None else pc.filter(column, mask).to_pylist())
    for row, kind in enumerate(kinds):
        model = event_type(kind)
        payload = next(payloads[kind]) or {}
        values = {k: v for k, v in payload.items() if v is not None}
        for name in ENVELOPE_FIELDS:
            if envelope[name][row] is not None:
                values[name] = envelope[name][row]
        yield model.model_validate(values)


def parse_event(data: dict[str, Any]) -> Event:
    """Validate a plain dictionary (``{"kind": ..., fields...}``) into an event, with a clear error."""
    if not isinstance(data, dict):
        raise EventValidationError(f"an event must be a JSON object, got {type(data).__name__}")
    if "kind" not in data:
        raise EventValidationError("event is missing the required field 'kind'")
    fields = {k: v for k, v in data.items() if k != "kind"}
    model = event_type(data["kind"])
    try:
        return model.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<event>'}: {e['msg']}" for e in error.errors()
        )
        raise EventValidationError(f"invalid {model.kind} event: {problems}") from error


def validate_batch(batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    """Check a producer-built columnar batch against the schema, before it gets seqs.

    The batch carries the envelope id columns it needs, ``kind`` and the kinds' struct columns; ``seq``
    is the writer's to assign, and ``ts`` may be absent or null where the producer left the time to the
    writer (an event's own time wins, as in ``encode``). Unknown columns or kinds, wrong types and missing
    required fields are refused with an error that names them. The result is sparse, in schema order.
    """
    columns = validated_columns(batch)
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=_column_plan(tuple(columns)).out_schema)


def validated_columns(batch: pa.RecordBatch | pa.Table) -> dict[str, pa.Array]:
    """``validate_batch`` without building the result: its columns by name, in schema order, with their
    stored types (the log writer builds its stored batch from them, with seqs and timestamps, at once)."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks()
        batch = batch.to_batches()[0] if batch.num_rows else batch.schema.empty_table().to_batches()[0]
    plan = _column_plan(tuple(batch.schema.names))
    present_kinds = pc.unique(batch.column("kind")).to_pylist()
    for kind in present_kinds:
        if kind is None:
            raise EventValidationError("column 'kind' has null entries")
        event_type(kind)
    columns: dict[str, pa.Array] = {}
    for name, index, target in plan.columns:
        array = batch.column(index)
        if array.type.equals(target):
            columns[name] = array
            continue
        try:
            columns[name] = _conform_exact(array, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
            raise EventValidationError(f"column {name!r} has type {array.type}, expected {target}: {error}") from error
    for kind in present_kinds:
        _check_required(columns, kind, len(present_kinds) == 1)
    for name in plan.kinds - set(present_kinds):
        if columns[name].null_count != batch.num_rows:
            raise EventValidationError(f"payload column {name!r} is set on rows of another kind")
    return columns


@dataclass(frozen=True)
class _ColumnPlan:
    columns: tuple[tuple[str, int, pa.DataType], ...]
    """(name, index in the input, stored type) in schema order."""
    kinds: frozenset[str]
    out_schema: pa.Schema
    """The output schema (used as is when every column already has its stored type)."""


@lru_cache(maxsize=256)
def _column_plan(names: tuple[str, ...]) -> _ColumnPlan:
    """Name-level checks, done once per distinct set of producer columns (types are checked per batch:
    hashing Arrow types or schemas costs more than comparing them)."""
    full = event_schema()
    unknown = [name for name in names if full.get_field_index(name) < 0 or name == "seq"]
    if unknown:
        raise EventValidationError(
            f"column(s) {unknown} cannot be appended; give envelope ids, 'kind', payload struct columns and "
            f"optionally 'ts' ('seq' is assigned by the log)")
    if "kind" not in names:
        raise EventValidationError("batch is missing the required column 'kind'")
    if len(set(names)) != len(names):
        raise EventValidationError(f"duplicate columns in {list(names)}")
    columns = tuple((f.name, names.index(f.name), f.type) for f in full if f.name in names)
    out = pa.schema([full.field(name) for name, _, _ in columns], metadata=full.metadata)
    return _ColumnPlan(columns, frozenset(names) & EVENT_TYPES.keys(), out)


def _conform_exact(array: pa.Array, target: pa.DataType) -> pa.Array:
    if array.type.equals(target):
        return array
    if pa.types.is_struct(target) and pa.types.is_struct(array.type):
        names = [f.name for f in array.type]
        unknown = [name for name in names if target.get_field_index(name) < 0]
        if unknown:
            raise pa.ArrowInvalid(f"unknown field(s) {unknown}")
        children = []
        for field in target:
            if field.name in names:
                children.append(_conform_exact(array.field(names.index(field.name)), field.type))
            else:
                children.append(pa.nulls(len(array), field.type))
        return pa.StructArray.from_arrays(children, fields=list(target), mask=array.is_null())
    return array.cast(target, safe=True)


@cache
def _required(kind: str) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """Required envelope ids and (index, name) of required payload fields of a kind."""
    model = event_type(kind)
    envelope = tuple(required_envelope(model))
    payload = tuple((i, f.name) for i, f in enumerate(payload_type(kind)) if model.model_fields[f.name].is_required())
    return envelope, payload


def _check_required(columns: dict[str, pa.Array], kind: str, single: bool) -> None:
    """Required envelope ids and payload fields of ``kind``'s rows are present; no other kind's payload is.

    ``single``: every row is of this kind (the common case), so no row filtering is needed.
    """
    required_envelope, required_payload = _required(kind)

    def nulls_in_rows(array: pa.Array) -> bool:
        if single:
            return array.null_count > 0
        return pc.any(pc.and_(rows, pc.is_null(array))).as_py()

    rows = None if single else pc.equal(columns["kind"], kind)
    for name in required_envelope:
        if name not in columns or nulls_in_rows(columns[name]):
            raise EventValidationError(f"{kind} rows need envelope field {name!r}, some are null")
    if kind not in columns:
        raise EventValidationError(f"{kind} rows need their payload column {kind!r}, which is missing")
    struct = columns[kind] if single else pc.filter(columns[kind], rows)
    if struct.null_count:
        raise EventValidationError(f"{kind} rows need their payload column {kind!r}, some are null")
    for index, name in required_payload:
        if struct.field(index).null_count:
            raise EventValidationError(f"{kind} rows need payload field {name!r}, some are null")
    if not single and pc.any(pc.and_(pc.invert(rows), pc.is_valid(columns[kind]))).as_py():
        raise EventValidationError(f"payload column {kind!r} is set on rows of another kind")
