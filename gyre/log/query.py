"""DuckDB over a log: an ``events`` view plus one flattened view per kind.

Sealed segments are scanned natively from their Parquet copies (projection and filter pushdown, row
groups skipped by ``kind``/``seq`` statistics); the live segment is decoded from its frames and scanned
as an Arrow table.
"""

from pathlib import Path

import duckdb
import pyarrow as pa

from gyre.events.models import EVENT_TYPES
from gyre.events.schema import ENVELOPE_COLUMNS, event_schema
from gyre.log.seal import segment_table, usable_sealed_copy
from gyre.log.segment import list_segments

_ENVELOPE_SELECT = ", ".join(ENVELOPE_COLUMNS)


def connect(path: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection (new, or ``con``) with the log's views, as of the moment of the call."""
    con = con or duckdb.connect()
    segments = list_segments(Path(path))
    parquet: list[str] = []
    live: list[pa.Table] = []
    for index, (_, segment) in enumerate(segments):
        sealed = usable_sealed_copy(segment) if index < len(segments) - 1 else None
        if sealed is not None:
            parquet.append(str(sealed))
        else:
            live.append(segment_table(segment, tail_ok=index == len(segments) - 1))
    parts = []
    if parquet:
        files = ", ".join("'" + p.replace("'", "''") + "'" for p in parquet)
        parts.append(f"SELECT * FROM read_parquet([{files}])")
    if live or not parquet:
        table = pa.concat_tables(live) if live else event_schema().empty_table()
        con.register("gyre_live_events", table)
        parts.append("SELECT * FROM gyre_live_events")
    con.execute("CREATE OR REPLACE VIEW events AS " + " UNION ALL ".join(parts))
    create_kind_views(con)
    return con


def create_kind_views(con: duckdb.DuckDBPyConnection) -> None:
    """One flattened view per kind over the connection's ``events`` view."""
    for kind, model in EVENT_TYPES.items():
        con.execute(
            f"CREATE OR REPLACE VIEW {model.view} AS SELECT {_ENVELOPE_SELECT}, UNNEST({kind}) "
            f"FROM events WHERE kind = '{kind}'"
        )
