"""`gyre log audit LOG`: the audit's command, added to the `log` sub-app by `gyre.cli` (the log sits below it)."""

import json
from typing import Annotated

import typer
from rich.table import Table

from gyre.audit.rules import audit as audit_log
from gyre.log.cli import JsonOpt, PathArg, clear_errors, console


@clear_errors
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
                     "rewards_unqueued", "executions_cut", "micro_steps_redone", "micro_steps_released",
                     "steps_aborted",
                     "calls_versioned", "calls_unversioned", "calls_stale", "calls_overlagged", "max_version_lag",
                     "role_switches", "cells_lost", "cells_reregistered", "commands_abandoned", "controller_restarts",
                     "quiet_gaps", "run_status"):
            table.add_row(name, str(getattr(report, name)))
        console.print(table)
        for problem in report.problems:
            console.print(f"[yellow]- {problem}[/yellow]")
    if not report.ok:
        raise typer.Exit(1)


