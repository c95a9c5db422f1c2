"""Projections: state as a fold over the log.

A projection is a set of handlers, one per event kind it reacts to, each declaring the fields it reads::

    class Counts(Projection[CountState]):
        name = "counts"

        @on("reward_recorded", "execution_id", "reward")
        def _reward(self, state, execution_id, reward): ...

The declared fields are the whole interface between a handler and an event, which gives two equivalent
ways to drive the same rules:

* ``apply(state, event)`` for one pydantic event (live controllers, tests), and
* ``apply_batch(state, batch)`` for an Arrow batch from the log (replay): it reads only the declared
  columns, as plain Python values, and never builds an event object — this is what makes replay fast;
  ``apply_columns(state, BatchColumns(batch))`` is the same for several projections sharing one read.

Handlers are pure in the event-sourcing sense: no clock, no I/O, no randomness; time comes from the
event's ``ts``. For speed they update the state in place: ``apply`` takes ownership of the state it is
given and returns it. Copy (or snapshot) a state you want to keep.
"""

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, TypeAdapter

from gyre.events.codec import to_us
from gyre.events.models import ENVELOPE_FIELDS, Event, event_type

S = TypeVar("S")
LEN_SUFFIX = "#len"
"""A declared field ``"output_ids#len"`` receives ``len(output_ids)`` (replay never materialises the list)."""


@dataclass(frozen=True)
class Handler:
    kind: str
    fields: tuple[str, ...]
    method: str


def on(kind: str, *fields: str) -> Callable:
    """Mark a projection method as the handler of ``kind``, receiving ``fields`` positionally."""
    model = event_type(kind)
    for name in fields:
        base = name.removesuffix(LEN_SUFFIX)
        if base != "ts" and base not in model.model_fields:
            raise TypeError(f"handler for {kind} reads unknown field {base!r}")

    def mark(fn: Callable) -> Callable:
        fn.__gyre_handler__ = Handler(kind, fields, fn.__name__)  # type: ignore[attr-defined]
        return fn

    return mark


