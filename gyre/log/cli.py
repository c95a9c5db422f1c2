"""`gyre log ...`: verify, inspect, tail, query, audit and benchmark a log."""

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


def _clear_errors(command: Callable[P, None]) -> Callable[P, None]:
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
@_clear_errors
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
@_clear_errors
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
@_clear_errors
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
@_clear_errors
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


@log_app.command()
@_clear_errors
def audit(path: PathArg, as_json: JsonOpt = False,
          steps: Annotated[int | None, typer.Option("--steps", help="the steps the run was to train")] = None,
          unfinished: Annotated[bool, typer.Option(
              "--unfinished", help="do not require a run_finished 'completed'")] = False,
          replay: Annotated[bool, typer.Option("--replay", help="also replay the decisions exactly")] = False,
          no_versions: Annotated[bool, typer.Option(
              "--no-versions", help="calls may lack the version that served them (simulator logs, older logs)")]
          = False) -> None:
    """Hold a finished run's log to its promises: no event lost or doubled (producer numbering, spill files),
    every trained execution scored exactly once, steps and versions gapless, every call served by weights at
    least as new as its execution's and within the run's staleness of the step that trains it. Exit 1 on any
    problem."""
    from gyre.log.audit import audit as audit_log

    report = audit_log(path, expected_steps=steps, require_finished=not unfinished, replay=replay,
                       require_versions=not no_versions)
    if as_json:
        print(json.dumps({"ok": report.ok, **report.model_dump(mode="json")}))
    else:
        status = "[green]ok[/green]" if report.ok else "[red]problems[/red]"
        console.print(f"{status}: {report.events} events from {len(report.producers)} producers; "
                      f"{report.executions} executions ({report.requeued} re-queued), {report.completions} "
                      f"completed, {report.rewards} rewards; {report.steps_trained} steps trained")
        table = Table("audit", "value")
        for name in ("events_lost", "events_doubled", "spill_files", "rewards_lost", "rewards_doubled",
                     "rewards_unqueued", "micro_steps_redone", "micro_steps_released", "steps_aborted",
                     "calls_versioned", "calls_unversioned", "calls_stale", "calls_overlagged", "max_version_lag",
                     "role_switches", "cells_lost", "cells_reregistered", "commands_abandoned", "controller_restarts",
                     "quiet_gaps", "run_status"):
            table.add_row(name, str(getattr(report, name)))
        console.print(table)
        for problem in report.problems:
            console.print(f"[yellow]- {problem}[/yellow]")
    if not report.ok:
        raise typer.Exit(1)


def _cell(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


@log_app.command()
def bench(as_json: JsonOpt = False,
          quick: Annotated[bool, typer.Option("--quick", help="a seconds-long run")] = False,
          directory: Annotated[Path | None, typer.Option("--dir", help="where to write (default: a temp dir "
                                                         "under the current directory's disk)")] = None,
          kill_points: Annotated[int | None, typer.Option(
              help="kill -9 crash points to run (default: 1000, or 0 with --quick)")] = None,
          ab: Annotated[bool, typer.Option(
              "--ab", help="only compare the old writer (frame format v0) with the current one, alternating "
                           "in one run")] = False,
          rounds: Annotated[int, typer.Option(min=1, help="rounds per writer with --ab (medians)")] = 10) -> None:
    """Measure the log's durable throughput, commit latency, replay and recovery speed."""
    from benchmarks.log_bench import run_ab, run_benchmark

    if ab:
        results = run_ab(quick=quick, directory=directory, rounds=rounds)
    else:
        if kill_points is None:
            kill_points = 0 if quick else 1000
        results = run_benchmark(quick=quick, directory=directory, kill_points=kill_points)
    if as_json:
        print(json.dumps(results))
        return
    table = Table("metric", "value")
    for key, value in results.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(log_app())
