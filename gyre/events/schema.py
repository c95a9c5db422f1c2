"""The one Arrow schema of the log, derived from the event models.

Envelope columns first (``seq``, ``ts``, ``kind`` and the ids), then one nullable struct column per kind
named after it, holding that kind's payload. A row has exactly one non-null struct: its own kind's.
"""

import json
import types
import typing
from datetime import datetime
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pyarrow as pa
from pydantic import BaseModel

from gyre.events.fields import ArrowType
from gyre.events.models import ENVELOPE_FIELDS, EVENT_TYPES, Event

SCHEMA_VERSION = 1

TS_TYPE = pa.timestamp("us", tz="UTC")
ENVELOPE_TYPES: dict[str, pa.DataType] = {
    "seq": pa.int64(),
    "ts": TS_TYPE,
    "kind": pa.string(),
    "run_id": pa.string(),
    "execution_id": pa.string(),
    "call_id": pa.string(),
    "cell_id": pa.string(),
    "step": pa.int64(),
    "producer": pa.string(),
    "producer_seq": pa.int64(),
}
ENVELOPE_COLUMNS: tuple[str, ...] = ("seq", "ts", "kind", *ENVELOPE_FIELDS[2:])


def arrow_type(annotation: Any, metadata: tuple | list = ()) -> pa.DataType:
    """Map a pydantic field annotation to its Arrow storage type."""
    for item in metadata:
        if isinstance(item, ArrowType):
            return item.type
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return arrow_type(base, extra)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"cannot store a union of {options} in one Arrow column")
        return arrow_type(options[0])
    if origin is Literal:
        return pa.string()
    if origin is list:
        (item,) = get_args(annotation)
        return pa.list_(arrow_type(item))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return pa.struct(_struct_fields(annotation))
    scalar = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string(),
              datetime: pa.timestamp("us", tz="UTC")}
    if annotation in scalar:
        return scalar[annotation]
    raise TypeError(f"no Arrow type for annotation {annotation!r}")


def _struct_fields(model: type[BaseModel], names: typing.Iterable[str] | None = None) -> list[pa.Field]:
    names = list(model.model_fields) if names is None else list(names)
    fields = []
    for name in names:
        info = model.model_fields[name]
        fields.append(pa.field(name, arrow_type(info.annotation, info.metadata), nullable=True))
    return fields


@cache
def payload_type(kind: str) -> pa.StructType:
    """The struct type of one kind's payload column."""
    model = EVENT_TYPES[kind]
    return pa.struct(_struct_fields(model, model.payload_fields()))


@cache
def event_schema() -> pa.Schema:
    """The current (v1) Arrow schema of the log."""
    fields = [pa.field(name, ENVELOPE_TYPES[name], nullable=name not in ("seq", "ts", "kind"))
              for name in ENVELOPE_COLUMNS]
    fields += [pa.field(kind, payload_type(kind), nullable=True) for kind in EVENT_TYPES]
    return pa.schema(fields, metadata={b"gyre.schema_version": str(SCHEMA_VERSION).encode()})


def required_envelope(model: type[Event]) -> list[str]:
    return [n for n in ENVELOPE_FIELDS if n not in ("seq", "ts") and model.model_fields[n].is_required()]


def schema_document() -> dict[str, Any]:
    """A stable, human-readable description of the schema; written to ``schemas/events.v1.json``."""
    schema = event_schema()
    kinds = {}
    for kind, model in EVENT_TYPES.items():
        kinds[kind] = {
            "view": model.view,
            "doc": (model.__doc__ or "").strip().split("\n")[0] if model.__doc__ != Event.__doc__ else "",
            "required_envelope": required_envelope(model),
            "payload": [
                {"name": f.name, "arrow_type": str(f.type),
                 "required": model.model_fields[f.name].is_required()}
                for f in payload_type(kind)
            ],
            "json_schema": model.model_json_schema(),
        }
    return {
        "schema_version": SCHEMA_VERSION,
        "envelope": [{"name": f.name, "arrow_type": str(f.type), "nullable": f.nullable}
                     for f in schema if f.name in ENVELOPE_COLUMNS],
        "kinds": kinds,
    }


def schema_json() -> str:
    return json.dumps(schema_document(), indent=2, sort_keys=True) + "\n"


def evolve(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Bring a stored batch to the full current schema.

    Stored batches are sparse (only the kinds they hold) and may come from an older, additive schema:
    missing columns and struct fields become null; columns this code does not know are dropped (a newer
    writer's additions are invisible to an older reader, never an error).
    """
    target = event_schema()
    if batch.schema.equals(target, check_metadata=False):
        return batch
    columns = []
    for field in target:
        index = batch.schema.get_field_index(field.name)
        if index < 0:
            columns.append(pa.nulls(batch.num_rows, field.type))
        else:
            columns.append(_conform(batch.column(index), field.type))
    return pa.RecordBatch.from_arrays(columns, schema=target)


def current_column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    """One column of a stored batch under the current schema (``evolve`` for one column); None if absent."""
    index = batch.schema.get_field_index(name)
    return None if index < 0 else _conform(batch.column(index), event_schema().field(name).type)


def _conform(array: pa.Array, target: pa.DataType) -> pa.Array:
    if array.type.equals(target):
        return array
    if pa.types.is_struct(target) and pa.types.is_struct(array.type):
        children = []
        for field in target:
            index = array.type.get_field_index(field.name)
            if index < 0:
                children.append(pa.nulls(len(array), field.type))
            else:
                children.append(_conform(array.field(index), field.type))
        return pa.StructArray.from_arrays(children, fields=list(target), mask=array.is_null())
    return array.cast(target)
