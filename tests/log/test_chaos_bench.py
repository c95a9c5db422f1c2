"""The chaos benchmark's pure parts: the seeded kill schedule, process discovery from /proc and pid files, the
run config, and the per-kill figures (the chaos run itself is `python -m benchmarks.chaos_bench`)."""

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from benchmarks import chaos_bench as cb
from gyre.cluster.procs import ProcStat, cmdline, proc_stat, running
from gyre.events.models import RewardRecorded, TrainStepAborted, TrainStepFinished, TrainStepStarted
from gyre.log import LogWriter

ALL = {"controller": ["controller"], "proxy": ["proxy"], "cell": ["cell0", "cell1", "cell2", "cell3"],
       "harness": ["harness:11", "harness:12"]}


def draws(seed: int, n: int = 40, candidates=ALL, weights=None) -> list:
    schedule = cb.KillSchedule(seed, weights)
    return [(schedule.wait(), schedule.victim(candidates)) for _ in range(n)]


def test_the_schedule_is_seeded_and_paced():
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    for (seconds, events), _ in draws(3):
        assert 1.0 <= seconds <= 6.0 and 1 <= events <= 20
    timed = cb.KillSchedule(3, pace=cb.Pace(10.0, 30.0, 0, 0))  # --max-events 0: time alone paces the kills
    assert all(10.0 <= s <= 30.0 and e == 0 for s, e in (timed.wait() for _ in range(20)))


def test_every_class_is_drawn_by_its_weight_and_only_among_live_ones():
    victims = [v for _, v in draws(5, n=600)]
    counts = {c: sum(v[0] == c for v in victims) for c in cb.VICTIM_CLASSES}
    assert counts["cell"] > counts["controller"] * 1.4 and counts["harness"] > counts["proxy"] * 1.4
    assert all(name in ALL[c] for c, name in victims)
    only_cells = {"controller": [], "proxy": [], "cell": ["cell2"], "harness": []}
    assert {v for _, v in draws(5, n=20, candidates=only_cells)} == {("cell", "cell2")}
    assert cb.KillSchedule(1).victim({c: [] for c in cb.VICTIM_CLASSES}) is None
    no_controller = cb.parse_weights("proxy=1,cell=1,harness=1")
    assert all(v[0] != "controller" for _, v in draws(5, n=200, weights=no_controller))


def test_bursts_are_seeded_name_their_victims_and_kill_the_controller_last():
    live = {"controller": ["controller"], "proxy": ["proxy"], "cell": ["cell0", "cell1", "cell2"],
            "harness": ["harness:9"]}
    first, second = cb.KillSchedule(3, burst_share=1.0), cb.KillSchedule(3, burst_share=1.0)
    assert [first.burst(live) for _ in range(5)] == [second.burst(live) for _ in range(5)]  # seeded
    schedule = cb.KillSchedule(5, burst_share=1.0)
    seen = {}
    for _ in range(60):
        kind, victims = schedule.burst(live)
        seen[kind] = victims
    assert seen == {"cells": [("cell", "cell0"), ("cell", "cell1"), ("cell", "cell2")],
                    "core+controller": [("cell", "cell0"), ("controller", "controller")],
                    "proxy+core": [("proxy", "proxy"), ("cell", "cell0")]}
    assert cb.KillSchedule(5).burst(live) is None  # bursts are off unless asked for
    assert cb.KillSchedule(5, burst_share=1.0).burst({"cell": ["cell1"]}) in (
        ("cells", [("cell", "cell1")]), None)  # only what lives is killed
    with pytest.raises(ValueError, match="burst_share 2"):
        cb.KillSchedule(1, burst_share=2)


def test_weights_are_parsed_and_checked():
    assert cb.parse_weights("controller=2, cell=1") == {"controller": 2.0, "proxy": 0.0, "cell": 1.0, "harness": 0.0}
    with pytest.raises(ValueError, match="unknown victim class 'engine'"):
        cb.parse_weights("engine=1")
    with pytest.raises(ValueError, match="weight 0"):
        cb.KillSchedule(1, cb.parse_weights("cell=0"))


def fake_proc(root: Path, table: list[tuple[int, str, str, int, int, int]]) -> Path:
    """/proc/<pid>/stat files: (pid, comm, state, ppid, pgid, sid)."""
    for pid, comm, state, ppid, pgid, sid in table:
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {pgid} {sid} 0 -1 4194560 0 0\n")
    (root / "self").mkdir()
    return root


