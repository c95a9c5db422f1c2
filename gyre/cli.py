"""The `gyre` command line: one Typer app, one sub-app per concept."""

from pathlib import Path
from typing import Annotated

import typer

from gyre.cluster.cli import cell as cluster_cell
from gyre.cluster.cli import run as cluster_run
from gyre.engine.cli import engine_app
from gyre.harness.cli import harness_app
from gyre.log.cli import log_app
from gyre.observe.cli import export as export_metrics
from gyre.observe.cli import report
from gyre.proxy.cli import proxy_app
from gyre.replay.cli import replay_app
from gyre.sim.cli import sim_app
from gyre.train.cli import export, train
from gyre.trainer.cli import trainer_app
from gyre.trajectory.cli import trajectories_app

app = typer.Typer(no_args_is_help=True, help="Gyre: elastic, event-sourced RL for long-horizon coding agents.")
app.add_typer(log_app, name="log")
app.add_typer(engine_app, name="engine")
app.add_typer(proxy_app, name="proxy")
app.add_typer(trajectories_app, name="trajectories")
app.add_typer(sim_app, name="sim")
app.add_typer(replay_app, name="replay")
app.add_typer(harness_app, name="harness")
app.command("train")(train)
app.command("export")(export)
app.add_typer(trainer_app, name="trainer")
app.command("report")(report)
app.command("metrics")(export_metrics)
app.command("run")(cluster_run)
app.command("cell")(cluster_cell)

schema_app = typer.Typer(no_args_is_help=True, help="The event schema.")
app.add_typer(schema_app, name="schema")

DEFAULT_SCHEMA_PATH = Path("schemas/events.v1.json")


@schema_app.command("dump")
def schema_dump(
    out: Annotated[Path, typer.Option(help="where to write the schema document")] = DEFAULT_SCHEMA_PATH,
    check: Annotated[bool, typer.Option(help="exit 1 if the file differs from the code instead of writing")] = False,
) -> None:
    """Write the event schema (generated from the pydantic models) as JSON."""
    from gyre.events.schema import schema_json

    text = schema_json()
    if check:
        current = out.read_text() if out.exists() else ""
        if current != text:
            typer.echo(f"{out} is out of date with the event models; run `gyre schema dump`", err=True)
            raise typer.Exit(1)
        typer.echo(f"{out} matches the event models")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    typer.echo(f"wrote {out}")


def main() -> None:  # pragma: no cover
    app()
