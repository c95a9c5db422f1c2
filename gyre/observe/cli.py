"""`gyre report RUN_DIR` and `gyre export RUN_DIR`: what follows a run's log, from the command line."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gyre.errors import GyreError

console = Console()


def report(run_dir: Annotated[Path, typer.Argument(help="run directory (holds log/), e.g. runs/tiny-cpu")],
           out: Annotated[Path | None, typer.Option(help="where to write (default RUN_DIR/report.html)")] = None
           ) -> None:
    """Write a self-contained HTML report of a run (plots inline; nothing is fetched when it is viewed)."""
    from gyre.report import write_report

    try:
        path = write_report(run_dir, out)
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    console.print(f"report: {path}")


def export(run_dir: Annotated[Path, typer.Argument(help="run directory (holds log/)")],
           to: Annotated[list[str], typer.Option("--to", help="tensorboard | wandb (repeat for both)")],
           follow: Annotated[bool, typer.Option(help="keep following the log until the run finishes")] = False,
           project: Annotated[str, typer.Option(help="W&B project name")] = "gyre") -> None:
    """Export a run's metrics from its log: TensorBoard event files (RUN_DIR/tensorboard) and/or a W&B
    offline run (RUN_DIR/wandb; `wandb sync` uploads it later)."""
    from gyre.observe import LogFollower, export_log, make_exporters

    log = run_dir / "log"
    try:
        if not log.is_dir():
            raise GyreError(f"no log at {log}: RUN_DIR is the run directory that holds log/")
        exporters = make_exporters(to, run_dir, run_name=run_dir.name, project=project)
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    if follow:
        follower = LogFollower(log, exporters, until_finished=True).start()
        try:
            follower.wait()
        except KeyboardInterrupt:
            console.print("[yellow]stopped following; exporting what the log holds[/yellow]")
        finally:
            follower.close()
    else:
        try:
            export_log(log, exporters)
        finally:
            for exporter in exporters:
                exporter.close()
    console.print(f"exported {run_dir} to {', '.join(to)}")
