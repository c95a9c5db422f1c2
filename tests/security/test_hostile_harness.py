"""A hostile harness in the sandbox: every way out fails, the run goes on, its neighbour is unaffected.

`hostile.py` runs as the harness (its lines say what each attempt got); the test checks the same from the
host: the listener that stands for the controller, an engine and a Mooncake endpoint got no connection, the
process that stands for the controller still runs, nothing was planted outside the workspace, no process
of the execution outlived it. Every wait is on an event (a file the harness writes, a future), never a guess
at how long something takes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gyre.events.models import ExecutionStarted
from gyre.harness import Execution, HarnessConfig, HarnessRunner, TaskSet
from gyre.harness.bwrap import SandboxUnavailable, check_available
from gyre.harness.config import SandboxLimits
from gyre.harness.tasks import Task
from gyre.sink import MemorySink
from tests.harness.harness_helpers import REPO, TOY_TASKS, wait_for

HOSTILE = Path(__file__).with_name("hostile.py")
ATTEMPTS = ("read-secret", "read-secret-relative", "read-other-workspace", "read-other-token-by-pid",
            "read-other-token-by-scan", "read-task-set", "read-grader", "read-checkout", "list-run-dir",
            "connect-controller", "connect-controller-external", "connect-engine", "connect-mooncake",
            "write-execution-dir", "write-run-dir", "write-usr", "write-etc",
            "fork-bomb", "fill-disk", "signal-outside", "ptrace-outside")
SECRET = "run-secret-do-not-leak"
VICTIM_TOKEN = "victim-token-0123456789"
HOSTILE_TOKEN = "hostile-token-0123456789"


class StandInProxy(ThreadingHTTPServer):
    """Answers every POST with a fixed JSON body and keeps the key each request carried."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: StandInProxy

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.server.keys.append(self.headers.get("x-api-key", ""))
        body = json.dumps({"type": "message", "content": [{"type": "text", "text": "hi"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[StandInProxy]:
    server = StandInProxy()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Stands for the controller, an engine port and a Mooncake endpoint: on every address of the host."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.fixture
def controller() -> Iterator[subprocess.Popen[bytes]]:
    """A host process outside the sandbox, for the attempts to signal and ptrace."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    yield process
    process.kill()
    process.wait()


def host_ip() -> str:
    """A non-loopback address of this host (the loopback one when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def hostile_task() -> Task:
    """The toy task set's `hello` with the hostile script among its starting files, scored by its grader."""
    task = TaskSet.load(TOY_TASKS)["hello"]
    spec = task.spec.model_copy(update={"files": {"hostile.py": HOSTILE.read_text()}})
    return Task(spec, task.base_dir, task.evaluator)


def config(**overrides: object) -> HarnessConfig:
    settings: dict[str, object] = {
        "name": "hostile", "command": ["{python}", "hostile.py"], "max_concurrency": 2, "timeout_s": 300,
        "kill_grace_s": 0.5, "limits": SandboxLimits(nproc=64, fsize_mb=8, tmp_mb=16)} | overrides
    return HarnessConfig.model_validate(settings)


def alive(variable: str) -> list[int]:
    """Live processes (not zombies) on the host whose environment holds `variable` (`NAME=value`)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if variable.encode() in environ.split(b"\0") and state not in ("Z", "X"):
            found.append(int(name))
    return found


def lines(path: Path, prefix: str) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        if line.startswith(prefix + " "):
            name, _, said = line[len(prefix) + 1:].partition(": ")
            found[name] = said
    return found


def test_every_way_out_fails_and_the_neighbour_is_unaffected(tmp_path: Path, proxy: StandInProxy,
                                                             listener: socket.socket,
                                                             controller: subprocess.Popen[bytes]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "secrets.toml").write_text(f'secret = "{SECRET}"\n')
    sink = MemorySink()
    task = hostile_task()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    with HarnessRunner(config(), sink=sink, proxy_url=url, root=run_dir / "executions") as runner:
        victim = runner.submit(Execution("victim", task, "g0", token=VICTIM_TOKEN, env={"H_ROLE": "victim"}))
        victim_dir = run_dir / "executions" / "victim" / "workspace"
        wait_for((victim_dir / "victim.ready").exists, timeout_s=120, what="the victim execution to be ready")
        victim_pid = next(e.pid for e in sink.events if isinstance(e, ExecutionStarted))
        env = {"H_ROLE": "hostile", "H_SECRET": str(run_dir / "secrets.toml"), "H_VICTIM_WORKSPACE": str(victim_dir),
               "H_VICTIM_PID": str(victim_pid), "H_TASKSET": str(TOY_TASKS),
               "H_GRADER": str(TOY_TASKS.parent / "grading.py"), "H_CHECKOUT": str(REPO),
               "H_PORT": str(listener.getsockname()[1]), "H_HOST_IP": host_ip(), "H_RUN_DIR": str(run_dir),
               "H_HOST_PID": str(controller.pid), "H_ANSWER": task.spec.answer_file}
        result = runner.run(Execution("hostile", task, "g0", token=HOSTILE_TOKEN, env=env))
        (victim_dir / "victim.release").touch()
        neighbour = victim.result()

    said = result.dirs.stdout.read_text()
    blocked, escaped, reached = (lines(result.dirs.stdout, p) for p in ("BLOCKED", "ESCAPED", "REACHED"))
    assert escaped == {}, said
    assert set(blocked) == set(ATTEMPTS), said
    assert "after" in blocked["fork-bomb"] and "File too large" in blocked["fill-disk"], said
    assert said.rstrip().endswith("DONE"), result.dirs.stderr.read_text()
    for leaked in (SECRET, VICTIM_TOKEN, 'kind = "text"'):
        assert leaked not in said
    # The one way out works, with the execution's own token, and the workspace is writable.
    assert reached["proxy"].startswith("200") and proxy.keys == [HOSTILE_TOKEN]
    assert result.status == "completed" and result.reward == 1.0  # scored by the grader, in its own sandbox
    assert neighbour.status == "completed" and neighbour.reward == 1.0
    # From the host: nothing reached the listener, the outside process lives, nothing was planted.
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert controller.poll() is None
    assert not (run_dir / "planted.txt").exists() and not (result.dirs.root / "escape.txt").exists()
    assert (run_dir / "secrets.toml").read_text() == f'secret = "{SECRET}"\n'
    # The double-forked daemon died with the execution: nothing of it runs, so the release below reaches no one.
    assert (result.workspace / "daemon.ready").exists()
    assert alive("GYRE_EXECUTION_ID=hostile") == []
    (result.workspace / "daemon.go").touch()
    assert not (result.workspace / "daemon.escaped").exists()


def test_a_daemon_does_not_outlive_a_timed_out_execution(tmp_path: Path, proxy: StandInProxy) -> None:
    sink = MemorySink()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    with HarnessRunner(config(timeout_s=5), sink=sink, proxy_url=url, root=tmp_path / "executions") as runner:
        result = runner.run(Execution("sleeper", hostile_task(), "g0", token=HOSTILE_TOKEN,
                                      env={"H_ROLE": "sleeper", "H_ANSWER": "answer.txt"}))
    assert result.status == "timed_out"
    assert alive("GYRE_EXECUTION_ID=sleeper") == []
    (result.workspace / "daemon.go").touch()
    assert not (result.workspace / "daemon.escaped").exists()


def test_a_missing_bubblewrap_is_one_error_naming_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gyre.harness import bwrap

    monkeypatch.setattr(bwrap.shutil, "which", lambda *_: None)
    monkeypatch.setattr(bwrap.os, "access", lambda *_: False)
    bwrap.bwrap_path.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"not installed: install bubblewrap \(`make syslibs`"):
            HarnessRunner(config(), sink=MemorySink(), proxy_url="http://127.0.0.1:9", root=tmp_path)
    finally:
        bwrap.bwrap_path.cache_clear()


def test_namespaces_refused_is_one_error_with_bwraps_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gyre.harness import bwrap

    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bwrap, "bwrap_path", lambda: str(fake))
    with pytest.raises(SandboxUnavailable, match=r"No permissions to create new namespace.*sandbox = \"none\""):
        check_available()


def test_sandbox_none_is_a_choice_that_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    with HarnessRunner(config(sandbox="none"), sink=MemorySink(), proxy_url="http://127.0.0.1:9", root=tmp_path):
        pass
    assert "runs unsandboxed" in capsys.readouterr().err
    assert "runs unsandboxed" in caplog.text
