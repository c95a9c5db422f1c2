"""``gyre replay LOG``: re-derive a run's decisions exactly, or re-time it under another policy."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gyre.errors import ConfigError, GyreError
from gyre.replay.counterfactual import retime
from gyre.replay.exact import replay_decisions

replay_app = typer.Typer(help="Replay a recorded run's scheduling decisions.", add_completion=False,
                       context_settings={"allow_interspersed_args": True})


@replay_app.callback(invoke_without_command=True)
def replay(
    log: Annotated[Path, typer.Argument(help="log directory of a recorded (or simulated) run")],
    policy: Annotated[str | None, typer.Option(
        help="re-time the recorded executions under this policy instead of replaying exactly")] = None,
    scenario: Annotated[str | None, typer.Option(
        help="borrow cluster and cost parameters from this scenario (for logs of real runs)")] = None,
    params: Annotated[str | None, typer.Option(help="policy parameters as JSON, overriding the recorded ones")] = None,
    policy_version: Annotated[str | None, typer.Option(
        help="replay as another shipped version of the recorded policy (e.g. elastic/2 on an elastic/3 log), "
             "with the recorded parameters it takes: where it would have decided otherwise")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Exit status 1 when exact replay finds a mismatch, so CI can gate on it."""
    try:
        overrides = json.loads(params) if params else None
        if policy is not None and policy_version is not None:
            raise ConfigError("--policy-version replays the recorded policy exactly as another of its versions: "
                              "not with --policy (a re-timing)")
        if policy is not None:
            out = retime(log, policy, scenario=scenario, params=overrides)
        else:
            out = replay_decisions(log, params=overrides, version=policy_version).to_dict()
    except json.JSONDecodeError as error:
        typer.echo(f"error: --params is not valid JSON: {error}", err=True)
        raise typer.Exit(2) from None
    except GyreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(out))
    elif policy is not None:
        Console().print(f"{out['steps']} recorded steps under [bold]{policy}[/]: {out['hours']:.2f} h "
                        f"(recorded {out['recorded_policy']}: {out['recorded_hours']:.2f} h, "
                        f"speedup {out['speedup']:.3f}x)")
    else:
        as_version = "" if out["version_matches"] else f" replayed as {out['current_policy_version']}"
        Console().print(f"{out['policy']} ({out['policy_version']}{as_version}): {out['decisions']} decisions at "
                        f"{out['decision_points']} decision points, [bold]{out['mismatches']} mismatches[/]")
    if policy is None and out["mismatches"]:
        raise typer.Exit(1)
