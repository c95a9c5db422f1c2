"""A simulated run is a real Gyre log: verifiable, foldable, queryable with DuckDB."""

import pytest

from gyre.log import LogReader
from gyre.sim.runner import simulate
from gyre.sim.scenario import load_scenario
from gyre.state import ClusterView, ExecutionsView, TrainerView, replay


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "log"
    return simulate(load_scenario("tiny"), "elastic", log_dir=path), path


def test_the_log_verifies_and_keeps_simulated_time(run):
    result, path = run
    report = LogReader(path).verify()
    assert report.ok and report.first_seq == 0
    con = LogReader(path).duckdb()
    first, last = con.execute("SELECT min(ts), max(ts) FROM events").fetchone()
    assert first.year == 2026 and (last - first).total_seconds() / 3600 == pytest.approx(result.hours)
    assert con.execute("SELECT bool_and(ts >= lag) FROM (SELECT ts, lag(ts, 1, ts) OVER (ORDER BY seq) AS lag "
                       "FROM events)").fetchone()[0]


def test_duckdb_views_agree_with_the_summary(run):
    result, path = run
    con = LogReader(path).duckdb()
    assert con.execute("SELECT count(*) FROM executions_finished").fetchone()[0] == result.executions
    assert con.execute("SELECT count(*) FROM role_switch_requests").fetchone()[0] == result.role_switches
    assert con.execute("SELECT count(*) FROM call_redirects").fetchone()[0] == result.redirects
    assert con.execute("SELECT count(*) FROM role_switches").fetchone()[0] == result.role_switches
    assert con.execute("SELECT min(tokens) > 0 FROM executions_finished WHERE status <> 'harness_error'").fetchone()[0]


def test_projections_fold_the_simulated_log(run):
    result, path = run
    cluster, _ = replay(ClusterView(), path)
    assert cluster.watermark == 0 and not cluster.call_cell
    assert all(cell.switching_to is None for cell in cluster.cells.values())
    executions, _ = replay(ExecutionsView(), path)
    assert len(executions.executions) == result.executions
    assert sum(e.scored for e in executions.executions.values()) > 0.9 * result.executions
    trainer, _ = replay(TrainerView(), path)
    assert trainer.policy_version == trainer.published_version == result.steps


def test_busy_time_read_from_the_log_matches_the_summary(run):
    from gyre.sim.metrics import log_busy

    result, path = run
    busy = log_busy(LogReader(path).duckdb())
    assert busy.makespan_s / 3600 == pytest.approx(result.hours)
    assert busy.utilization == pytest.approx(result.utilization, abs=1e-6)
    assert busy.idle_gpu_hours == pytest.approx(result.idle_gpu_hours, rel=1e-6)
