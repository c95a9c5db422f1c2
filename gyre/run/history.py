"""What a run directory already holds, read before a run starts or resumes: its `run_started`, the
executions it queued, harnesses a crash orphaned, a config that differs from the recorded one.

The rules a resumed run follows live in one place for both topologies (`gyre.run.host`).
"""

from __future__ import annotations

import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

from gyre.errors import ConfigError
from gyre.events.models import CellLost, CellRegistered, RoleSwitchCompleted, RunStarted


@dataclass
class RoleSpan:
    cell_id: str
    role: str
    start_s: float
    end_s: float | None = None


def run_start(log_path: Path) -> RunStarted | None:
    """The ``run_started`` of the log in ``log_path``, if there is a log."""
    if not log_path.exists() or not any(log_path.glob("*.seg")):
        return None
    from gyre.log import LogReader

    first = next(LogReader(log_path).events(to_seq=0), None)
    if not isinstance(first, RunStarted):
        raise ConfigError(f"{log_path} holds a log that does not begin with run_started; it is not a Gyre run")
    return first


def config_differences(recorded: dict, given: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(recorded) | set(given)):
        a, b = recorded.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: recorded {a!r}, given {b!r}")
    return out


def queued_attempts(log_path: Path, run_id: str) -> dict[str, tuple[int, str, str, int]]:
    """Each execution the log queued -> (its last attempt, task, group, step)."""
    from gyre.log import LogReader

    con = LogReader(log_path).duckdb()
    return {e: (a, t, g, s) for e, a, t, g, s in con.execute(
        "SELECT execution_id, max(attempt), any_value(task_id), any_value(group_id), any_value(step) "
        "FROM executions_queued WHERE run_id = ? GROUP BY execution_id", [run_id]).fetchall()}


def heldout_recorded(log_path: Path) -> set[int]:
    """The steps (done before each) of the held-out evaluations the log recorded."""
    from gyre.log import LogReader

    con = LogReader(log_path).duckdb()
    return {step for (step,) in con.execute("SELECT step FROM heldout_evaluations").fetchall()}


def reap_orphans(executions_dir: Path) -> int:
    """Kill the process groups of harnesses a crash orphaned: every process working inside the run's
    execution directories (their start may never have reached the log, so their pids are not known).
    Returns how many groups were killed. Linux: reads /proc."""
    root = str(executions_dir.resolve()) + os.sep
    groups = set()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (os.readlink(entry / "cwd") + os.sep).startswith(root):
                groups.add(os.getpgid(int(entry.name)))
        except OSError:  # gone, or not ours to look at
            continue
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            continue
    return len(groups)


def set_aside(dirs_root: Path) -> None:
    """Move an execution directory a crash left behind (its attempt never reached the log) out of the way,
    keeping it: nothing already written is deleted."""
    if dirs_root.exists():
        stale = dirs_root.parent / ".stale"
        stale.mkdir(exist_ok=True)
        dirs_root.rename(stale / f"{dirs_root.name}.{uuid.uuid4().hex[:8]}")


def role_timeline(log_path: Path) -> tuple[int, list[RoleSpan]]:
    """Each cell's roles over the run (seconds from run start), folded from the log; and the switch count."""
    from gyre.log import LogReader

    spans: dict[str, RoleSpan] = {}
    timeline: list[RoleSpan] = []
    start = None
    switches = 0
    last = 0.0
    for event in LogReader(log_path).events(kinds=["run_started", "cell_registered", "role_switch_completed",
                                                   "run_finished", "cell_lost"]):
        assert event.ts is not None
        if start is None:
            start = event.ts
        t = (event.ts - start).total_seconds()
        last = t
        if isinstance(event, CellRegistered):
            spans[event.cell_id] = RoleSpan(event.cell_id, event.role, t)
        elif isinstance(event, RoleSwitchCompleted):
            switches += 1
            previous = spans.get(event.cell_id)
            if previous is not None:
                previous.end_s = t
                timeline.append(previous)
            spans[event.cell_id] = RoleSpan(event.cell_id, event.to_role, t)
        elif isinstance(event, CellLost) and event.cell_id in spans:
            spans[event.cell_id].end_s = t
            timeline.append(spans.pop(event.cell_id))
    for span in spans.values():
        span.end_s = last
        timeline.append(span)
    return switches, sorted(timeline, key=lambda s: (s.cell_id, s.start_s))
