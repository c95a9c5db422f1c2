"""``gyre trajectories`` as a user runs it: synth, build --json, show."""

import json
from pathlib import Path

from typer.testing import CliRunner

from gyre.trajectory.cli import trajectories_app
from gyre.trajectory.synth_log import SynthSummary

runner = CliRunner()

KEYS = {
    "executions",
    "trajectories_total",
    "trajectories_kept",
    "policy_tokens_trained",
    "tokens_expanded",
    "tokens_tree_packed",
    "excluded_eval_errors",
    "timed_out_scored",
    "groups_dropped",
}


def test_synth_then_build_json(tmp_path: Path) -> None:
    log = tmp_path / "log"
    result = runner.invoke(
        trajectories_app,
        [
            "synth",
            str(log),
            "--executions",
            "4",
            "--group-size",
            "2",
            "--seed",
            "5",
            "--min-tokens",
            "1000",
            "--max-tokens",
            "2000",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["executions"] == 4
    result = runner.invoke(trajectories_app, ["build", str(log), "--cap", "5", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report) >= KEYS and report["executions"] == 4 and report["cap"] == 5
    uncapped = json.loads(runner.invoke(trajectories_app, ["build", str(log), "--uncapped", "--json"]).output)
    assert uncapped["cap"] is None and uncapped["trajectories_kept"] >= report["trajectories_kept"]


def test_build_writes_arrow_micro_batches(small_run: tuple[Path, SynthSummary], tmp_path: Path) -> None:
    log, _ = small_run
    result = runner.invoke(
        trajectories_app,
        ["build", str(log), "--form", "expanded", "--token-budget", "65536", "--out", str(tmp_path / "mb")],
    )
    assert result.exit_code == 0, result.output
    assert "trajectories_kept" in result.output
    assert len(list((tmp_path / "mb").glob("micro-batch-*.arrow"))) > 1


def test_show_draws_the_tree(small_run: tuple[Path, SynthSummary]) -> None:
    log, _ = small_run
    result = runner.invoke(trajectories_app, ["show", str(log), "exec-00001"])
    assert result.exit_code == 0, result.output
    assert "exec-00001" in result.output and "kept #0" in result.output and "sub-agent" in result.output


def test_errors_are_reported_not_raised(tmp_path: Path) -> None:
    result = runner.invoke(trajectories_app, ["build", str(tmp_path / "missing"), "--json"])
    assert result.exit_code == 2 and "no log at" in result.output
    result = runner.invoke(trajectories_app, ["build", str(tmp_path), "--form", "wide"])
    assert result.exit_code == 2 and "form must be" in result.output
    result = runner.invoke(trajectories_app, ["synth", str(tmp_path / "x"), "--min-tokens", "5"])
    assert result.exit_code == 2 and "min_tokens" in result.output