class Projection(Generic[S]):
    """Base class of projections: subclass, set ``name`` and ``state_type``, write ``@on`` handlers."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    """Bump when the handlers change meaning: snapshots of other versions are ignored."""
    state_type: ClassVar[type]
    handlers: ClassVar[dict[str, Handler]]
    kind_values: ClassVar[pa.Array]
    """The handled kinds as an Arrow array: the value set of replay's kind filter."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handlers: dict[str, Handler] = {}
        for klass in reversed(cls.__mro__):
            for value in vars(klass).values():
                handler = getattr(value, "__gyre_handler__", None)
                if handler is not None:
                    if handler.kind in handlers and handlers[handler.kind].method != handler.method:
                        raise TypeError(f"{cls.__name__} has two handlers for {handler.kind}")
                    handlers[handler.kind] = handler
        cls.handlers = handlers
        cls.kind_values = pa.array(sorted(handlers), pa.string())

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(self.handlers)

    def initial(self) -> S:
        return self.state_type()

    # -- the two drivers ---------------------------------------------------------------------------------

    def apply(self, state: S, event: Event) -> S:
        handler = self.handlers.get(event.kind)
        if handler is not None:
            getattr(self, handler.method)(state, *(_event_value(event, f) for f in handler.fields))
        return state

    def apply_batch(self, state: S, batch: pa.RecordBatch, rows: pa.Array | None = None) -> S:
        """Fold a log batch (sparse or full, any schema version, rows in seq order) into ``state``.

        Only the declared fields are read, each as one column filtered to its kind's rows: token lists
        and other payload never get copied or turned into Python objects. ``rows`` (a boolean mask)
        limits the fold to some rows: a projection that knows some events cancel out skips them.
        """
        kind_column = batch.column("kind")
        relevant = pc.is_in(kind_column, value_set=self.kind_values)
        if rows is not None:
            relevant = pc.and_(relevant, rows)
        if not pc.any(relevant).as_py():
            return state
        kinds = pc.filter(kind_column, relevant)
        present = pc.unique(kinds)
        # The loop below runs once per event: it only indexes two lists and makes one call (a handler
        # bound to the state, fed the next tuple of its kind's columns).
        order = pc.index_in(kinds, value_set=present).to_numpy(zero_copy_only=False).tolist()
        handlers, next_values = [], []
        for kind in present.to_pylist():
            handler = self.handlers[kind]
            kind_rows = pc.equal(kind_column, kind) if rows is None else pc.and_(pc.equal(kind_column, kind), rows)
            columns = [_column_values(batch, kind_rows, kind, name) for name in handler.fields]
            handlers.append(partial(getattr(self, handler.method), state))
            next_values.append(iter(zip(*columns, strict=True)).__next__ if columns else repeat(()).__next__)
        for i in order:
            handlers[i](*next_values[i]())
        return state

    def apply_columns(self, state: S, columns: "BatchColumns") -> S:
        """``apply_batch`` over columns read once for several projections (a live controller's small
        batches: there the Arrow calls per projection, not the handlers, were the cost)."""
        steps = {}
        for kind in columns.present:
            handler = self.handlers.get(kind)
            if handler is not None:
                values = [columns.values(kind, name) for name in handler.fields]
                steps[kind] = (partial(getattr(self, handler.method), state),
                               iter(zip(*values, strict=True)).__next__ if values else repeat(()).__next__)
        if steps:
            for kind in columns.kinds:
                step = steps.get(kind)
                if step is not None:
                    step[0](*step[1]())
        return state

    # -- snapshots ---------------------------------------------------------------------------------------

    def dump(self, state: S) -> bytes:
        return TypeAdapter(self.state_type).dump_json(state)

    def load(self, data: bytes) -> S:
        return TypeAdapter(self.state_type).validate_json(data)


class BatchColumns:
    """A batch's declared columns as Python values, each read once whichever projections read it."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch
        self.kinds: list[str] = batch.column("kind").to_pylist()
        self.present = set(self.kinds)
        self._rows: dict[str, pa.Array] = {}
        self._values: dict[tuple[str, str], list] = {}

    def values(self, kind: str, name: str) -> list:
        """The declared field ``name`` at the rows of ``kind``, in row order."""
        key = (kind, name)
        if key not in self._values:
            rows = self._rows.get(kind)
            if rows is None:
                rows = self._rows[kind] = pc.equal(self.batch.column("kind"), kind)
            self._values[key] = _column_values(self.batch, rows, kind, name)
        return self._values[key]


def _event_value(event: Event, name: str) -> Any:
    if name == "ts":  # microseconds since the epoch, as in replay; 0 for an event not yet logged
        return 0 if event.ts is None else to_us(event.ts)
    if name.endswith(LEN_SUFFIX):
        return len(getattr(event, name.removesuffix(LEN_SUFFIX)))
    return getattr(event, name)


def _column_values(batch: pa.RecordBatch, rows: pa.Array, kind: str, name: str) -> list:
    """Values of one declared field at the rows of one kind, with the model's default where it is null
    (or where the batch predates the field: additive evolution)."""
    want_len = name.endswith(LEN_SUFFIX)
    base = name.removesuffix(LEN_SUFFIX)
    count = None
    if base in ENVELOPE_FIELDS:
        index = batch.schema.get_field_index(base)
        column = batch.column(index) if index >= 0 else None
        default = None
    else:
        struct = batch.column(kind)
        index = struct.type.get_field_index(base)
        column = struct.field(index) if index >= 0 else None
        default = event_type(kind).model_fields[base].get_default(call_default_factory=True)
    if column is None:
        count = pc.sum(rows).as_py() or 0
        return [len(default) if want_len else default] * count
    if want_len:
        return pc.fill_null(pc.filter(pc.list_value_length(column), rows), 0).to_pylist()
    values = pc.filter(column, rows)
    if base == "ts":
        return pc.cast(values, pa.int64()).to_pylist()  # microseconds since the epoch, UTC
    if default is not None and values.null_count:
        if isinstance(default, BaseModel | list | dict):
            return [default if v is None else v for v in values.to_pylist()]
        values = pc.fill_null(values, pa.scalar(default, values.type))
    return values.to_pylist()


# -- folding and snapshots ---------------------------------------------------------------------------------


class Snapshot(BaseModel):
    """A projection's state as of ``seq``: restoring it and folding the rest equals a full replay."""

    projection: str
    version: int
    seq: int
    state: str


