"""`gyre.audit` on synthetic run logs: a clean run passes; each kind of loss or doubling is named."""

import json
from collections import defaultdict
from pathlib import Path

from typer.testing import CliRunner

from gyre.audit import audit
from gyre.cli import app
from gyre.events.models import (
    CellLost,
    CellRegistered,
    EvaluationFailed,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    MicroStepClaimed,
    MicroStepFinished,
    MicroStepReleased,
    ModelCallFinished,
    RewardRecorded,
    RoleSwitchCompleted,
    RunFinished,
    RunStarted,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.log import LogWriter

RUN = "run"


def queued(e: str, step: int, attempt: int = 0) -> ExecutionQueued:
    return ExecutionQueued(execution_id=e, task_id="hello", group_id=f"g{step}", attempt=attempt, step=step,
                           policy_version=step)


def finished(e: str, status: str = "completed") -> ExecutionFinished:
    return ExecutionFinished(execution_id=e, status=status, duration_s=1.0)


def reward(e: str, value: float = 1.0) -> RewardRecorded:
    return RewardRecorded(execution_id=e, reward=value)


def call(e: str, attempt: int = 0, served: int | None = None) -> ModelCallFinished:
    """A call of ``e`` (named ``s<step>-...``), served by the weights of its step unless ``served`` says."""
    version = int(e.split("-")[0][1:]) if served is None else served
    return ModelCallFinished(execution_id=e, call_id=f"{e}-c{attempt}", cell_id="cell1", output_ids=[1],
                             output_logprobs=[-0.5], attempt=attempt, policy_version=version,
                             engine_version=version)


def step_events(step: int, executions: list[str]) -> list[tuple[str, Event]]:
    """One step: its executions run and are scored by the harness producer, then the trainer trains."""
    out: list[tuple[str, Event]] = [("controller", queued(e, step)) for e in executions]
    for e in executions:
        out += [("harness", ExecutionStarted(execution_id=e, cell_id="cell1")), ("proxy", call(e)),
                ("harness", finished(e)), ("harness", reward(e))]
    out += [("trainer", TrainStepStarted(step=step, policy_version=step, planned_micro_steps=2)),
            ("trainer", MicroStepClaimed(step=step, cell_id="cell0", micro_step=0)),
            ("trainer", MicroStepClaimed(step=step, cell_id="cell1", micro_step=1)),
            ("trainer", MicroStepFinished(step=step, cell_id="cell0", micro_step=0)),
            ("trainer", MicroStepFinished(step=step, cell_id="cell1", micro_step=1)),
            ("trainer", TrainStepFinished(step=step, policy_version=step + 1, micro_steps=2)),
            ("trainer", WeightsPublished(policy_version=step + 1))]
    return out


def clean_run(steps: int = 2) -> list[tuple[str, Event]]:
    out: list[tuple[str, Event]] = [
        ("controller", RunStarted(run_id=RUN, name="t", policy="elastic", policy_version="1")),
        ("controller", CellRegistered(cell_id="cell0", role="training", slots=2, is_core=True)),
        ("controller", CellRegistered(cell_id="cell1", role="rollout", slots=2))]
    for step in range(steps):
        out += step_events(step, [f"s{step}-e{i}" for i in range(3)])
    out.append(("controller", RunFinished(run_id=RUN, status="completed")))
    return out


def write(run_dir: Path, events: list[tuple[str | None, Event]], *, skip: set[tuple[str, int]] = frozenset(),
          repeat: set[tuple[str, int]] = frozenset()) -> Path:
    """Stamp each producer's events 0, 1, 2, ...; numbers in ``skip`` never reach the log, those in
    ``repeat`` reach it twice."""
    numbers: dict[str, int] = defaultdict(int)
    stamped = []
    for producer, event in events:
        if producer is None:
            stamped.append(event)
            continue
        number = numbers[producer]
        numbers[producer] += 1
        copy = event.model_copy(update={"producer": producer, "producer_seq": number})
        if (producer, number) in skip:
            continue
        stamped += [copy, copy] if (producer, number) in repeat else [copy]
    log = run_dir / "log"
    with LogWriter(log, run_id=RUN) as writer:
        writer.append(stamped)
        writer.commit()
    return log


def test_a_clean_run_passes_with_its_figures(tmp_path):
    report = audit(write(tmp_path, clean_run()), expected_steps=2)
    assert report.ok, report.problems
    assert report.events_lost == report.events_doubled == report.rewards_lost == report.rewards_doubled == 0
    assert (report.executions, report.attempts, report.completions, report.rewards) == (6, 6, 6, 6)
    assert (report.steps_trained, report.versions, report.micro_steps, report.micro_steps_redone) == (2, [1, 2], 4, 0)
    assert report.run_status == "completed"
    assert {p.producer for p in report.producers} == {"controller", "harness", "proxy", "trainer"}
    assert report.cells_registered == 2 and report.cells_reregistered == 0


def test_a_producer_seq_gap_is_events_lost_naming_the_producer_and_numbers(tmp_path):
    report = audit(write(tmp_path, clean_run(), skip={("proxy", 2), ("proxy", 3)}))
    assert report.events_lost == 2
    assert any("producer 'proxy'" in p and "2..3" in p for p in report.problems), report.problems
    assert next(p for p in report.producers if p.producer == "proxy").missing == 2


def test_a_repeated_producer_seq_is_an_event_doubled(tmp_path):
    report = audit(write(tmp_path, clean_run(), repeat={("trainer", 4)}))
    assert report.events_doubled == 1
    assert any("producer 'trainer' event 4" in p and "2 times" in p for p in report.problems), report.problems


def test_a_doubled_reward_names_the_execution(tmp_path):
    events = clean_run()
    at = events.index(("harness", reward("s0-e1")))
    events.insert(at + 1, ("harness", reward("s0-e1", 0.0)))
    report = audit(write(tmp_path, events))
    assert report.rewards_doubled == 1 and report.events_lost == 0
    assert any("rewards doubled: execution s0-e1 attempt 0" in p for p in report.problems), report.problems


def test_a_missing_reward_of_a_trained_step_names_the_execution(tmp_path):
    events = [item for item in clean_run() if item != ("harness", reward("s1-e2"))]
    report = audit(write(tmp_path, events))
    assert report.rewards_lost == 1
    assert any("rewards lost: execution s1-e2 (step 1" in p and "attempt 0" in p for p in report.problems)


def test_an_untrained_step_need_not_be_scored(tmp_path):
    events = [*clean_run(1)[:-1], ("controller", queued("s1-e0", 1)), clean_run(1)[-1]]
    report = audit(write(tmp_path, events))
    assert report.ok, report.problems


def test_a_requeued_execution_is_fine_when_its_last_attempt_is_scored(tmp_path):
    events = clean_run()
    at = events.index(("harness", reward("s0-e0")))
    events[at] = ("controller", queued("s0-e0", 0, attempt=1))  # the crash: attempt 0 never scored
    events[at + 1:at + 1] = [("proxy", call("s0-e0", attempt=1)), ("harness", finished("s0-e0")),
                             ("harness", reward("s0-e0"))]
    report = audit(write(tmp_path, events))
    assert report.ok, report.problems
    assert (report.executions, report.attempts, report.requeued) == (6, 7, 1)


def test_a_requeued_execution_rewarded_twice_is_doubled(tmp_path):
    events = clean_run()
    at = events.index(("harness", reward("s0-e0")))
    events[at + 1:at + 1] = [("controller", queued("s0-e0", 0, attempt=1)), ("harness", reward("s0-e0"))]
    report = audit(write(tmp_path, events))
    assert report.rewards_doubled == 1
    assert any("execution s0-e0 rewarded again for attempt 1" in p for p in report.problems), report.problems


def test_a_last_attempt_without_reward_is_lost_even_when_an_earlier_one_was_scored_nowhere(tmp_path):
    events = clean_run()
    at = events.index(("harness", reward("s0-e0")))
    events[at] = ("controller", queued("s0-e0", 0, attempt=1))
    report = audit(write(tmp_path, events))
    assert report.rewards_lost == 1
    assert any("execution s0-e0" in p and "last attempt 1" in p for p in report.problems)


def test_an_evaluation_failure_is_an_outcome_and_never_a_reward(tmp_path):
    events = clean_run()
    at = events.index(("harness", reward("s0-e2")))
    events[at] = ("harness", EvaluationFailed(execution_id="s0-e2", error="crash"))
    report = audit(write(tmp_path, events))
    assert report.ok, report.problems
    assert (report.rewards, report.evaluation_failures) == (5, 1)


def test_a_reward_for_an_execution_never_queued_and_a_stray_attempt_are_named(tmp_path):
    events = clean_run()
    events.insert(3, ("harness", reward("ghost")))
    events.insert(4, ("proxy", call("s0-e0", attempt=3)))
    report = audit(write(tmp_path, events))
    assert report.rewards_unqueued == 1
    assert any("execution ghost" in p and "precedes any execution_queued" in p for p in report.problems)
    assert any("execution s0-e0 has model calls of attempt 3" in p for p in report.problems)


def test_steps_versions_and_the_finish_are_held_to(tmp_path):
    events = [item for item in clean_run() if item[1] != WeightsPublished(policy_version=1)
              and item[1].kind != "run_finished"]
    report = audit(write(tmp_path, events), expected_steps=3)
    assert any("published versions [2]" in p for p in report.problems)
    assert any("2 steps trained, the run asks for 3" in p for p in report.problems)
    assert any("run: finished as never" in p for p in report.problems)


def test_redone_micro_steps_switches_and_lost_cells_are_counted_not_judged(tmp_path):
    events = clean_run()
    at = events.index(("trainer", MicroStepClaimed(step=1, cell_id="cell1", micro_step=1)))
    events[at + 1:at + 1] = [
        ("controller", CellLost(cell_id="cell1", reason="silent")),
        ("trainer", MicroStepReleased(step=1, cell_id="cell1", micro_step=1, reason="cell lost")),
        ("controller", CellRegistered(cell_id="cell1", role="training", slots=2)),
        ("controller", RoleSwitchCompleted(cell_id="cell1", from_role="rollout", to_role="training", duration_s=1)),
        ("trainer", MicroStepClaimed(step=1, cell_id="cell1", micro_step=1))]
    report = audit(write(tmp_path, events))
    assert report.ok, report.problems
    assert (report.micro_steps_redone, report.micro_steps_released, report.cells_lost, report.cells_reregistered,
            report.role_switches) == (1, 1, 1, 1, 1)


def test_spilled_events_the_log_lacks_are_events_lost(tmp_path):
    from gyre.cluster.spill import Spill

    log = write(tmp_path, clean_run())
    spill = Spill(tmp_path / "spill" / "proxy")
    handed = reward("s0-e0").model_copy(update={"producer": "harness", "producer_seq": 0})  # the log has it
    stranded = [reward("s9-e0").model_copy(update={"producer": "harness", "producer_seq": 900 + i}) for i in range(3)]
    spill.append([(1, [handed]), (2, stranded)])
    spill.close()
    report = audit(log)
    assert report.spill_files == 1 and report.spill_events == 4
    assert report.events_lost == 3
    assert any("3 events in 1 spill segment" in p for p in report.problems)


def test_a_spill_whose_events_all_reached_the_log_loses_nothing(tmp_path):
    from gyre.cluster.spill import Spill

    log = write(tmp_path, clean_run())
    spill = Spill(tmp_path / "spill" / "cell0")
    spill.append([(1, [reward("s0-e0").model_copy(update={"producer": "harness", "producer_seq": 0})])])
    spill.close()
    report = audit(log)
    assert report.spill_files == 1 and report.events_lost == 0, report.problems


def test_the_cli_prints_json_and_fails_on_problems(tmp_path):
    runner = CliRunner()
    clean = write(tmp_path / "a", clean_run())
    result = runner.invoke(app, ["log", "audit", str(clean), "--json", "--steps", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ok"] is True
    broken = write(tmp_path / "b", [item for item in clean_run() if item != ("harness", reward("s1-e2"))])
    result = runner.invoke(app, ["log", "audit", str(broken)])
    assert result.exit_code == 1
    assert "s1-e2" in result.output


def test_a_call_on_weights_older_than_its_queued_version_is_stale(tmp_path):
    events = clean_run()
    at = events.index(("proxy", call("s1-e1")))
    events[at] = ("proxy", call("s1-e1", served=0))  # a cell that stayed in rollout across the publish of v1
    report = audit(write(tmp_path, events), expected_steps=2)
    assert report.calls_stale == 1 and report.calls_versioned == 6
    assert any("s1-e1" in p and "v0, older than the v1" in p for p in report.problems), report.problems


def test_a_call_whose_engine_reported_no_version_is_named_unless_versions_are_not_required(tmp_path):
    events = clean_run()
    at = events.index(("proxy", call("s0-e2")))
    events[at] = ("proxy", call("s0-e2").model_copy(update={"engine_version": None}))
    log = write(tmp_path, events)
    report = audit(log, expected_steps=2)
    assert report.calls_unversioned == 1
    assert any("s0-e2" in p and "does not report" in p for p in report.problems), report.problems
    assert audit(log, expected_steps=2, require_versions=False).ok


def test_a_trained_call_lagging_its_step_by_more_than_the_staleness_is_named(tmp_path):
    def run(staleness: int) -> list:
        events = clean_run(3)
        config = json.dumps({"scheduler": {"staleness": staleness}})
        events[0] = ("controller", events[0][1].model_copy(update={"config": config}))
        at = events.index(("controller", queued("s2-e0", 2)))
        events[at] = ("controller", queued("s2-e0", 2).model_copy(update={"policy_version": 1}))
        at = events.index(("proxy", call("s2-e0")))
        events[at] = ("proxy", call("s2-e0", served=1))  # queued with v1, served by v1, trained from v2
        return events

    lagging = audit(write(tmp_path / "s0", run(0)), expected_steps=3)
    assert lagging.calls_overlagged == 1 and lagging.max_version_lag == 1 and lagging.calls_stale == 0
    assert any("s2-e0" in p and "1 versions behind" in p for p in lagging.problems), lagging.problems
    allowed = audit(write(tmp_path / "s1", run(1)), expected_steps=3)
    assert allowed.ok, allowed.problems
    assert allowed.max_version_lag == 1


def test_a_call_aborted_before_any_token_needs_no_served_version(tmp_path):
    events = clean_run()
    at = events.index(("proxy", call("s1-e0")))
    aborted = ModelCallFinished(execution_id="s1-e0", call_id="s1-e0-aborted", cell_id="cell1", policy_version=1,
                                finish_reason="abort")  # its harness was killed while the call waited
    events.insert(at, ("proxy", aborted))
    report = audit(write(tmp_path, events), expected_steps=2)
    assert report.ok, report.problems
    assert (report.calls_unserved, report.calls_unversioned, report.calls_versioned) == (1, 0, 6)


def test_partial_rollouts_a_carried_group_lags_by_the_step_that_trained_it_one_more_allowed(tmp_path):
    """Group g0b of batch 0 runs past step 0 and is trained by step 1 (the fold's assignment): its v0 call is
    one version behind step 1's weights — allowed with partial rollouts at staleness 0, as the simulator
    counts it; without partial rollouts the same lag is over the staleness."""
    def run(partial: bool) -> list[tuple[str, Event]]:
        params = json.dumps({"partial_rollouts": partial})
        out: list[tuple[str, Event]] = [
            ("controller", RunStarted(run_id=RUN, name="t", policy="async", policy_version="1",
                                      policy_params=params)),
            ("controller", CellRegistered(cell_id="cell0", role="training", slots=2, is_core=True)),
            ("controller", CellRegistered(cell_id="cell1", role="rollout", slots=2))]
        queue = [("s0-a", "g0a", 0, 0), ("s0-b", "g0b", 0, 0), ("s0-c", "g0c", 0, 0)]
        out += [("controller", ExecutionQueued(execution_id=e, task_id="hello", group_id=g, step=s, policy_version=v))
                for e, g, s, v in queue]
        for e in ("s0-a", "s0-c"):
            out += [("proxy", call(e)), ("harness", finished(e)), ("harness", reward(e))]
        out += [("trainer", TrainStepStarted(step=0, policy_version=0, planned_micro_steps=2, groups=2)),
                ("trainer", TrainStepFinished(step=0, policy_version=1, micro_steps=2)),
                ("trainer", WeightsPublished(policy_version=1)),
                ("controller", ExecutionQueued(execution_id="s1-a", task_id="hello", group_id="g1a", step=1,
                                               policy_version=1))]
        for e in ("s0-b", "s1-a"):  # the carried one finishes under step 1
            out += [("proxy", call(e)), ("harness", finished(e)), ("harness", reward(e))]
        out += [("trainer", TrainStepStarted(step=1, policy_version=1, planned_micro_steps=2, groups=2)),
                ("trainer", TrainStepFinished(step=1, policy_version=2, micro_steps=2)),
                ("trainer", WeightsPublished(policy_version=2)),
                ("controller", RunFinished(run_id=RUN, status="completed"))]
        return out

    carried = audit(write(tmp_path / "partial", run(True)), expected_steps=2)
    assert carried.max_version_lag == 1 and carried.calls_overlagged == 0
    assert not [p for p in carried.problems if p.startswith("versions")], carried.problems
    without = audit(write(tmp_path / "whole", run(False)), expected_steps=2)
    # without partial rollouts s0-b counts against its own batch's step 0 (lag 0) — no carried step exists
    assert without.max_version_lag == 0
