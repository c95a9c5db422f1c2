"""Helpers of the harness tests: tasks built in code, shell harnesses, and small waits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.harness import (
    EvaluationContext,
    Evaluator,
    Execution,
    ExecutionResult,
    HarnessConfig,
    HarnessRunner,
    PythonEvaluator,
    Task,
    TaskSet,
    TaskSpec,
)
from gyre.sink import MemorySink
from tests.harness.graders import (  # noqa: F401 - re-exported for the tests
    allocates_forever,
    constant,
    divides_by_zero,
    exits,
    exits_hard,
    loops_forever,
    raises_key_error,
    read_answer,
)

REPO = Path(__file__).resolve().parents[2]
TOY_TASKS = REPO / "tasks" / "toy" / "tasks.toml"
TOY_HARNESS = REPO / "agents" / "toy_agent" / "harness.toml"
TOKEN = "exec-token-0123456789"


def spawns_an_escaping_child(context: EvaluationContext) -> float:
    """Starts a grandchild in a new session, returns once it wrote its pid to `escaped.pid`."""
    pid_file = context.scratch_dir / "escaped.pid"
    subprocess.Popen([sys.executable, "-c", ESCAPE.format(pid_file=str(pid_file))], start_new_session=True).wait()
    wait_for(pid_file.exists, timeout_s=60, what="the escaping grandchild's pid file")
    return 1.0


ESCAPE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    with open({pid_file!r} + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename({pid_file!r} + ".tmp", {pid_file!r})
    while True:
        time.sleep(1)
"""
"""A double fork: the child leaves the session and outlives its parent, which exits at once."""


def make_task(task_id: str = "t", *, evaluator: Evaluator | None = None, tmp: Path | None = None,
              **spec: Any) -> Task:
    fields: dict[str, Any] = {"id": task_id, "prompt": "Write the word hello into answer.txt."} | spec
    return Task(TaskSpec(**fields), tmp or REPO, evaluator or PythonEvaluator(read_answer, name="read-answer"))


def shell(script: str, **config: Any) -> HarnessConfig:
    """A harness that is a shell script (run with `sh -c`)."""
    settings: dict[str, Any] = {"name": "sh", "command": ["/bin/sh", "-c", script], "kill_grace_s": 0.2} | config
    return HarnessConfig(**settings)


def execution(task: Task, n: int = 0, *, group: str = "g0", **kw: Any) -> Execution:
    return Execution(f"{group}-{task.id}-{n}", task, group, token=kw.pop("token", TOKEN), **kw)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state in ("Z", "X")


def install_dir(program: str) -> Path:
    """What a sandbox must bind for an npm-installed CLI to run: its install (`node_modules`), else its folder."""
    resolved = Path(program).resolve()
    return next((p for p in resolved.parents if p.name == "node_modules"), resolved.parent)


def run_installed_agent(agent: str, program: str, replies: list[str], root: Path,
                        execution_id: str) -> tuple[ExecutionResult, MemorySink]:
    """``agents/AGENT/harness.toml`` with its npm-installed ``program`` bound read-only, on the toy `hello`
    task, sandboxed, through a real proxy to a scripted model that says ``replies``: the execution's result
    and the proxy's events."""
    from gyre.proxy import Proxy, ProxyConfig, ProxyServer
    from tests.proxy.scripted_engine import ScriptedEngine

    config = HarnessConfig.load(REPO / "agents" / agent / "harness.toml").model_copy(
        update={"ro_mounts": (str(install_dir(program)),)})
    engine = ScriptedEngine()
    engine.start()
    engine.say(*replies)
    events = MemorySink()
    server = ProxyServer(Proxy(ProxyConfig(engines={"cell0": engine.url}), sink=events))
    server.start()
    try:
        task = TaskSet.load(TOY_TASKS)["hello"]
        token = server.register_execution(execution_id, None).token
        with HarnessRunner(config, sink=MemorySink(), proxy_url=server.url, root=root) as runner:
            [result] = runner.run_group([Execution(execution_id, task, "g0", token=token, cell_id="cell0")])
    finally:
        server.stop()
        engine.stop()
    return result, events
