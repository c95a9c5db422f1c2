"""`gyre trainer bench` (`benchmarks.cli`, registered by `gyre.cli`)."""

import json

from typer.testing import CliRunner

from gyre.cli import app

runner = CliRunner()


def test_bench_json_compares_the_two_forms_on_the_same_run():
    result = runner.invoke(
        app, ["trainer", "bench", "--json", "--executions", "4", "--max-tokens", "2500", "--repeats", "1"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert [w["workload"] for w in data["workloads"]] == ["default", "retry-heavy"]
    for w in data["workloads"]:
        assert w["same_loss"]
        assert w["packed"]["trained_tokens"] == w["expanded"]["trained_tokens"]
        assert w["packed"]["tokens"] <= w["expanded"]["tokens"]
        assert w["speedup_packed_vs_expanded"] > 0

