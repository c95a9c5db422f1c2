"""The `gyre` command line: one Typer app, one sub-app per concept.

The top of the layers: commands a package below may not import are registered here — the audit and the
benchmarks under the sub-apps they belong to, the cluster's proxy node under `gyre proxy serve`.
"""

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.cli import log_bench, proxy_bench, trainer_bench
from gyre.audit.cli import audit
from gyre.cluster.cli import cell as cluster_cell
from gyre.cluster.cli import run as cluster_run
from gyre.engine.cli import engine_app
from gyre.harness.cli import harness_app
from gyre.log.cli import log_app
from gyre.observe.cli import export as export_metrics
from gyre.observe.cli import report
from gyre.proxy.cli import proxy_app
from gyre.proxy.cli import serve as proxy_serve
from gyre.replay.cli import replay_app
from gyre.sft.cli import sft
from gyre.sim.cli import sim_app
from gyre.train.cli import export, train
from gyre.trajectory.cli import trajectories_app


def _with_controller(serve: Callable[..., None]) -> Callable[..., None]:
    """The proxy's `serve` plus ``--controller`` / ``--config``: with them it runs the proxy process of a cluster
    run (`gyre.cluster.proxy_node`, started by `gyre run`) instead of a standalone proxy."""

    def run(*args, controller: str | None = None, config: Path | None = None, **kwargs) -> None:
        if controller is None:
            serve(*args, **kwargs)
            return
        if config is None:
            raise typer.BadParameter("--controller needs the run's --config", param_hint="--config")
        from gyre.cluster.proxy_node import main as serve_cluster

        serve_cluster(config, controller)

    options = {
        "controller": Annotated[str | None, typer.Option(
            help="Serve a cluster run: the controller's gRPC address (HOST:PORT); the engines, executions and "
                 "log come from it, the run secret from $GYRE_RUN_SECRET.")],
        "config": Annotated[Path | None, typer.Option(help="With --controller: the run's config file.")],
    }
    functools.update_wrapper(run, serve)
    del run.__wrapped__  # Typer reads the signature below, not the wrapped function's
    signature = inspect.signature(serve, eval_str=True)
    run.__signature__ = signature.replace(parameters=[
        *signature.parameters.values(),
        *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
          for name, annotation in options.items())])
    run.__annotations__ = {**{name: p.annotation for name, p in signature.parameters.items()}, **options}
    return run


app = typer.Typer(no_args_is_help=True, help="Gyre: elastic, event-sourced RL for long-horizon coding agents.")
log_app.command("audit")(audit)
log_app.command("bench")(log_bench)
proxy_app.command("serve")(_with_controller(proxy_serve))
proxy_app.command("bench")(proxy_bench)
trainer_app = typer.Typer(no_args_is_help=True, help="GSPO trainer: its benchmark.")
trainer_app.command("bench")(trainer_bench)
app.add_typer(log_app, name="log")
app.add_typer(engine_app, name="engine")
app.add_typer(proxy_app, name="proxy")
app.add_typer(trajectories_app, name="trajectories")
app.add_typer(sim_app, name="sim")
app.add_typer(replay_app, name="replay")
app.add_typer(harness_app, name="harness")
app.command("train")(train)
app.command("export")(export)
app.command("sft")(sft)
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
