"""``gyre sim SCENARIO``: simulate a scenario under one policy, all three (``--compare``), or the ablation
of elastic against the best-tuned baselines (``--ablate``)."""

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gyre.errors import ConfigError, GyreError
from gyre.sim.runner import COMPARED, ablate, compare, simulate
from gyre.sim.scenario import Scenario, load_scenario, scenario_names, with_policy_values, with_values

sim_app = typer.Typer(help="Simulate a cluster scenario under a scheduling policy.", add_completion=False,
                    context_settings={"allow_interspersed_args": True})


@sim_app.callback(invoke_without_command=True)
def sim(
    scenario: Annotated[str, typer.Argument(help=f"scenario name ({', '.join(scenario_names())}) or file path")],
    policy: Annotated[str, typer.Option(help="elastic | colocate | async")] = "elastic",
    policy_version: Annotated[str | None, typer.Option(
        help="a shipped version other than the current one, e.g. elastic/3, under its parameter rule "
             "(docs/scheduler.md; its own parameters go in --set elastic.FIELD=VALUE)")] = None,
    compare_all: Annotated[bool, typer.Option("--compare", help="run all three policies on the same work")] = False,
    ablation: Annotated[bool, typer.Option(
        "--ablate", help="elastic against every baseline variant (streaming, async splits) on the same work")] = False,
    steps: Annotated[int | None, typer.Option(min=1, help="train steps (default: the scenario's)")] = None,
    seed: Annotated[int | None, typer.Option(help="workload seed (default: the scenario's)")] = None,
    staleness: Annotated[int | None, typer.Option(min=0, help="override the shared staleness bound")] = None,
    settings: Annotated[list[str] | None, typer.Option(
        "--set", help="a policy parameter, POLICY.FIELD=VALUE (e.g. colocate.stream_micro_steps=true, "
                      "async.training_cells=3) or any scenario parameter, SECTION.FIELD=VALUE "
                      "(switch.to_training_s=1800); repeatable")] = None,
    log: Annotated[Path | None, typer.Option(help="write the run's log here (with --compare: one per policy)")] = None,
    cell_time: Annotated[bool, typer.Option(
        "--cell-time", help="one policy: also report where the cell-time went (gyre.sim.breakdown)")] = False,
    oversample: Annotated[str | None, typer.Option(
        "--oversample", help="with --ablate: the over-sampled groups every design's partial-rollout rows try, "
                             "comma-separated, each at most a batch (default: a quarter and half a batch)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    try:
        sc = _configured(load_scenario(scenario), staleness, settings or [])
        if policy_version is not None and (ablation or compare_all):
            raise ConfigError("--policy-version runs one policy: not with --ablate or --compare "
                              "(the ablation already runs elastic/3)")
        if cell_time and (ablation or compare_all):
            raise ConfigError("--cell-time breaks down one run: not with --ablate or --compare")
        if oversample is not None and not ablation:
            raise ConfigError("--oversample sets the ablation's sweep: use it with --ablate "
                              "(one run: --set POLICY.oversample_groups=K)")
        if ablation:
            out: dict[str, Any] = ablate(sc, seed=seed, steps=steps, sweep=_ints("--oversample", oversample))
        elif compare_all:
            out = compare(sc, seed=seed, steps=steps, log_dir=log)
        else:
            out = simulate(sc, policy, seed=seed, steps=steps, log_dir=log, version=policy_version,
                           cell_time=cell_time).to_dict()
    except GyreError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(out))
    elif ablation:
        _print_ablation(out)
    else:
        _print_table(out["policies"] if compare_all else [out], out if compare_all else None)
        if out.get("cell_time"):
            Console().print("cell-time: " + ", ".join(f"{k} {v:.1%}" for k, v in out["cell_time"].items()))


def _ints(option: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected comma-separated integers, e.g. 4,8,12,16") from None


def _configured(sc: Scenario, staleness: int | None, settings: list[str]) -> Scenario:
    """Apply ``--staleness`` and ``--set``: policy parameters (POLICY.FIELD, staleness) or any other
    scenario parameter by its dotted path (``switch.to_training_s=1800``)."""
    policy_values: dict[str, Any] = {}
    scenario_values: dict[str, Any] = {}
    if staleness is not None:
        policy_values["staleness"] = staleness
    for item in settings:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected POLICY.FIELD=VALUE or SECTION.FIELD=VALUE")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        is_policy = key == "staleness" or key.split(".")[0] in ("elastic", "colocate", "async", "policy")
        if is_policy:
            policy_values[key.removeprefix("policy.")] = value
        else:
            scenario_values[key] = value
    if scenario_values:
        sc = with_values(sc, scenario_values)
    return with_policy_values(sc, policy_values) if policy_values else sc


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


def _print_ablation(out: dict[str, Any]) -> None:
    table = Table(title=f"{out['scenario']}: {out['steps']} steps, seed {out['seed']}, staleness {out['staleness']}")
    for column in ("variant", "hours", "ratio to bound", "elastic speedup", "switches", "cuts", "mixed-version",
                   "max token lag"):
        table.add_column(column, justify="right")
    for r in out["runs"]:
        speedup = out["speedup"].get(r["variant"])
        table.add_row(r["variant"], f"{r['hours']:.2f}", f"{r['ratio_to_lower_bound']:.3f}",
                      "" if speedup is None else f"{speedup:.3f}x", str(r["role_switches"]),
                      str(r["cut_executions"]), f"{r['mixed_version_share']:.1%}", str(r["max_token_lag"]))
    console = Console()
    console.print(table)
    d = out["decomposition"]
    console.print(f"lead over the brief's colocate {d['total_vs_brief_colocate']:.3f}x = streaming "
                  f"{d['streaming']:.3f}x · elasticity {d['elasticity']:.3f}x · migration {d['migration']:.3f}x")
    console.print(out["verdict"])
    pr = out["partial_rollouts"]
    gains = ", ".join(f"{design} {gain:.3f}x" for design, gain in pr["gain"].items())
    console.print(f"with partial rollouts for every design (gain {gains}; groups up to {pr['max_group_lag']} "
                  f"versions old): elastic {pr['speedup_vs_best_baseline']:.3f}x the best baseline")
    e3 = out["elastic3"]
    console.print(f"elastic/3: {e3['speedup_vs_best_baseline']:.3f}x the best baseline, "
                  f"{e3['speedup_vs_best_baseline_partial']:.3f}x with partial rollouts for every design "
                  f"({e3['best']}, {e3['ratio_to_lower_bound_partial']:.3f}x the lower bound); "
                  f"{e3['speedup_vs_elastic2_partial']:.3f}x elastic/2")
