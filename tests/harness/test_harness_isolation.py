"""Isolation of what the runner starts: evaluators that die or hang, and harness children that escape.

The harnesses here run unsandboxed (`sandbox = "none"`): they test the process-group and subreaper machinery
that stands alone there, with pid files on the host; tests/security holds the sandboxed counterparts.

Every wait here is on an event (a pid file, a process leaving /proc), never on a guess at how long
something takes.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from gyre.events.models import EvaluationFailed, RewardRecorded
from gyre.harness import HarnessRunner, PythonEvaluator
from gyre.harness.process import TAG_VAR, GroupProcess, become_subreaper
from gyre.sink import MemorySink
from tests.harness.harness_helpers import (
    ESCAPE,
    allocates_forever,
    execution,
    exits_hard,
    loops_forever,
    make_task,
    process_gone,
    shell,
    wait_for,
)

URL = "http://127.0.0.1:9"


def escaping_harness(pid_file: Path, then: str) -> str:
    """A shell harness that double-forks a grandchild into its own session, waits for its pid file, then `then`."""
    script = Path(str(pid_file) + ".py")
    script.write_text(ESCAPE.format(pid_file=str(pid_file)))
    return f"{sys.executable} {script}; while [ ! -e {pid_file} ]; do sleep 0.01; done; {then}"


def marked(variable: str) -> list[int]:
    """Live processes (not zombies) whose environment holds `variable` (`NAME=value`)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if variable.encode() in environ.split(b"\0") and not process_gone(int(name)):
            found.append(int(name))
    return found


def test_a_timeout_kills_a_grandchild_that_left_the_session(tmp_path: Path) -> None:
    assert become_subreaper()
    pid_file = tmp_path / "escaped.pid"
    process = GroupProcess(["/bin/sh", "-c", escaping_harness(pid_file, "sleep 300")], cwd=tmp_path, env={},
                           stdout=tmp_path / "out", stderr=tmp_path / "err")
    wait_for(pid_file.exists, timeout_s=60, what="the grandchild's pid file")
    escaped = int(pid_file.read_text())
    assert os.getsid(escaped) == escaped != os.getsid(process.pid)  # out of reach of the group kill
    ended = process.wait(0, grace_s=0.1)  # the limit has passed: as at a timeout
    assert ended.timed_out
    assert not Path(f"/proc/{escaped}").exists()  # killed, and reaped by this subreaper: not even a zombie
    assert marked(f"{TAG_VAR}={process.tag}") == []


def test_after_a_harness_timeout_no_process_of_the_execution_is_left(tmp_path: Path) -> None:
    """Whenever the timeout falls (before or after the grandchild escaped), nothing of the execution runs on."""
    pid_file = tmp_path / "escaped.pid"
    with HarnessRunner(shell(escaping_harness(pid_file, "sleep 300"), timeout_s=1.0, sandbox="none"), sink=MemorySink(),
                       proxy_url=URL, root=tmp_path / "runs") as r:
        result = r.run(execution(make_task()))
    assert result.status == "timed_out"
    assert marked(f"GYRE_EXECUTION_ID={result.execution_id}") == []
    if pid_file.exists():  # it escaped before the timeout (the usual case): then it is gone, not even a zombie
        assert not Path(f"/proc/{int(pid_file.read_text())}").exists()


def test_the_runner_reaps_escaped_children_after_an_exit_and_a_cancel(tmp_path: Path) -> None:
    sink = MemorySink()
    done, hung = tmp_path / "done.pid", tmp_path / "hung.pid"
    with HarnessRunner(shell(escaping_harness(done, "printf hello > answer.txt"), sandbox="none"), sink=sink,
                       proxy_url=URL, root=tmp_path / "a") as r:
        assert r.subreaper
        result = r.run(execution(make_task()))
    assert result.status == "completed" and result.reward == 1.0
    assert not Path(f"/proc/{int(done.read_text())}").exists()

    r = HarnessRunner(shell(escaping_harness(hung, "sleep 300"), sandbox="none"), sink=sink, proxy_url=URL,
                      root=tmp_path / "b")
    running = r.submit(execution(make_task(), 1))
    wait_for(hung.exists, timeout_s=60, what="the grandchild's pid file")
    closer = threading.Thread(target=r.close, kwargs={"kill_running": True})
    closer.start()
    assert running.result().status == "harness_error"
    closer.join()
    assert not Path(f"/proc/{int(hung.read_text())}").exists()


def test_evaluators_that_exhaust_memory_hang_or_exit_fail_and_the_runner_carries_on(tmp_path: Path) -> None:
    sink = MemorySink()
    broken = [PythonEvaluator(allocates_forever, name="hog", memory_mb=512),
              PythonEvaluator(loops_forever, name="hang", timeout_s=0.5),
              PythonEvaluator(exits_hard, name="quit")]
    with HarnessRunner(shell("printf hello > answer.txt", max_concurrency=2), sink=sink, proxy_url=URL,
                       root=tmp_path) as r:
        results = r.run_group([execution(make_task(evaluator=e), n) for n, e in enumerate(broken)])
        assert all(result.status == "completed" and result.reward is None for result in results)
        assert r.run(execution(make_task(), 9)).reward == 1.0  # the runner still works
    failures = {f.evaluator: f for f in sink.of(EvaluationFailed)}
    assert {name: f.error for name, f in failures.items()} == {"hog": "crash", "hang": "timeout", "quit": "crash"}
    assert "out of memory" in failures["hog"].message and "code 7" in failures["quit"].message
    assert [e.reward for e in sink.of(RewardRecorded)] == [1.0]
