"""`gyre log ...`: verify, inspect, tail and query a log (`gyre.cli` adds `audit` and `bench` from above)."""

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, ParamSpec

import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.console import Console
from rich.table import Table

from gyre.errors import GyreError, LogCorruptionError
from gyre.events.codec import decode
from gyre.log.reader import LogReader

log_app = typer.Typer(no_args_is_help=True, help="Inspect, verify, query and benchmark a Gyre log.")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)

PathArg = Annotated[Path, typer.Argument(help="log directory")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of a table")]


def _fail(message: str, code: int = 1) -> None:
    err_console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def _reader(path: Path) -> LogReader:
    try:
        return LogReader(path)
    except GyreError as error:
        _fail(str(error), 2)
        raise


P = ParamSpec("P")


def clear_errors(command: Callable[P, None]) -> Callable[P, None]:
    """A damaged log (or any Gyre error) ends a command with one line naming what is wrong and where
    (segment and byte offset), exit status 1, never a traceback."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except GyreError as error:
            _fail(str(error))
        except OSError as error:
            _fail(f"cannot read the log: {error}")

    return run


@log_app.command()
@clear_errors
def verify(path: PathArg, as_json: JsonOpt = False,
           allow_torn_tail: Annotated[bool, typer.Option(
               "--allow-torn-tail", help="exit 0 when the log ends in a proven torn write (a crashed writer "
                                         "leaves one; the next writer quarantines it)")] = False) -> None:
    """Check every frame's checksum, the seq chain and the sealed copies.

    Exit 1 on corruption, and on damage at the end of the log: a torn tail (unless --allow-torn-tail)
    or bytes that nothing proves were, or were not, acknowledged.
    """
    try:
        report = _reader(path).verify()
    except LogCorruptionError as error:
        if as_json:
            print(json.dumps({"ok": False, "segment": error.segment, "offset": error.offset,
                              "reason": error.reason}))
            raise typer.Exit(1) from None
        raise
    ok = report.torn_tail_ok if allow_torn_tail else report.ok
    out = {"ok": ok, "segments": report.segments, "events": report.events, "bytes": report.bytes,
           "first_seq": report.first_seq, "last_seq": report.last_seq, "sealed": report.sealed,
           "torn_tail_bytes": report.torn_tail_bytes, "tail": report.tail_verdict,
           "tail_segment": report.tail_segment, "tail_offset": report.tail_offset,
           "tail_reason": report.tail_reason, "tail_frames": report.tail_frames, "tail_events": report.tail_events,
           "quarantined": report.quarantined, "problems": report.problems}
    if as_json:
        print(json.dumps(out))
    else:
        status = "[green]ok[/green]" if ok else "[yellow]problems[/yellow]"
        console.print(f"{status}: {report.events} events in {report.segments} segments "
                      f"({report.bytes / 1e6:.1f} MB), seq {report.first_seq}..{report.last_seq}")
        if report.tail_verdict == "torn":
            console.print(f"torn tail of {report.torn_tail_bytes} bytes at byte offset {report.tail_offset} of "
                          f"{report.tail_segment} ({report.tail_frames} frame(s), {report.tail_events} event(s), "
                          f"never acknowledged; the next writer quarantines it): {report.tail_reason}")
        elif report.tail_verdict == "ambiguous":
            console.print(f"[yellow]damaged tail of {report.torn_tail_bytes} bytes at byte offset "
                          f"{report.tail_offset} of {report.tail_segment} ({report.tail_frames} frame(s), "
                          f"{report.tail_events} event(s)) that nothing proves unacknowledged: "
                          f"{report.tail_reason}[/yellow]")
        for name in report.quarantined:
            console.print(f"quarantined by an earlier recovery: {name} (see {name}.json)")
        for problem in report.problems:
            console.print(f"[yellow]- {problem}[/yellow]")
    if not ok:
        raise typer.Exit(1)


def log_stats(path: Path) -> dict:
    reader = _reader(path)
    counts: dict[str, int] = {}
    first_ts = last_ts = None
    events = 0
    for batch in reader.read():
        events += batch.num_rows
        for item in pc.value_counts(batch.column("kind")).to_pylist():
            counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
        ts = batch.column("ts")
        lo, hi = pc.min(ts).as_py(), pc.max(ts).as_py()
        first_ts = lo if first_ts is None or lo < first_ts else first_ts
        last_ts = hi if last_ts is None or hi > last_ts else last_ts
    segments = reader.segments()
    return {
        "path": str(path), "segments": len(segments),
        "bytes": sum(p.stat().st_size for _, p in segments),
        "events": events, "last_seq": reader.last_seq(),
        "first_ts": first_ts.isoformat() if first_ts else None,
        "last_ts": last_ts.isoformat() if last_ts else None,
        "kinds": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
    }


@log_app.command()
@clear_errors
def stats(path: PathArg, as_json: JsonOpt = False) -> None:
    """Events per kind, seq and time range, size on disk."""
    out = log_stats(path)
    if as_json:
        print(json.dumps(out))
        return
    console.print(f"[bold]{out['path']}[/bold]: {out['events']} events, last seq {out['last_seq']}, "
                  f"{out['segments']} segment(s), {out['bytes'] / 1e6:.2f} MB")
    console.print(f"time: {out['first_ts']} .. {out['last_ts']}")
    table = Table("kind", "events")
    for kind, n in out["kinds"].items():
        table.add_row(kind, str(n))
    console.print(table)


@log_app.command()
@clear_errors
def tail(path: PathArg,
         n: Annotated[int, typer.Option("-n", help="how many of the last events")] = 20,
         kind: Annotated[list[str] | None, typer.Option("--kind", help="only these kinds")] = None,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False) -> None:
    """Print the last events as JSON lines (optionally following the live log)."""
    reader = _reader(path)
    last = reader.last_seq()
    kinds = kind or None
    batches = list(reader.read(from_seq=max(0, last - n + 1) if not kinds else 0, kinds=kinds))
    rows = [e for b in batches for e in decode(b)][-n:]
    for event in rows:
        print(_json_line(event), flush=True)
    if follow:
        for batch in reader.follow(from_seq=last + 1, kinds=kinds):
            for event in decode(batch):
                print(_json_line(event), flush=True)


def _json_line(event) -> str:
    return json.dumps({"kind": event.kind, **event.model_dump(mode="json", exclude_none=True)})


@log_app.command()
@clear_errors
def sql(path: PathArg, query: Annotated[str, typer.Argument(help="SQL over the events and per-kind views")],
        as_json: JsonOpt = False,
        limit: Annotated[int, typer.Option(help="rows to show in the table")] = 50) -> None:
    """Run DuckDB SQL over the log: `events` plus one view per kind (model_calls, rewards, ...)."""
    import duckdb

    con = _reader(path).duckdb()
    try:
        result = con.sql(query)
    except duckdb.Error as error:
        _fail(f"query failed: {error}")
    if result is None:
        return
    table: pa.Table = result.to_arrow_table()
    if as_json:
        print(json.dumps(table.to_pylist(), default=str))
        return
    view = Table(*table.column_names)
    for row in table.slice(0, limit).to_pylist():
        view.add_row(*[_cell(v) for v in row.values()])
    console.print(view)
    if table.num_rows > limit:
        console.print(f"... {table.num_rows - limit} more rows (use --limit or --json)")


def _cell(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


if __name__ == "__main__":  # pragma: no cover
    sys.exit(log_app())