def test_process_discovery_from_pid_files_and_a_proc_tree(tmp_path):
    proc = fake_proc(tmp_path / "proc", [
        (100, "gyre run", "S", 1, 100, 100),
        (200, "python (cell)", "S", 100, 100, 100), (201, "python", "S", 100, 100, 100),
        (300, "gyre proxy", "S", 100, 100, 100),
        (400, "sh", "S", 300, 400, 400), (401, "python agent", "R", 400, 400, 400),  # a harness and its child
        (410, "sh", "S", 300, 410, 410),
        (420, "helper", "S", 300, 100, 100),  # not a harness: stays in the proxy's session
        (430, "sh", "Z", 300, 430, 430),  # a zombie
    ])
    run_dir = tmp_path / "run"
    (run_dir / "processes").mkdir(parents=True)
    for name, pid in {"controller": 100, "cell0": 200, "cell1": 201, "cell2": 999, "proxy": 300}.items():
        (run_dir / "processes" / f"{name}.pid").write_text(f"{pid}\n")
    (run_dir / "processes" / "cell3.pid").write_text("")  # being rewritten
    assert cb.pid_files(run_dir) == {"controller": 100, "cell0": 200, "cell1": 201, "cell2": 999, "proxy": 300}
    stats = cb.all_stats(proc)
    assert proc_stat(401, proc) == ProcStat(401, "R", 400, 400, 400)
    assert proc_stat(999, proc) is None and cmdline(999, proc) == []
    assert [s.pid for s in cb.descendants(300, stats)] == [400, 410, 420, 401]
    assert cb.harnesses(300, stats) == [400, 410]
    found = cb.candidates(run_dir, 100, proc)
    assert found == {"controller": ["controller"], "proxy": ["proxy"], "cell": ["cell0", "cell1"],
                     "harness": ["harness:400", "harness:410"]}
    assert cb.resolve("harness:410", run_dir, 100) == 410 and cb.resolve("cell1", run_dir, 100) == 201
    assert not running(430, proc) and not running(999, proc) and running(401, proc)  # 430 is a zombie


def test_without_pid_files_the_controllers_children_are_found_by_argv(tmp_path):
    proc = fake_proc(tmp_path / "proc", [(100, "gyre", "S", 1, 100, 100), (200, "python", "S", 100, 100, 100),
                                         (300, "python", "S", 100, 100, 100), (400, "sh", "S", 300, 400, 400)])
    (proc / "200" / "cmdline").write_bytes(b"python\0-m\0gyre\0cell\0--controller\0x:1\0--cell-id\0cell2\0")
    (proc / "300" / "cmdline").write_bytes(b"python\0-m\0gyre\0proxy\0serve\0--controller\0x:1\0")
    (proc / "400" / "cmdline").write_bytes(b"sh\0-c\0agent\0")
    assert cb.children_by_argv(100, cb.all_stats(proc), proc) == {"cell2": 200, "proxy": 300}
    assert cb.candidates(tmp_path / "run", 100, proc) == {
        "controller": ["controller"], "proxy": ["proxy"], "cell": ["cell2"], "harness": ["harness:400"]}


def test_a_real_harness_group_is_found_under_its_parent_and_killed_whole(tmp_path):
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen(['sh', '-c', 'sleep 60 & sleep 60'], start_new_session=True)\n"
              "print(p.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        leader = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            below = cb.descendants(parent.pid, cb.all_stats())
            if len(below) >= 3:  # sh and its two sleeps
                break
            time.sleep(0.05)
        assert cb.harnesses(parent.pid, cb.all_stats()) == [leader]
        group = [s.pid for s in cb.descendants(parent.pid, cb.all_stats())]
        assert cb.kill(f"harness:{leader}", leader)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(running(p) for p in group if p != leader):
            time.sleep(0.05)
        assert not any(running(p) for p in group if p != leader)  # the whole group, not just its leader
        assert running(parent.pid)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    assert not cb.kill("cell0", parent.pid)  # gone already


def test_the_run_config_is_the_example_with_absolute_paths(tmp_path):
    data = cb.run_config(tmp_path / "run", steps=12, seed=3)
    assert (data["steps"], data["seed"], data["run_dir"]) == (12, 3, str(tmp_path / "run"))
    assert Path(data["rollout"]["tasks"]).is_absolute() and Path(data["rollout"]["tasks"]).exists()
    assert Path(data["rollout"]["harness"]).exists()
    assert data["cluster"]["cells"] == 4 and data["cluster"]["dead_after_s"] == 5.0
    path = cb.write_config(tmp_path / "run", data)
    from gyre.cluster.config import ClusterConfig

    assert ClusterConfig.load(path).steps == 12


