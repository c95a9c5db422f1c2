"""``gyre sim``: JSON shapes, errors, and the app registered the way the main CLI does it."""

import json

import typer
from typer.testing import CliRunner

from gyre.sim.cli import sim_app

app = typer.Typer()
app.add_typer(sim_app, name="sim")
runner = CliRunner()


def test_one_policy_prints_the_summary():
    result = runner.invoke(app, ["sim", "tiny", "--policy", "colocate", "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["policy"] == "colocate" and out["steps"] == 2
    for key in ("hours", "lower_bound_hours", "ratio_to_lower_bound", "utilization", "role_switches"):
        assert key in out


def test_compare_adds_speedups(tmp_path):
    result = runner.invoke(app, ["sim", "tiny", "--compare", "--json", "--log", str(tmp_path / "logs")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    hours = {p["policy"]: p["hours"] for p in out["policies"]}
    assert set(hours) == {"elastic", "colocate", "async"}
    assert out["speedup_vs_colocate"] == round(hours["colocate"] / hours["elastic"], 4) or abs(
        out["speedup_vs_colocate"] - hours["colocate"] / hours["elastic"]) < 1e-3
    assert (tmp_path / "logs" / "async").is_dir()


def test_table_output_and_staleness_override():
    result = runner.invoke(app, ["sim", "tiny", "--staleness", "1", "--steps", "2"])
    assert result.exit_code == 0, result.output
    assert "elastic" in result.stdout and "tiny: 2 steps" in result.stdout


def test_errors_are_one_line_and_exit_2():
    result = runner.invoke(app, ["sim", "seed-9t", "--json"])
    assert result.exit_code == 2
    assert "unknown scenario 'seed-9t'" in result.output
    result = runner.invoke(app, ["sim", "tiny", "--policy", "greedy"])
    assert result.exit_code == 2 and "unknown policy 'greedy'" in result.output


def test_ablate_and_set(tmp_path):
    result = runner.invoke(app, ["sim", "tiny", "--ablate", "--steps", "1", "--json",
                                 "--set", "switch.to_training_s=20"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {"runs", "decomposition", "verdict", "speedup_vs_best_baseline", "best_async"} <= set(out)
    assert any(r["variant"] == "colocate + streaming" for r in out["runs"])
    result = runner.invoke(app, ["sim", "tiny", "--policy", "colocate", "--steps", "1", "--json",
                                 "--set", "colocate.stream_micro_steps=true"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["sim", "tiny", "--set", "colocate.stream_micro_steps"])
    assert result.exit_code == 2 and "expected POLICY.FIELD=VALUE" in result.output


def test_policy_version_runs_elastic3_with_its_own_parameters():
    """``--policy-version elastic/3`` runs the newer version alone, its own parameters set with ``--set``
    (the scenario accepts any shipped version's); the version that runs still refuses the others'."""
    v3 = ["sim", "tiny", "--steps", "2", "--json", "--policy-version", "elastic/3",
          "--set", "elastic.partial_rollouts=true", "--set", "elastic.oversample_groups=2",
          "--set", "elastic.idle_recall=true"]
    result = runner.invoke(app, v3)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["policy_version"] == "elastic/3" and out["steps"] == 2
    refused = runner.invoke(app, ["sim", "tiny", "--steps", "2", "--set", "elastic.idle_recall=true"])
    assert refused.exit_code == 2 and "idle_recall" in refused.output  # elastic/2 has no such parameter
    for bad in (["--policy-version", "elastic/9"], ["--policy-version", "elastic/3", "--ablate"],
                ["--set", "elastic.bogus=1"]):
        result = runner.invoke(app, ["sim", "tiny", *bad])
        assert result.exit_code == 2, bad
