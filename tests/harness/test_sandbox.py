"""The sandbox's way out (the relay carries large bodies both ways; nothing else is reachable) and its timeout."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gyre.harness import HarnessRunner, PythonEvaluator
from gyre.harness.bwrap import SandboxSpec, UidPool, check_available, give_to
from gyre.harness.process import process_table
from gyre.harness.relay import ProxyRelay
from gyre.sink import MemorySink
from tests.harness.graders import probes_its_sandbox
from tests.harness.harness_helpers import TOY_TASKS, execution, make_task, shell

CLIENT = """
import hashlib, os, sys, urllib.request
body = os.urandom({size})
for _ in range(3):  # several connections, one after another
    reply = urllib.request.urlopen(urllib.request.Request(sys.argv[1], data=body, method="POST"), timeout=60).read()
    assert reply[:64].decode() == hashlib.sha256(body).hexdigest() and reply[64:] == body[::-1], "corrupted"
print("ok", len(body))
"""


class Echo(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # answers the body's digest, then the body reversed
        body = self.rfile.read(int(self.headers["content-length"]))
        reply = hashlib.sha256(body).hexdigest().encode() + body[::-1]
        self.send_response(200)
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_large_bodies_cross_the_relay_intact(tmp_path: Path, echo: int) -> None:
    check_available()
    uid = UidPool.shared().acquire() if os.geteuid() == 0 else None
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "client.py").write_text(CLIENT.format(size=3 << 20))  # above the relay's 1 MiB high water
    give_to(uid, workspace)
    relay = ProxyRelay("127.0.0.1", echo)
    try:
        socket_path = relay.open(uid)
        spec = SandboxSpec(workspace=workspace, uid=uid, relay_socket=socket_path, proxy_port=echo)
        done = subprocess.run(spec.argv([sys.executable, "client.py", f"http://127.0.0.1:{echo}/"]),
                              capture_output=True, text=True, timeout=120, cwd=workspace)
    finally:
        relay.stop()
        if uid is not None:
            UidPool.shared().release(uid)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ok {3 << 20}"


def test_without_a_relay_there_is_no_way_out(tmp_path: Path, echo: int) -> None:
    check_available()
    code = f"import socket; socket.create_connection(('127.0.0.1', {echo}), timeout=5)"
    done = subprocess.run(SandboxSpec(workspace=tmp_path).argv([sys.executable, "-c", code]), capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0 and "ConnectionRefusedError" in done.stderr


def test_a_sandboxed_harness_gets_its_grace_on_timeout(tmp_path: Path) -> None:
    """The timeout's SIGTERM reaches the harness inside (a SIGTERM to bwrap would kill the namespace at once)."""
    script = "trap 'echo term > got-term; exit 0' TERM; touch ready; while :; do sleep 0.05; done"
    with HarnessRunner(shell(script, timeout_s=3, kill_grace_s=60), sink=MemorySink(), proxy_url="http://127.0.0.1:9",
                       root=tmp_path) as runner:
        result = runner.run(execution(make_task()))
    assert result.status == "timed_out" and (result.workspace / "ready").exists()
    assert (result.workspace / "got-term").read_text() == "term\n"
    assert result.duration_s < 60  # it ended on the SIGTERM, not at the SIGKILL after the grace


def libraries(program: str) -> list[Path]:
    """The shared libraries `program` loads (ldd), the dynamic loader included."""
    found = []
    for line in subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            found.append(Path(path))
    return found


