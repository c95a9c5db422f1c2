"""A hostile harness: tries every way out of its sandbox and says, one line each, whether it got through.

Run as the harness command (standard library only: nothing of Gyre is mounted in a sandbox). Its role
comes from H_ROLE:
    hostile   every attempt below, then a double-forked daemon that waits to write outside its life
    victim    another execution: writes its answer, then waits until the test releases it
    sleeper   a daemon, then sleep past the timeout
Each attempt prints `BLOCKED <name>: <why>` when it failed and `ESCAPED <name>: <what it got>` when it did
not; positive checks print `REACHED <name>: ...`. The test reads these lines and checks the host too.
"""

import ctypes
import ctypes.util
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

ENV = os.environ


def attempt(name, action):
    try:
        got = action()
    except Exception as e:  # every failure is the expected outcome: say which
        print(f"BLOCKED {name}: {type(e).__name__}: {e}", flush=True)
    else:
        print(f"ESCAPED {name}: {got!r}"[:400], flush=True)


def read(path):
    return Path(path).read_text()[:200]


def other_tokens():
    mine = ENV.get("ANTHROPIC_API_KEY")
    seen, found = 0, []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        seen += 1
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        for line in environ.split(b"\0"):
            if line.startswith(b"ANTHROPIC_API_KEY=") and line.split(b"=", 1)[1].decode() != mine:
                found.append(line.decode())
    if found:
        return found
    raise PermissionError(f"no other execution's token in /proc ({seen} processes visible)")


def list_checkout():
    """The checkout the run started from: only the interpreter's own directory (the venv, bound read-only so
    the harness can run at all) may be there; the package, the task sets, .git are leaks."""
    checkout = Path(ENV["H_CHECKOUT"])
    prefix = Path(sys.prefix)
    own = {prefix.relative_to(checkout).parts[0]} if prefix.is_relative_to(checkout) else set()
    others = sorted(set(os.listdir(checkout)) - own)
    if others:
        return others
    raise PermissionError(f"only the interpreter's directory {sorted(own)} is visible there")


def list_run_dir():
    """Each directory from the run directory down to the workspace: anything but the path itself is a leak."""
    here, seen = Path(ENV["H_RUN_DIR"]), []
    parts = Path.cwd().relative_to(here).parts
    for i, part in enumerate(parts):
        own = {part} | ({"home", "task.md"} if i == len(parts) - 1 else set())  # its own home and prompt
        others = set(os.listdir(here)) - own
        if others:
            return f"{here}: {sorted(others)}"
        seen.append(part)
        here = here / part
    raise PermissionError(f"only the path to its own workspace ({'/'.join(seen)}) exists above it")


def connect(host, port):
    with socket.create_connection((host, int(port)), timeout=5):
        return f"connected to {host}:{port}"


def targets():
    """The engine HTTP port and the Mooncake endpoint to aim at (`host:port` each). With H_TARGETS=ask they are
    the run's real ones, which only exist once the run is up: ask the test for them through the workspace
    (the one channel it shares with the host). Otherwise the H_PORT listener stands for both."""
    if ENV.get("H_TARGETS") != "ask":
        here = f"{ENV['H_HOST_IP']}:{ENV['H_PORT']}"
        return {"engine": here, "mooncake": here}
    Path("targets.wanted").touch()
    for _ in range(6000):
        if Path("targets.json").exists():
            return json.loads(Path("targets.json").read_text())
        time.sleep(0.01)
    print("NOTARGETS: the test never named the run's engine and Mooncake endpoint", flush=True)
    return {}


def connect_to(address):
    host, _, port = address.rpartition(":")
    return connect(host.strip("[]"), port)


def write(path):
    Path(path).write_text("planted by a hostile harness")
    return f"wrote {path}"


def fork_bomb():
    children = []
    try:
        while len(children) < 100_000:
            pid = os.fork()
            if pid == 0:
                signal.pause()
                os._exit(0)
            children.append(pid)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} after {len(children)} processes") from None
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return f"{len(children)} processes"


