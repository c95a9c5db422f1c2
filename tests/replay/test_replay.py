"""Replay: exact on every shipped and freshly simulated log, drift caught, counterfactuals consistent."""

import json

import pytest
import typer
from typer.testing import CliRunner

from gyre.replay.cli import replay_app
from gyre.replay.counterfactual import recorded_hours, retime, retime_run
from gyre.replay.exact import ReplayError, replay_decisions
from gyre.replay.golden import golden_decisions, read_golden, shipped_logs
from gyre.scheduler import get_policy
from gyre.sim.runner import policy_params, simulate
from gyre.sim.scenario import load_scenario

SHIPPED = shipped_logs()


@pytest.mark.parametrize("log", SHIPPED, ids=[log.name for log in SHIPPED])
def test_shipped_logs_replay_exactly_and_match_their_golden_decisions(log):
    report = replay_decisions(log.path)
    assert report.recorded_version == report.current_version
    assert report.mismatches == [], report.to_dict()
    assert golden_decisions(log.path) == read_golden(log.golden), (
        f"decisions on {log.name} drifted from {log.golden}; if the policy change is deliberate, bump its "
        f"version and run `python -m gyre.replay.golden --regenerate`")


def test_shipped_logs_cover_every_policy_and_some_decisions():
    assert {log.policy for log in SHIPPED} == {"elastic", "colocate", "async"}
    assert sum(len(read_golden(log.golden)) for log in SHIPPED) > 10


@pytest.mark.parametrize("policy,staleness", [("elastic", 0), ("elastic", 2), ("colocate", 0), ("async", 1)])
def test_freshly_simulated_logs_replay_exactly(tmp_path, policy, staleness):
    scenario = load_scenario("terminal-bench-like")
    overrides = {} if policy == "colocate" else {"staleness": staleness}
    params = policy_params(scenario, get_policy(policy), overrides)
    simulate(scenario, policy, steps=2, seed=7, log_dir=tmp_path / "log", params=params)
    report = replay_decisions(tmp_path / "log")
    assert report.decision_points > 100
    assert report.mismatches == []
    assert report.replayed_decisions == report.decisions


def test_changed_parameters_show_up_as_mismatches():
    log = next(log for log in SHIPPED if log.policy == "elastic").path
    report = replay_decisions(log, params={"hysteresis_slots": 6})
    assert report.mismatches, "a stricter hysteresis must change some decision"
    first = report.mismatches[0].to_dict()
    assert first["recorded"] != first["replayed"]


def test_a_log_without_run_started_is_refused(tmp_path):
    from gyre.events.models import CellRegistered
    from gyre.log import LogWriter

    with LogWriter(tmp_path / "log") as writer:
        writer.append([CellRegistered(cell_id="c", role="rollout", slots=1)])
    with pytest.raises(ReplayError, match="does not begin with run_started"):
        replay_decisions(tmp_path / "log")


def test_retiming_under_the_recorded_policy_reproduces_the_run():
    for log in SHIPPED:
        result = retime_run(log.path, log.policy)
        assert result.hours * 3600 == pytest.approx(recorded_hours(log.path) * 3600, abs=1e-6), log.name


def test_counterfactual_matches_simulating_the_same_work_directly():
    log = next(log for log in SHIPPED if log.name == "tiny-elastic")
    direct = simulate(load_scenario(log.scenario), "colocate", seed=log.seed)
    out = retime(log.path, "colocate")
    assert out["hours"] == pytest.approx(direct.hours, abs=1e-4)
    assert out["speedup"] == pytest.approx(recorded_hours(log.path) / direct.hours, abs=1e-3)


def test_cli_reports_json_and_fails_on_mismatch():
    app = typer.Typer()
    app.add_typer(replay_app, name="replay")
    runner = CliRunner()
    path = str(SHIPPED[0].path)
    result = runner.invoke(app, ["replay", path, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mismatches"] == 0 and out["decisions"] == len(read_golden(SHIPPED[0].golden))
    result = runner.invoke(app, ["replay", path, "--params", '{"hysteresis_slots": 6}'])
    assert result.exit_code == 1 and "mismatches" in result.stdout
    result = runner.invoke(app, ["replay", path, "--policy", "async", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["policy"] == "async"
    result = runner.invoke(app, ["replay", "/no/such/log"])
    assert result.exit_code == 2 and "no log at" in result.output


def test_cli_replays_a_log_as_another_shipped_version_of_its_policy():
    """``--policy-version``: the recorded prefixes decided by another version (here elastic/3 on an elastic/2
    log, given the recorded parameters it takes): mismatches where they differ; the recorded one: none."""
    app = typer.Typer()
    app.add_typer(replay_app, name="replay")
    runner = CliRunner()
    path = str(next(log for log in SHIPPED if log.version == "elastic/2").path)
    same = runner.invoke(app, ["replay", path, "--policy-version", "elastic/2", "--json"])
    assert same.exit_code == 0 and json.loads(same.stdout)["mismatches"] == 0, same.output
    other = runner.invoke(app, ["replay", path, "--policy-version", "elastic/3"])
    assert other.exit_code == 1 and "elastic/2 replayed as elastic/3" in other.stdout, other.output
    for bad in (["--policy-version", "elastic/9"], ["--policy-version", "elastic/3", "--policy", "colocate"]):
        refused = runner.invoke(app, ["replay", path, *bad])
        assert refused.exit_code == 2 and "error:" in refused.output, bad
