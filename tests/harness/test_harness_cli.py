"""`gyre harness ...` commands, and the configuration examples of docs/harness.md (they must stay valid)."""

from __future__ import annotations

import os
import re
import tomllib
from collections import deque
from pathlib import Path

from typer.testing import CliRunner

from gyre.harness import HarnessConfig, TaskSetSpec
from gyre.harness.cli import harness_app
from tests.harness.harness_helpers import REPO, TOY_HARNESS, TOY_TASKS
from tests.harness.stand_in_server import Script, StandInServer, text

cli = CliRunner()


def test_tasks_lists_the_task_set() -> None:
    result = cli.invoke(harness_app, ["tasks", str(TOY_TASKS)])
    assert result.exit_code == 0, result.output
    assert "hello" in result.output and "config-json" in result.output and "12 tasks" in result.output


def test_evaluate_scores_a_workspace(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "answer.txt").write_text("hello")
    result = cli.invoke(harness_app, ["evaluate", str(TOY_TASKS), "hello", str(workspace), "--status", "timed_out"])
    assert result.exit_code == 0, result.output
    assert '"reward":1.0' in result.output and '"partial":true' in result.output
    if os.geteuid() == 0:  # sandboxed by default: the workspace was handed to an unprivileged uid
        assert workspace.stat().st_uid != 0
    plain = cli.invoke(harness_app, ["evaluate", str(TOY_TASKS), "hello", str(workspace), "--no-sandbox"])
    assert plain.exit_code == 0 and '"reward":1.0' in plain.output and "unsandboxed" in plain.output
    bad = cli.invoke(harness_app, ["evaluate", str(TOY_TASKS), "hello", str(workspace), "--status", "done"])
    assert bad.exit_code != 0


def test_run_one_against_a_server(tmp_path: Path) -> None:
    server = StandInServer(Script(main=deque([text("hello")]))).start()
    try:
        result = cli.invoke(harness_app, ["run-one", str(TOY_TASKS), "hello", "--config", str(TOY_HARNESS),
                                          "--proxy-url", server.url, "--root", str(tmp_path / "x"),
                                          "--log", str(tmp_path / "log")])
    finally:
        server.stop()
    assert result.exit_code == 0, result.output
    assert "reward_recorded" in result.output and "reward: 1.0" in result.output
    assert (tmp_path / "log").is_dir()


def test_the_documented_configurations_are_valid() -> None:
    doc = (REPO / "docs" / "harness.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, flags=re.DOTALL)
    harnesses = [b for b in blocks if "command = [" in b and "[[tasks]]" not in b and "type = " not in b]
    tasksets = [b for b in blocks if "[[tasks]]" in b]
    assert harnesses and tasksets
    names = {HarnessConfig.model_validate(tomllib.loads(b)).name for b in harnesses}
    assert "claude-code" in names
    for block in tasksets:
        TaskSetSpec.model_validate(tomllib.loads(block))