def test_a_task_runs_on_its_own_root_filesystem(tmp_path: Path) -> None:
    """A rootfs (here a two-file "image": /bin/sh and its C library) replaces the host's system; the workspace
    and the interpreter of `sandbox_init` are bound into it, and it stays read-only."""
    image = tmp_path / "image"
    for path in [Path("/bin/sh"), *libraries("/bin/sh"), *libraries(os.path.realpath(sys.executable))]:
        if str(path).startswith(sys.base_prefix):
            continue  # the interpreter's own files are bound from the host
        target = image / path.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
        target.chmod(0o755)
    (image / "etc").mkdir()
    (image / "etc" / "os-release").write_text("NAME=gyre-test-image\n")
    task = make_task(tmp=tmp_path, rootfs="image")
    script = ("while read line; do echo $line; done < /etc/os-release > answer.txt; echo /usr/* > usr.txt; "
              "echo planted > /planted.txt || echo read-only > ro.txt")
    with HarnessRunner(shell(script), sink=MemorySink(), proxy_url="http://127.0.0.1:9", root=tmp_path / "runs") as r:
        result = r.run(execution(task))
    assert result.status == "completed", result.message
    assert (result.workspace / "answer.txt").read_text() == "NAME=gyre-test-image\n"
    assert (result.workspace / "usr.txt").read_text() == "/usr/*\n"  # the image has no /usr; the host's is not there
    assert (result.workspace / "ro.txt").exists() and not (image / "planted.txt").exists()


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js here")
def test_a_node_harness_runs_with_the_default_limits(tmp_path: Path) -> None:
    """Node (what Claude Code and Codex run on) needs /etc/ssl and reserves ~10 GiB per WebAssembly memory."""
    script = ("node -e \"const m = []; for (let i = 0; i < 4; i++) m.push(new WebAssembly.Memory({{initial: 1}})); "
              "require('fs').writeFileSync('answer.txt', 'hello')\"")
    with HarnessRunner(shell(script), sink=MemorySink(), proxy_url="http://127.0.0.1:9", root=tmp_path) as runner:
        result = runner.run(execution(make_task()))
    assert result.status == "completed", result.message
    assert result.reward == 1.0


def test_a_python_evaluator_runs_in_the_sandbox_and_alone_sees_its_task_set(tmp_path: Path) -> None:
    """Trusted task-set code, but it reads model-written files: same sandbox, plus its task set read-only."""
    taskset = tmp_path / "taskset"
    taskset.mkdir()
    (taskset / "answers.toml").write_text("expected = 'hello'\n")
    (tmp_path / "secrets.toml").write_text("secret\n")
    grading = {"taskset": str(taskset / "answers.toml"), "secret": str(tmp_path / "secrets.toml"),
               "checkout": str(TOY_TASKS)}
    task = make_task(evaluator=PythonEvaluator(probes_its_sandbox, taskset_dir=taskset), grading=grading)
    script = f"test -e {taskset}/answers.toml && echo seen > leak.txt; printf hello > answer.txt"
    with HarnessRunner(shell(script), sink=MemorySink(), proxy_url="http://127.0.0.1:9",
                       root=tmp_path / "executions") as runner:
        result = runner.run(execution(task))
    assert result.reward == 1.0 and not (result.workspace / "leak.txt").exists()  # the harness did not see it
    details = result.evaluation.details  # type: ignore[union-attr]
    assert details["seen"] == {"taskset": True, "secret": False, "checkout": False}
    assert details["processes"] <= 3  # its own PID namespace: bwrap's init, sandbox_init, itself
    assert os.geteuid() != 0 or details["uid"] >= UidPool.BASE


def zombie_children() -> set[int]:
    """This process's children that exited and were never reaped."""
    return {pid for pid, (ppid, state) in process_table().items() if ppid == os.getpid() and state == "Z"}


def test_sandboxed_executions_and_evaluations_leave_no_zombie_behind(tmp_path: Path) -> None:
    """bwrap's namespace init outlives the bwrap the runner started and is re-parented to the runner (a
    subreaper): each one left unreaped is a pid the host never gets back (an hours-long run ran out of them)."""
    before = zombie_children()
    with HarnessRunner(shell("printf hello > answer.txt", max_concurrency=2), sink=MemorySink(),
                       proxy_url="http://127.0.0.1:9", root=tmp_path / "done") as runner:
        assert runner.subreaper and runner.sandboxed
        results = runner.run_group([execution(make_task(), n) for n in range(4)])
        assert [r.reward for r in results] == [1.0] * 4  # each evaluated, in a sandbox of its own
    with HarnessRunner(shell("sleep 300", timeout_s=0.2, kill_grace_s=0.0), sink=MemorySink(),
                       proxy_url="http://127.0.0.1:9", root=tmp_path / "cut") as runner:
        assert runner.run(execution(make_task())).status == "timed_out"
    assert zombie_children() - before == set()
