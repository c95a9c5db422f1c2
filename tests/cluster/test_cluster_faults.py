"""Kill anything, lose nothing: one 3-cell run in which every kind of process is SIGKILLed at a chosen moment.

The controller runs as its own process (`gyre run CONFIG`), like a user's, so it can be killed and resumed
(`gyre run CONFIG --resume`). Each kill from outside waits for an event that says the run is at the moment
it targets (no sleeps to race): a rollout cell with executions on it, the proxy with calls in flight, the
controller mid-rollout, and a harness. Moments too short to hit from outside die by fault injection
(`gyre.cluster.faults`): the core in the middle of step 1 (its 6th micro-step) and each satellite at its first
claim (the core lets the satellites joined at a step's start claim first, or it would train four tiny micro-steps
before their claims arrive). Steps are not streamed (`stream_micro_steps = false`), so that a satellite is joined
when step 0 starts: the core starts a step only once its whole batch is done, when the watermark is 0 and the
policy lends every rollout cell alive, and only once no cell is still on its way to training. Streamed, step 0
could start on its first group while the other still ran, with the core alone; the satellites then joined
mid-step and whether one claimed before the core depended on timing (a failure seen at load ~4). Each test
then checks one crash's recovery in the log; the first checks the whole run with the audit
(`gyre.audit`: every producer's events gapless and once, every reward once on its execution's last
attempt) and replay. A failed test keeps the run's directory (`tests.cluster.kept`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.chaos_bench import candidates, kill, resolve
from gyre.audit import audit
from gyre.cluster.faults import CRASH_ENV
from gyre.log import LogReader
from gyre.replay.exact import replay_decisions
from tests.cluster.kept import KEEP_ON_FAILURE
from tests.cluster.test_cluster_run import cluster_config

pytestmark = pytest.mark.integration

STEPS = 4
CRASHES = "cell0:micro_step_finished@6,cell0:yield,cell1:claim,cell2:claim"
WAIT_S = 240.0
"""Longest wait for the event a kill waits on (a loaded 2-core CI machine starts a torch process in ~20 s)."""


@dataclass
class Kill:
    victim: str
    after_kind: str
    at_seq: int = -1
    """The seq of the event the kill came after."""
    cell: str | None = None


@dataclass
class FaultRun:
    run_dir: Path
    log: Path
    kills: dict[str, Kill] = field(default_factory=dict)
    controller_output: str = ""


def _events_after(log: Path, seq: int, kinds: list[str]) -> list:
    try:
        return [e for e in LogReader(log).events(kinds=kinds) if e.seq is not None and e.seq > seq]
    except Exception:  # the log is being created
        return []


class Driver:
    def __init__(self, run_dir: Path, config_file: Path) -> None:
        self.run_dir, self.config_file, self.log = run_dir, config_file, run_dir / "log"
        self.output = run_dir.parent / "controller.out"
        self.controller: subprocess.Popen | None = None
        self.seq = -1

    def start(self, resume: bool = False) -> None:
        argv = [sys.executable, "-m", "gyre", "run", str(self.config_file), *(["--resume"] if resume else [])]
        env = {**os.environ, CRASH_ENV: CRASHES}
        with open(self.output, "ab") as out:
            self.controller = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env)

    def wait_event(self, kind: str, where=lambda e: True):
        """The next event of ``kind`` after the last kill (polled from the log, which is the run's truth)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.controller is not None and self.controller.poll() is None, \
                f"the controller exited ({self.controller.returncode}) waiting for {kind}: {self.tail()}"
            found = [e for e in _events_after(self.log, self.seq, [kind]) if where(e)]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no {kind} within {WAIT_S} s: {self.tail()}")

    def kill(self, name: str, after) -> Kill:
        assert self.controller is not None
        pid = resolve(name, self.run_dir, self.controller.pid)
        assert pid is not None, f"no pid for {name}"
        assert kill(name, pid), f"{name} (pid {pid}) was gone before its kill"
        self.seq = LogReader(self.log).last_seq()
        if name == "controller":
            self.controller.wait()
            self.start(resume=True)
        return Kill(name, after.kind, after.seq, getattr(after, "cell_id", None))

    def finish(self) -> None:
        assert self.controller is not None
        try:
            code = self.controller.wait(WAIT_S * 2)
        except subprocess.TimeoutExpired:
            self.controller.kill()
            raise AssertionError(f"the run did not finish: {self.tail()}") from None
        assert code == 0, f"gyre run exited {code}: {self.tail()}"

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-3000:] if self.output.exists() else ""

    def cleanup(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.controller.kill()
        for name in [*candidates(self.run_dir, None).get("cell", []), "proxy"]:
            pid = resolve(name, self.run_dir, None)
            if pid is not None:
                kill(name, pid)


@pytest.fixture(scope="module")
def faults(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FaultRun:
    root = tmp_path_factory.mktemp("faults")
    request.node.stash[KEEP_ON_FAILURE] = root
    run_dir = root / "run"
    data = json.loads(cluster_config(run_dir, steps=STEPS).model_dump_json())
    data["cluster"].update(dead_after_s=5.0, lease_s=3.0)
    data["scheduler"]["params"].update(stream_micro_steps=False)  # step 0 starts with its satellites joined
    config_file = root / "config.json"
    config_file.write_text(json.dumps(data))
    driver = Driver(run_dir, config_file)
    run = FaultRun(run_dir, run_dir / "log")
    driver.start()
    try:
        started = driver.wait_event("execution_started", lambda e: e.cell_id not in (None, "cell0"))
        run.kills["rollout"] = driver.kill(started.cell_id, started)
        call = driver.wait_event("model_call_started")
        run.kills["proxy"] = driver.kill("proxy", call)
        reward = driver.wait_event("reward_recorded")
        run.kills["controller"] = driver.kill("controller", reward)
        call = driver.wait_event("model_call_started")
        harness = next(iter(candidates(run_dir, driver.controller.pid)["harness"]), None)
        if harness is not None:  # the call may have finished its execution already
            run.kills["harness"] = driver.kill(harness, call)
        driver.finish()
    finally:
        driver.cleanup()
        run.controller_output = driver.tail()
    return run


def _events(log: Path, *kinds: str) -> list:
    return list(LogReader(log).events(kinds=list(kinds)))


def test_nothing_is_lost_or_recorded_twice(faults: FaultRun) -> None:
    report = audit(faults.log, expected_steps=STEPS)
    assert report.ok, report.problems
    assert report.events_lost == 0 and report.events_doubled == 0
    assert report.rewards_lost == 0 and report.rewards_doubled == 0
    result = replay_decisions(faults.log)
    assert result.mismatches == [], result.mismatches


def test_a_killed_rollout_cell_is_replaced_and_its_executions_continue(faults: FaultRun) -> None:
    kill = faults.kills["rollout"]
    lost = [e for e in _events(faults.log, "cell_lost") if e.cell_id == kill.victim and e.seq > kill.at_seq]
    assert lost, f"no cell_lost for {kill.victim}"
    again = [e for e in _events(faults.log, "cell_registered") if e.cell_id == kill.victim and e.seq > lost[0].seq]
    assert again, f"{kill.victim} was not registered again after its crash"
    # its executions were not given up: each one started on it before the kill has an outcome
    on_it = {e.execution_id for e in _events(faults.log, "execution_started")
             if e.cell_id == kill.victim and e.seq <= kill.at_seq}
    scored = {e.execution_id for e in _events(faults.log, "reward_recorded", "evaluation_failed")}
    assert on_it and on_it <= scored


def _crashed(faults: FaultRun, cell: str, kind: str) -> list:
    """The cell_lost events of ``cell`` whose process died by fault injection at ``kind``."""
    marker = [p.name for p in (faults.run_dir / "processes").glob(f"{cell}.crashed-*")]
    assert any(kind in m for m in marker), f"{cell} never crashed at {kind} (markers: {marker})"
    return [e for e in _events(faults.log, "cell_lost") if e.cell_id == cell]


def test_a_killed_satellite_loses_its_lease_and_the_step_completes(faults: FaultRun) -> None:
    claims = [e for e in _events(faults.log, "micro_step_claimed") if e.cell_id in ("cell1", "cell2")]
    assert claims, "no satellite ever claimed a micro-step"
    satellite = claims[0].cell_id
    assert _crashed(faults, satellite, "claim")
    released = [e for e in _events(faults.log, "micro_step_released") if e.cell_id == satellite]
    assert released, f"the micro-step satellite {satellite} died holding was never released"
    steps = {e.step for e in _events(faults.log, "train_step_finished")}
    assert claims[0].step in steps, f"step {claims[0].step} never finished after its satellite died"


def test_a_killed_core_restarts_from_its_checkpoint_and_the_step_is_trained_again(faults: FaultRun) -> None:
    lost = _crashed(faults, "cell0", "micro_step_finished")
    assert lost, "the core's crash was never noticed"
    # the step it died in: the one of the 6th micro-step its trainer recorded (the crash point)
    crashed_in = [e for e in _events(faults.log, "micro_step_finished")][5].step
    # the abort may be recorded by the restarted core before or after a resumed controller notices the loss
    aborted = [e for e in _events(faults.log, "train_step_aborted") if e.step == crashed_in]
    assert aborted, f"step {crashed_in}, which the core died in, was not aborted"
    finished = [e for e in _events(faults.log, "train_step_finished") if e.step == crashed_in]
    assert finished and finished[0].seq > aborted[0].seq, f"step {crashed_in} was not trained again"
    again = [e for e in _events(faults.log, "cell_registered") if e.cell_id == "cell0" and e.seq > lost[0].seq]
    assert again, "the core was not registered again"
    assert [e.policy_version for e in _events(faults.log, "weights_published")] == list(range(1, STEPS + 1))


def test_a_killed_proxy_is_restarted_and_its_executions_run_again(faults: FaultRun) -> None:
    kill = faults.kills["proxy"]
    again = [e for e in _events(faults.log, "execution_queued") if e.seq > kill.at_seq and e.attempt > 0]
    assert again, "no execution was submitted again after the proxy (and its harnesses) died"
    outcomes: dict[str, int] = {}
    for e in _events(faults.log, "reward_recorded"):
        outcomes[e.execution_id] = outcomes.get(e.execution_id, 0) + 1
    assert all(outcomes.get(e.execution_id) == 1 for e in again), "a resubmitted execution was not scored once"


def test_a_killed_controller_resumes_with_its_processes(faults: FaultRun) -> None:
    resumed = _events(faults.log, "run_resumed")
    assert resumed, "the resumed controller recorded no run_resumed"
    assert set(resumed[0].adopted.split(",")) >= {"proxy"}, resumed[0]
    finished = _events(faults.log, "run_finished")
    assert [e.status for e in finished] == ["completed"]
