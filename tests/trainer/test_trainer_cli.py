"""`gyre trainer` commands (the Typer app the lead registers)."""

import json

from typer.testing import CliRunner

from gyre.trainer.cli import trainer_app

runner = CliRunner()


def test_bench_json_compares_the_two_forms_on_the_same_run():
    result = runner.invoke(
        trainer_app, ["bench", "--json", "--executions", "4", "--max-tokens", "2500", "--repeats", "1"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert [w["workload"] for w in data["workloads"]] == ["default", "retry-heavy"]
    for w in data["workloads"]:
        assert w["same_loss"]
        assert w["packed"]["trained_tokens"] == w["expanded"]["trained_tokens"]
        assert w["packed"]["tokens"] <= w["expanded"]["tokens"]
        assert w["speedup_packed_vs_expanded"] > 0


def test_replicas_runs_steps_and_lists_the_events(tmp_path):
    result = runner.invoke(
        trainer_app, ["replicas", "--json", "--satellites", "0", "--executions", "4", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    kinds = [e["kind"] for e in json.loads(result.output.strip().splitlines()[-1])["events"]]
    assert kinds[0] == "train_step_started" and kinds[-2:] == ["train_step_finished", "weights_published"]
    assert "micro_step_claimed" in kinds
