"""``gyre sim SCENARIO``: simulate a scenario under one policy, or all three with ``--compare``."""

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gyre.errors import GyreError
from gyre.sim.runner import COMPARED, compare, simulate
from gyre.sim.scenario import Scenario, load_scenario, scenario_names

sim_app = typer.Typer(help="Simulate a cluster scenario under a scheduling policy.", add_completion=False,
                    context_settings={"allow_interspersed_args": True})


@sim_app.callback(invoke_without_command=True)
def sim(
    scenario: Annotated[str, typer.Argument(help=f"scenario name ({', '.join(scenario_names())}) or .toml path")],
    policy: Annotated[str, typer.Option(help="elastic | colocate | async")] = "elastic",
    compare_all: Annotated[bool, typer.Option("--compare", help="run all three policies on the same work")] = False,
    steps: Annotated[int | None, typer.Option(min=1, help="train steps (default: the scenario's)")] = None,
    seed: Annotated[int | None, typer.Option(help="workload seed (default: the scenario's)")] = None,
    staleness: Annotated[int | None, typer.Option(min=0, help="override the shared staleness bound")] = None,
    log: Annotated[Path | None, typer.Option(help="write the run's log here (with --compare: one per policy)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    try:
        sc = _with_staleness(load_scenario(scenario), staleness)
        if compare_all:
            out: dict[str, Any] = compare(sc, seed=seed, steps=steps, log_dir=log)
        else:
            out = simulate(sc, policy, seed=seed, steps=steps, log_dir=log).to_dict()
    except GyreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(out))
    else:
        _print_table(out["policies"] if compare_all else [out], out if compare_all else None)


def _with_staleness(sc: Scenario, staleness: int | None) -> Scenario:
    if staleness is None:
        return sc
    return sc.model_copy(update={"policy": sc.policy.model_copy(update={"staleness": staleness})})


def _print_table(runs: list[dict[str, Any]], comparison: dict[str, Any] | None) -> None:
    table = Table(title=f"{runs[0]['scenario']}: {runs[0]['steps']} steps, seed {runs[0]['seed']}")
    for column in ("policy", "hours", "lower bound h", "ratio", "utilization", "idle GPU-h", "switches", "redirects"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(r["policy"], f"{r['hours']:.2f}", f"{r['lower_bound_hours']:.2f}",
                      f"{r['ratio_to_lower_bound']:.3f}", f"{r['utilization']:.1%}", f"{r['idle_gpu_hours']:.0f}",
                      str(r["role_switches"]), str(r["redirects"]))
    console = Console()
    console.print(table)
    if comparison is not None:
        console.print(f"elastic speedup: {comparison['speedup_vs_colocate']:.3f}x vs colocate, "
                      f"{comparison['speedup_vs_async']:.3f}x vs async ({', '.join(COMPARED)} on the same work)")
