"""A child process that leads its own process group, with a wall-clock limit that kills the whole group.

Harnesses spawn children (shells, test runners, language servers). Killing only the harness would leave
those running, holding CPU and files in the workspace, so the child starts a new session
(`start_new_session=True`) and every kill goes to the group (`killpg`).

Trap: the group id is the leader's pid, and the kernel may reuse a pid once its process is reaped. So the
leader is *observed* exiting without being reaped (`waitid(..., WNOWAIT)`), leftover group members are
killed while the zombie still pins the id, and only then is the leader reaped.

Output goes to files, not pipes: a grandchild that inherited a pipe would keep it open after the leader
died, and reading until EOF would hang until the grandchild exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

POLL_MIN_S = 0.001
POLL_MAX_S = 0.05


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
                 stderr: Path) -> None:
        """Raises `OSError` when the program cannot be started (not found, not executable)."""
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            self._popen = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=err, start_new_session=True, close_fds=True)
        self._started = time.monotonic()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def wait(self, timeout_s: float | None, *, grace_s: float, cancel: threading.Event | None = None,
             kill_leftovers: bool = True) -> ProcessOutcome:
        """Wait for the leader to exit, at most `timeout_s` (or until `cancel` is set), then reap it.

        On timeout or cancel: SIGTERM to the group, `grace_s` for it to exit, then SIGKILL to the group.
        After a normal exit, leftover group members get SIGKILL when `kill_leftovers` (the default).
        """
        deadline = None if timeout_s is None else self._started + timeout_s
        timed_out = cancelled = False
        if not self._poll_until(deadline, cancel):
            cancelled = cancel is not None and cancel.is_set()
            timed_out = not cancelled
            self._signal_group(signal.SIGTERM)
            self._poll_until(time.monotonic() + grace_s, None)
            self._signal_group(signal.SIGKILL)
        elif kill_leftovers:
            self._signal_group(signal.SIGKILL)
        returncode = self._popen.wait()
        return ProcessOutcome(returncode, timed_out, cancelled, time.monotonic() - self._started, self.pid)

    def _exited(self) -> bool:
        """Whether the leader has exited, leaving it unreaped so its pid (the group id) stays reserved."""
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # already reaped: cannot happen here, but then it has certainly exited
            return True

    def _poll_until(self, deadline: float | None, cancel: threading.Event | None) -> bool:
        """True once the leader exited; False at the deadline or when `cancel` is set."""
        delay = POLL_MIN_S
        while not self._exited():
            if cancel is not None and cancel.is_set():
                return False
            now = time.monotonic()
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