def fill_disk():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    written = 0
    try:
        with open("fill.bin", "wb") as f:
            while written < 4 << 30:
                written += f.write(b"\0" * (1 << 20))
                f.flush()
    finally:
        os.unlink("fill.bin")
    return f"wrote {written >> 20} MiB"


def signal_outside(pid):
    os.kill(int(pid), signal.SIGKILL)
    return f"SIGKILL delivered to {pid}"


def ptrace_outside(pid):
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.ptrace(16, int(pid), None, None) != 0:  # PTRACE_ATTACH
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return f"attached to {pid}"


def reach_proxy():
    body = json.dumps({"model": ENV["ANTHROPIC_MODEL"], "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(ENV["ANTHROPIC_BASE_URL"] + "/v1/messages", data=body, method="POST",
                                     headers={"x-api-key": ENV["ANTHROPIC_API_KEY"],
                                              "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status, reply.read().decode()[:100]


def daemonize(then):
    """Double fork: the grandchild leaves the session and outlives the harness (if the sandbox lets it)."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            Path("daemon.ready").write_text(str(os.getpid()))
            then()
            os._exit(0)
        os._exit(0)
    os.wait()
    while not Path("daemon.ready").exists():
        time.sleep(0.01)


def outlive():
    while not Path("daemon.go").exists():
        time.sleep(0.05)
    Path("daemon.escaped").write_text("the daemon outlived its execution")


def hostile():
    attempt("read-secret", lambda: read(ENV["H_SECRET"]))
    attempt("read-secret-relative", lambda: read("../../../secrets.toml"))
    attempt("read-other-workspace", lambda: read(Path(ENV["H_VICTIM_WORKSPACE"]) / "answer.txt"))
    attempt("read-other-token-by-pid", lambda: read(f"/proc/{ENV['H_VICTIM_PID']}/environ"))
    attempt("read-other-token-by-scan", other_tokens)
    attempt("read-task-set", lambda: read(ENV["H_TASKSET"]))
    attempt("read-grader", lambda: read(ENV["H_GRADER"]))
    attempt("read-checkout", list_checkout)
    attempt("list-run-dir", list_run_dir)
    attempt("connect-controller", lambda: connect("127.0.0.1", ENV["H_PORT"]))
    attempt("connect-controller-external", lambda: connect(ENV["H_HOST_IP"], ENV["H_PORT"]))
    for name, address in targets().items():
        attempt(f"connect-{name}", lambda address=address: connect_to(address))
    attempt("write-execution-dir", lambda: write("../escape.txt"))
    attempt("write-run-dir", lambda: write(Path(ENV["H_RUN_DIR"]) / "planted.txt"))
    attempt("write-usr", lambda: write("/usr/planted.txt"))
    attempt("write-etc", lambda: write("/etc/planted.txt"))
    attempt("fork-bomb", fork_bomb)
    attempt("fill-disk", fill_disk)
    attempt("signal-outside", lambda: signal_outside(ENV["H_HOST_PID"]))
    attempt("ptrace-outside", lambda: ptrace_outside(ENV["H_HOST_PID"]))
    status, body = reach_proxy()
    print(f"REACHED proxy: {status} {body}", flush=True)
    Path(ENV["H_ANSWER"]).write_text("hello")
    print(f"REACHED workspace: wrote {ENV['H_ANSWER']}", flush=True)
    daemonize(outlive)
    print("DONE", flush=True)


def victim():
    Path("answer.txt").write_text("hello")
    Path("victim.ready").touch()
    while not Path("victim.release").exists():
        time.sleep(0.02)


def sleeper():
    daemonize(outlive)
    print("daemon started; now sleeping past the timeout", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    {"hostile": hostile, "victim": victim, "sleeper": sleeper}[ENV["H_ROLE"]]()
    sys.exit(0)
