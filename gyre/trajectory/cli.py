"""``gyre trajectories``: synthesise runs, build training batches from a log, draw one execution's tree."""

import json
from pathlib import Path
from typing import Annotated, cast

import pyarrow as pa
import typer
from rich.console import Console
from rich.table import Table

from gyre.errors import GyreError
from gyre.trajectory.builder import BatchBuilder
from gyre.trajectory.calls import ExecutionCalls
from gyre.trajectory.config import BatchForm, TrajectoryConfig
from gyre.trajectory.selection import select
from gyre.trajectory.show import render
from gyre.trajectory.synth import SynthConfig
from gyre.trajectory.tree import CallTree

trajectories_app = typer.Typer(
    help="Trajectory trees from a Gyre log: capped, deduplicated, fairly weighted training batches.",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def _fail(error: GyreError) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/] {error}")
    return typer.Exit(code=2)


@trajectories_app.command()
def synth(
    directory: Annotated[Path, typer.Argument(help="New log directory to write.")],
    executions: Annotated[int, typer.Option(help="Executions to generate.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed; the same seed writes the same run.")] = 0,
    group_size: Annotated[int, typer.Option(help="Executions per task (a GSPO group).")] = 16,
    min_tokens: Annotated[int, typer.Option(help="Fewest tokens per execution.")] = 100_000,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per execution.")] = 700_000,
    json_out: JsonFlag = False,
) -> None:
    """Write a log of realistic synthetic agent executions (sub-agents, compactions, retries, time-outs)."""
    from gyre.trajectory.synth_log import synthesize

    try:
        config = SynthConfig(
            executions=executions, seed=seed, group_size=group_size, min_tokens=min_tokens, max_tokens=max_tokens
        )
        summary = synthesize(directory, config)
    except GyreError as error:
        raise _fail(error) from error
    _print(summary.to_dict(), json_out, f"synthetic run in {directory}")


@trajectories_app.command()
def build(
    log: Annotated[Path, typer.Argument(help="Log directory.")],
    cap: Annotated[int, typer.Option(help="Most trajectories kept per execution.")] = 5,
    uncapped: Annotated[bool, typer.Option(help="Keep every trajectory (for comparison).")] = False,
    form: Annotated[str, typer.Option(help="packed (tree per execution) or expanded (row per trajectory).")] = (
        "packed"
    ),
    token_budget: Annotated[int, typer.Option(help="Tokens per micro-batch.")] = 1 << 20,
    min_valid: Annotated[int, typer.Option(help="Fewest scored executions a group needs.")] = 2,
    strict: Annotated[bool, typer.Option(help="Fail on a malformed execution instead of excluding it.")] = False,
    out: Annotated[Path | None, typer.Option(help="Write each micro-batch as an Arrow IPC file here.")] = None,
    json_out: JsonFlag = False,
) -> None:
    """Build micro-batches from a log and report what was kept, excluded and dropped."""
    try:
        config = TrajectoryConfig(
            cap=None if uncapped else cap,
            form=cast(BatchForm, form),
            token_budget=token_budget,
            min_valid_per_group=min_valid,
            strict=strict,
        )
        builder = BatchBuilder(config)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        for batch in builder.from_log(log):
            if out is not None:
                with (
                    pa.OSFile(str(out / f"micro-batch-{batch.index:05d}.arrow"), "wb") as sink,
                    pa.ipc.new_file(sink, batch.batch.schema) as writer,
                ):
                    writer.write_batch(batch.batch)
    except GyreError as error:
        raise _fail(error) from error
    report = builder.report.to_dict()
    _print(report, json_out, f"trajectories of {log} (cap {'none' if uncapped else cap}, {form})")


@trajectories_app.command()
def show(
    log: Annotated[Path, typer.Argument(help="Log directory.")],
    execution_id: Annotated[str, typer.Argument(help="Execution to draw.")],
    cap: Annotated[int, typer.Option(help="Most trajectories kept, to mark kept and capped ends.")] = 5,
) -> None:
    """Draw one execution's call tree: chains collapsed, branches, and which trajectories are kept."""
    from gyre.trajectory.source import LogSource

    try:
        source = LogSource(log)
        rows = source.execution_calls(execution_id)
        if rows.num_rows == 0:
            raise _fail(GyreError(f"execution {execution_id!r} has no model calls in {log}"))
        outcome = next((o for o in source.outcomes() if o.execution_id == execution_id), None)
        selection = select(CallTree.build(ExecutionCalls.from_arrow(execution_id, rows)), cap)
    except GyreError as error:
        raise _fail(error) from error
    Console().print(render(selection, outcome))


def _print(data: dict, json_out: bool, title: str) -> None:
    if json_out:
        typer.echo(json.dumps(data))
        return
    table = Table(title=title, show_header=False)
    for key, value in data.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
    Console().print(table)
