"""A child process that leads its own process group, with a wall-clock limit that kills the whole group.

Harnesses spawn children (shells, test runners, language servers). Killing only the harness would leave
those running, holding CPU and files in the workspace, so the child starts a new session
(`start_new_session=True`) and every kill goes to the group (`killpg`).

Trap: the group id is the leader's pid, and the kernel may reuse a pid once its process is reaped. So the
leader is *observed* exiting without being reaped (`waitid(..., WNOWAIT)`), leftover group members are
killed while the zombie still pins the id, and only then is the leader reaped.

Output goes to files, not pipes: a grandchild that inherited a pipe would keep it open after the leader
died, and reading until EOF would hang until the grandchild exits.

A child that calls `setsid` (a daemonising double fork) leaves the group, so `killpg` misses it. Every
process started here carries a random tag in its environment (`GYRE_PROCESS_TAG`), which its descendants
inherit; when the leader ends, every process with the tag, or descending from the leader, is killed too
(`kill_tagged`). The runner also makes itself a child subreaper (`become_subreaper`), so such an orphan is
re-parented to the runner rather than to init, and is reaped here: none survives as a zombie either.
Trap: a descendant that both leaves the session and clears its environment (`env -i`) after its parent
died is out of reach; only a per-execution cgroup would close that, and none is delegated to Gyre here.

Trap: bubblewrap with a PID namespace is two processes. The outer `bwrap` (the leader) exits as soon as the
namespace's init reports the exit code, without reaping that init (the inner `bwrap`), which is then
re-parented to the subreaper: unreaped, one zombie per sandboxed process piles up until the host runs out
of pids. bwrap's `--info-fd` names that pid (`child-pid`), and it is reaped here after the leader.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

POLL_MIN_S = 0.001
POLL_MAX_S = 0.05
TAG_VAR = "GYRE_PROCESS_TAG"
REAP_LIMIT_S = 10.0
"""How long `kill_tagged` waits for killed processes to disappear (one stuck in the kernel, state D)."""
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, loaded once: `find_library` runs `ldconfig`, too slow for the end of every sandboxed process."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    return _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def is_subreaper() -> bool:
    """Whether this process reaps its orphaned descendants (`become_subreaper`)."""
    if not sys.platform.startswith("linux"):
        return False
    flag = ctypes.c_int(0)
    return _libc().prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value != 0


def new_tag() -> str:
    return secrets.token_hex(16)


def kill_tagged(tag: str, root: int | None = None) -> set[int]:
    """SIGKILL every process whose environment holds `TAG_VAR=tag` or that descends from `root`, and reap
    those re-parented to this process; returns the pids killed. Never touches `root` itself.

    Sweeps /proc until a sweep finds nothing new and every killed process is gone (a process may fork
    between two sweeps; a killed one's children are re-parented to the subreaper, then reaped here).
    """
    if not os.path.isdir("/proc/self"):
        return set()
    me, marker = os.getpid(), f"{TAG_VAR}={tag}".encode()
    killed: set[int] = set()
    deadline = time.monotonic() + REAP_LIMIT_S
    delay = POLL_MIN_S
    while True:
        table = process_table()
        found = {pid for pid, (_, state) in table.items() if state != "Z" and pid != root and _tagged(pid, marker)}
        if root is not None:
            found |= _descendants(root, table)
        found -= {me}
        new = found - killed
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= new
        left = [pid for pid in killed if pid in table]  # still running, or a zombie not yet reaped
        for pid in left:
            if table[pid][0] == me:  # re-parented to this subreaper: reaping it is this process's job
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
        if (not new and not left) or time.monotonic() > deadline:
            return killed
        time.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process in /proc."""
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def _tagged(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:  # gone, or another user's process: not ours
        return False


def _descendants(root: int, table: dict[int, tuple[int, str]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, []))
    return found


@dataclass(frozen=True)
class ProcessOutcome:
    """How a process ended. `returncode` is negative for a signal (as `subprocess` reports it)."""

    returncode: int
    timed_out: bool
    cancelled: bool
    duration_s: float
    pid: int


class GroupProcess:
    """Start `argv` as a session leader; `wait` enforces the limit and cleans up the group."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], stdout: Path,
                 stderr: Path, memory_bytes: int | None = None, sandboxed: bool = False) -> None:
        """Raises `OSError` when the program cannot be started (not found, not executable).

        `sandboxed`: `argv` starts a bubblewrap sandbox. A SIGTERM to bwrap itself would end it at once and
        its namespace with it (SIGKILL to everything inside): the harness would get no grace. So the
        SIGTERM of a timeout goes to bwrap's descendants instead (the harness and what it started;
        `sandbox_init` ignores it, and the namespace's own init only takes signals it handles), and only
        the SIGKILL after the grace goes to bwrap.

        `memory_bytes` limits the address space (RLIMIT_AS) of the program and what it starts afterwards.
        Trap: it is set right after `exec` (`prlimit`: a `preexec_fn` is unsafe in a threaded process), so
        the program's first instants run unlimited; it bounds runaway growth, not the first allocation.
        """
        self.tag = new_tag()
        self.sandboxed = sandboxed
        argv = list(argv)
        # bwrap writes its inner pid here (--info-fd); closed in `_reap_sandbox_init`
        self._info = tempfile.TemporaryFile() if sandboxed else None  # noqa: SIM115
        if self._info is not None:
            argv[1:1] = ["--info-fd", str(self._info.fileno())]
        try:
            with open(stdout, "wb") as out, open(stderr, "wb") as err:
                self._popen = subprocess.Popen(argv, cwd=cwd, env={**env, TAG_VAR: self.tag},
                                               stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                               start_new_session=True, close_fds=True,
                                               pass_fds=() if self._info is None else (self._info.fileno(),))
        except BaseException:
            if self._info is not None:
                self._info.close()
            raise
        self._started = time.monotonic()
        if memory_bytes is not None:
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(self.pid, resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    @property
    def pid(self) -> int:
        return self._popen.pid

    def wait(self, timeout_s: float | None, *, grace_s: float, cancel: threading.Event | None = None,
             kill_leftovers: bool = True, held: Callable[[], float] | None = None) -> ProcessOutcome:
        """Wait for the leader to exit, at most `timeout_s` (or until `cancel` is set), then reap it.

        On timeout or cancel: SIGTERM to the group, `grace_s` for it to exit, then SIGKILL to the group and
        to every process that left it (`kill_tagged`). After a normal exit, leftovers get the same SIGKILL
        when `kill_leftovers` (the default). ``held``: seconds the timeout does not count so far, asked again
        while waiting (it may grow: an execution cut by the scheduler waits to be placed again).
        """
        def deadline() -> float | None:
            return None if timeout_s is None else self._started + timeout_s + (held() if held else 0.0)

        timed_out = cancelled = False
        if not self._poll_until(deadline, cancel):
            cancelled = cancel is not None and cancel.is_set()
            timed_out = not cancelled
            if self.sandboxed:
                for pid in _descendants(self.pid, process_table()):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGTERM)
            else:
                self._signal_group(signal.SIGTERM)
            grace_end = time.monotonic() + grace_s
            self._poll_until(lambda: grace_end, None)
            self._signal_group(signal.SIGKILL)
            kill_tagged(self.tag, self.pid)
        elif kill_leftovers:
            self._signal_group(signal.SIGKILL)
            if not self.sandboxed:  # a sandbox's PID namespace ended with its init: nothing of it is left
                kill_tagged(self.tag, self.pid)  # (the sweep reads every process's environ: ~15 ms of CPU at
                # 300 processes, on the runner's GIL, after each of a step's executions and evaluations)
        returncode = self._popen.wait()
        self._reap_sandbox_init()
        return ProcessOutcome(returncode, timed_out, cancelled, time.monotonic() - self._started, self.pid)

    def _reap_sandbox_init(self) -> None:
        """Reap the namespace's init that the exited bwrap left to this subreaper (see the module's trap).

        Only as a subreaper: then that pid is this process's child and stays a zombie until reaped here, so
        the pid cannot have been reused by another child. Otherwise init reaps it and it is not ours to wait.
        """
        if self._info is None:
            return
        with self._info:
            self._info.seek(0)
            try:
                child = int(json.loads(self._info.read() or b"{}").get("child-pid", 0))
            except (ValueError, AttributeError):  # bwrap failed before it cloned: no init was started
                child = 0
        if child <= 0 or not is_subreaper():
            return
        end = time.monotonic() + REAP_LIMIT_S  # the init exits right after reporting; bounded all the same
        delay = POLL_MIN_S
        while True:
            try:
                if os.waitpid(child, os.WNOHANG) != (0, 0):
                    return
            except ChildProcessError:  # not re-parented here (still under a living bwrap?) or already reaped
                return
            if time.monotonic() > end:
                return
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def _exited(self) -> bool:
        """Whether the leader has exited, leaving it unreaped so its pid (the group id) stays reserved."""
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # already reaped: cannot happen here, but then it has certainly exited
            return True

    def _poll_until(self, deadline_at: Callable[[], float | None], cancel: threading.Event | None) -> bool:
        """True once the leader exited; False at the deadline (asked each round) or when `cancel` is set."""
        delay = POLL_MIN_S
        while not self._exited():
            if cancel is not None and cancel.is_set():
                return False
            now, deadline = time.monotonic(), deadline_at()
            if deadline is not None and now >= deadline:
                return False
            pause = delay if deadline is None else min(delay, deadline - now)
            time.sleep(pause)
            delay = min(delay * 2, POLL_MAX_S)
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        # ESRCH: the group is already empty; EPERM: macOS's answer for a group of zombies only.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


def tail(path: Path, chars: int) -> str:
    """The last `chars` characters of a text file (decoded leniently); empty when the file is missing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * chars))
            data = f.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace").strip()
    return text[-chars:]