def fold(projection: Projection[S], events: Iterable[Event], state: S | None = None) -> S:
    state = projection.initial() if state is None else state
    for event in events:
        state = projection.apply(state, event)
    return state


def fold_batches(projection: Projection[S], batches: Iterable[pa.RecordBatch], state: S | None = None) -> S:
    state = projection.initial() if state is None else state
    for batch in batches:
        state = projection.apply_batch(state, batch)
    return state


def take_snapshot(projection: Projection[S], state: S, seq: int) -> Snapshot:
    return Snapshot(projection=projection.name, version=projection.version, seq=seq,
                    state=projection.dump(state).decode())


def restore(projection: Projection[S], snapshot: Snapshot) -> S:
    if snapshot.projection != projection.name or snapshot.version != projection.version:
        raise ValueError(f"snapshot of {snapshot.projection} v{snapshot.version} cannot restore "
                         f"{projection.name} v{projection.version}")
    return projection.load(snapshot.state.encode())


def replay(projection: Projection[S], log_path: str | Path, snapshot: Snapshot | None = None,
           to_seq: int | None = None) -> tuple[S, int]:
    """State of ``projection`` over the log (optionally resuming from a snapshot); returns (state, seq)."""
    from gyre.log.reader import LogReader

    reader = LogReader(log_path)
    if snapshot is not None:
        state, from_seq = restore(projection, snapshot), snapshot.seq + 1
    else:
        state, from_seq = projection.initial(), 0
    end = reader.last_seq() if to_seq is None else to_seq  # fixed first: the log may grow meanwhile
    # No ``kinds`` here: apply_batch picks its rows itself, without copying the other columns.
    for batch in reader.read(from_seq=from_seq, to_seq=end, full_schema=False):
        state = projection.apply_batch(state, batch)
    return state, max(end, from_seq - 1)


def replay_all(projections: list[Projection], log_path: str | Path) -> tuple[list, int]:
    """The states of several projections over one read of the log (a restarting process folds once);
    returns (states in the order given, the last seq folded)."""
    from gyre.log.reader import LogReader

    reader = LogReader(log_path)
    end = reader.last_seq()
    return fold_all_batches(projections, reader.read(from_seq=0, to_seq=end, full_schema=False)), end


def fold_all_batches(projections: list[Projection], batches: Iterable[pa.RecordBatch]) -> list:
    """The states of several projections over the log's batches, however they were read (its files, or the
    controller's Log service from another host)."""
    states = [p.initial() for p in projections]
    for batch in batches:
        for projection, state in zip(projections, states, strict=True):
            projection.apply_batch(state, batch)
    return states


def copy_state(projection: Projection[S], state: S) -> S:
    """An independent copy of ``state`` (through the snapshot codec: whatever a snapshot keeps)."""
    return projection.load(projection.dump(state))


def save_snapshot(snapshot: Snapshot, path: str | Path) -> None:
    """Write a snapshot file atomically (tmp + rename): a reader never sees half a snapshot."""
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(snapshot.model_dump()))
    tmp.replace(target)


def load_snapshot(path: str | Path) -> Snapshot:
    return Snapshot.model_validate_json(Path(path).read_text())