def test_time_lost_per_kill_is_kill_to_the_next_progress_event(tmp_path):
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    with LogWriter(tmp_path / "log", run_id="r") as writer:
        writer.append([RewardRecorded(execution_id="a", reward=1, ts=t0),
                       RewardRecorded(execution_id="b", reward=1, ts=t0 + timedelta(seconds=2)),
                       TrainStepFinished(step=0, policy_version=1, micro_steps=1, ts=t0 + timedelta(seconds=7))])
        writer.commit()
    kills = [cb.KillRecord(1, 0.0, (t0 + timedelta(seconds=3)).isoformat(), "cell", "cell1", 1, 1),
             cb.KillRecord(2, 0.0, (t0 + timedelta(seconds=9)).isoformat(), "proxy", "proxy", 2, 2)]
    gap = cb.recovery_times(tmp_path / "log", kills)
    assert gap == 3.5 and kills[0].recovery_s == 4.0 and kills[1].recovery_s is None
    out = cb.summary(cb.ChaosResult(kills=kills, finished=True), None, {"mismatches": 0}, gap)
    assert out["kills_by_victim"] == {"controller": 0, "proxy": 1, "cell": 1, "harness": 0}
    assert out["time_lost_per_kill_s"] == {"median": 4.0, "max": 4.0, "unrecovered": 1}
    assert out["passed"] and out["replay_mismatches"] == 0


def test_seeds_are_parsed_in_order():
    assert cb.parse_seeds("1-3") == [1, 2, 3]
    assert cb.parse_seeds("5, 2-3,9") == [5, 2, 3, 9]
    with pytest.raises(ValueError, match="empty"):
        cb.parse_seeds("4-2")
    with pytest.raises(ValueError, match="not a seed"):
        cb.parse_seeds("a-b")


def test_the_seeds_add_up():
    def run(seed, passed, kills, recovery):
        return {"seed": seed, "finished": True, "passed": passed, "kills": len(kills), "wall_s": 10.0,
                "kills_by_victim": {c: kills.count(c) for c in cb.VICTIM_CLASSES}, "events_lost": 0,
                "rewards_doubled": 1 - passed, "replay_mismatches": 0, "commands_abandoned": 2,
                "kill_log": [{"recovery_s": r} for r in recovery]}

    total = cb.totals([run(3, True, ["cell", "proxy"], [1.0, None]), run(4, False, ["cell"], [3.0])])
    assert total["runs"] == 2 and total["runs_completed"] == 2 and total["runs_passed"] == 1
    assert total["failed_seeds"] == [4] and total["kills"] == 3 and total["rewards_doubled"] == 1
    assert total["kills_by_victim"] == {"controller": 0, "proxy": 1, "cell": 2, "harness": 0}
    assert total["time_lost_per_kill_s"] == {"median": 2.0, "max": 3.0, "unrecovered": 1}
    assert total["commands_abandoned"] == 4 and total["wall_s"] == 20.0


def test_a_kill_is_inside_the_train_step_the_log_shows_open(tmp_path):
    t0 = datetime(2025, 1, 1, tzinfo=UTC)

    def at(s: float) -> datetime:
        return t0 + timedelta(seconds=s)

    with LogWriter(tmp_path / "log", run_id="r") as writer:
        writer.append([TrainStepStarted(step=0, policy_version=0, planned_micro_steps=2, ts=at(1)),
                       TrainStepFinished(step=0, policy_version=1, micro_steps=2, ts=at(5)),
                       TrainStepStarted(step=1, policy_version=1, planned_micro_steps=2, ts=at(6)),
                       TrainStepAborted(step=1, ts=at(8)),
                       TrainStepStarted(step=1, policy_version=1, planned_micro_steps=2, ts=at(10))])
        writer.commit()
    kills = [cb.KillRecord(n, 0.0, at(s).isoformat(), "cell", "cell0", n, n) for n, s in
             enumerate([0.5, 3, 5.5, 7, 9, 11])]
    cb.kills_in_train_steps(tmp_path / "log", kills)
    assert [k.in_train_step for k in kills] == [None, 0, None, 1, None, 1]
    out = cb.summary(cb.ChaosResult(kills=kills, finished=True), None, None, None)
    assert out["kills_in_train_steps"] == 3 and out["kills_in_train_steps_by_victim"]["cell"] == 3
