"""`gyre run CONFIG` (the controller of a cluster run) and `gyre cell` (one cell process)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gyre.errors import GyreError
from gyre.run.console import print_phase

console = Console()


def run(config: Annotated[Path, typer.Argument(help="TOML run configuration, e.g. examples/cluster-cpu.toml")],
        steps: Annotated[int | None, typer.Option(help="override the number of steps")] = None,
        policy: Annotated[str | None, typer.Option(help="override scheduler.policy (elastic|colocate|async)")] = None,
        policy_version: Annotated[str | None, typer.Option(
            help="override scheduler.version: a shipped version of the policy, e.g. elastic/3 (default: the "
                 "current one)")] = None,
        run_dir: Annotated[Path | None, typer.Option(help="override run_dir")] = None,
        bind: Annotated[str | None, typer.Option(help="override cluster.bind (the interface to listen on)")] = None,
        advertise: Annotated[str | None, typer.Option(
            help="override cluster.advertise (the address the cells and the proxy dial)")] = None,
        resume: Annotated[bool, typer.Option(
            "--resume", help="restart the controller of the run in run_dir (same config): its cells and proxy "
                             "keep running and reconnect; those that are gone are started again")] = False,
        emulate: Annotated[str | None, typer.Option(
            help="face a scenario's emulated cluster and workload (replay/scenarios name or file): its cells, "
                 "steps, batch, policy parameters, accelerator and executions (the scenario agent)")] = None,
        time_scale: Annotated[float, typer.Option(help="with --emulate: emulated seconds per wall second")] = 1.0,
        token_scale: Annotated[float, typer.Option(
            help="with --emulate: scenario tokens one real token stands for")] = 1.0,
        ) -> None:
    """Run RL on a cluster of cell processes: controller here, each cell and the proxy its own process."""
    from gyre.cluster.config import ClusterConfig
    from gyre.cluster.run import ClusterRun

    overrides = {key: value for key, value in (("steps", steps), ("run_dir", run_dir and str(run_dir)),
                                               ("scheduler.policy", policy), ("scheduler.version", policy_version),
                                               ("cluster.bind", bind), ("cluster.advertise", advertise))
                 if value is not None}
    try:
        settings = ClusterConfig.load(config, overrides)  # an override is checked as a key in the file is
        if emulate is not None:
            from gyre.cluster.emulated import scenario_overrides

            scenario = scenario_overrides(settings, emulate, time_scale=time_scale, token_scale=token_scale)
            settings = ClusterConfig.load(config, {**scenario, **overrides})  # the command line wins
    except (GyreError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    cluster = settings.cluster
    console.print(f"[bold]gyre run[/bold] {settings.name}: {cluster.cells} cells x {cluster.slots} slots "
                  f"(core {cluster.core}), policy {settings.scheduler.version or settings.scheduler.policy}, "
                  f"{settings.steps} steps, run directory {settings.run_dir}")
    status = console.status("starting the controller, the cells and the proxy")

    def progress(phase: str, figures: dict) -> None:
        if phase == "tick":
            roles = " ".join(f"{c}:{r}" for c, r in figures["cells"].items())
            status.update(f"watermark {figures['watermark']} | {roles} | trained {figures['trained']}/"
                          f"{figures['steps']} | policy v{figures['version']}")
        elif phase == "spawned" and figures["launcher"] == "manual":
            console.print(f"controller at [bold]{figures['controller']}[/bold]: start each process with `gyre cell "
                          f"--controller {figures['controller']} --cell-id ID --config CONFIG` (and `gyre proxy serve "
                          "--controller ... --config CONFIG`), GYRE_RUN_SECRET in its environment")
            status.update(f"waiting for {', '.join(figures['processes'])} to connect")
        elif phase == "spawned":
            status.update(f"waiting for {', '.join(figures['processes'])} to connect (output in {figures['logs']})")
        elif phase == "resumed":
            console.print(f"[yellow]resumed[/yellow]: adopted {', '.join(figures['adopted']) or 'none'}, restarted "
                          f"{', '.join(figures['restarted']) or 'none'}; the proxy holds {figures['held']} executions")
        elif phase == "lost":
            console.print(f"[red]{figures['cell']} lost[/red] ({figures['reason']}); starting it again")
        elif phase == "registered":
            console.print(f"[green]{figures['cell']} registered again[/green] as {figures['role']}")
        elif phase == "switch":
            console.print(f"[cyan]{figures['cell']} -> {figures['to']}[/cyan] in {figures['seconds']:.2f}s")
        else:
            print_phase(console, phase, figures)

    try:
        with status:
            cluster_run = ClusterRun(settings, progress, resume=resume)
            summary = cluster_run.run()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; the log is committed[/yellow]")
        raise typer.Exit(130) from None
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from None
    console.print(summary_table(summary))
    console.print(timeline_table(summary))
    if summary.emulation is not None:
        e = summary.emulation
        verdict = "[green]valid[/green]" if e.get("valid", 1.0) else "[red]INVALID: real compute overran it[/red]"
        console.print(f"emulated accelerators: {e['emulated_s']:.0f} s of accelerator time in {e['holds']:.0f} holds; "
                      f"real compute over its emulated time {e['overrun_s']:.1f} s ({e['overrun_share']:.1%}, "
                      f"{e['overruns']:.0f} holds): figures {verdict}")
    console.print(f"log: {summary.log} (run {summary.run_id}); `gyre replay {summary.log}` re-derives every decision")


def summary_table(summary) -> Table:
    table = Table(title=f"{summary.policy}: {summary.status} in {summary.wall_s:.0f}s, {summary.switches} switches")
    for column in ("step", "policy", "micro-steps", "reward", "scored", "at (s)"):
        table.add_column(column, justify="right")
    for s in summary.steps:
        reward = "n/a" if s.reward_mean is None else f"{s.reward_mean:.3f}"
        table.add_row(str(s.step), f"v{s.policy_version}", str(s.micro_steps), reward, str(s.scored),
                      f"{s.wall_s:.0f}")
    return table


def timeline_table(summary) -> Table:
    table = Table(title="role timeline (seconds from run start)")
    table.add_column("cell")
    table.add_column("roles")
    by_cell: dict[str, list[str]] = {}
    for span in summary.timeline:
        by_cell.setdefault(span.cell_id, []).append(f"{span.role} {span.start_s:.0f}-{span.end_s or 0:.0f}")
    for cell, spans in sorted(by_cell.items()):
        table.add_row(cell, " | ".join(spans))
    return table


def cell(controller: Annotated[str, typer.Option(help="the controller's gRPC address, HOST:PORT")],
         cell_id: Annotated[str, typer.Option(help="this cell's id (cell0 .. cellN-1)")],
         config: Annotated[Path, typer.Option(help="the run's config file")],
         bind: Annotated[str | None, typer.Option(help="override cluster.bind on this host")] = None,
         advertise: Annotated[str | None, typer.Option(
             help="override cluster.advertise: the address peers reach this cell at")] = None,
         ) -> None:
    """One cell of a cluster run: engine + trainer replica + transfer endpoint (secret from $GYRE_RUN_SECRET)."""
    from gyre.cluster.cell_node import main

    main(config, controller, cell_id, bind=bind, advertise=advertise)
