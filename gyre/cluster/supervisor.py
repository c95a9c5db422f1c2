"""The controller keeps its run's processes alive: it starts each, adopts them after its own restart, and
starts again one that exits while the run still wants it.

Each process's pid is in ``<run_dir>/processes/<name>.pid`` (rewritten on every start), so a controller that
was killed and resumed (`gyre run CONFIG --resume`) finds the cells and the proxy its predecessor started —
they kept running, and reconnect by themselves — and checks that each pid is still that process (its
command line names the run's config file and the process), not a stranger that reused the number.

An exit is reported to ``on_exit(name, reason)`` (the controller declares the peer lost at once rather
than after missed heartbeats) and the process is started again. A process that exits on its own (an exit
status: a bad config, an import error) before it ever said hello more than ``crash_limit`` times in a row is not
restarted: ``on_give_up`` is told and the run fails, with the process's output file named. One killed by a
signal before its hello is someone else's doing (an operator, the OOM killer, chaos: seed 8 killed a starting
core four times in 40 s) and does not count: it is always started again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gyre.cluster.procs import cmdline, running

log = logging.getLogger(__name__)


@dataclass
class _Process:
    name: str
    argv: list[str]
    pid: int = 0
    popen: subprocess.Popen | None = None  # None for an adopted process (another controller started it)
    starts: int = 0
    crashes: int = 0  # exits since the last hello
    gone: bool = False  # exited and not started again (stopping, or given up)


class Supervisor:
    def __init__(self, logs: Path, commands: Mapping[str, Sequence[str]], env: Mapping[str, str], *,
                 identity: Callable[[str], Sequence[str]], on_exit: Callable[[str, str], None],
                 on_give_up: Callable[[str, str], None], crash_limit: int = 3, poll_s: float = 0.2) -> None:
        """``identity(name)``: argv elements an adopted pid's command line must contain to be that process."""
        self.logs = logs
        self.env = dict(env)
        self.identity = identity
        self.on_exit, self.on_give_up = on_exit, on_give_up
        self.crash_limit, self.poll_s = crash_limit, poll_s
        self._procs = {name: _Process(name, list(argv)) for name, argv in commands.items()}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gyre-supervisor", daemon=True)
        self.restarts = 0

    def pid_file(self, name: str) -> Path:
        return self.logs / f"{name}.pid"

    # -- starting -------------------------------------------------------------------------------------------

    def start(self, adopt: bool) -> dict[str, str]:
        """Start every process (or, with ``adopt``, take over those still running); returns name -> how."""
        self.logs.mkdir(parents=True, exist_ok=True)
        how: dict[str, str] = {}
        for name, proc in self._procs.items():
            if adopt and (pid := self._adoptable(name)):
                proc.pid = pid
                how[name] = "adopted"
            else:
                self._spawn(proc)
                how[name] = "started"
        self._thread.start()
        return how

    def _adoptable(self, name: str) -> int:
        try:
            pid = int(self.pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return 0
        argv = cmdline(pid)
        if not running(pid) or not all(part in argv for part in self.identity(name)):
            return 0
        return pid

    def _spawn(self, proc: _Process) -> None:
        with open(self.logs / f"{proc.name}.log", "ab") as out:
            popen = subprocess.Popen(proc.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        proc.popen, proc.pid, proc.gone = popen, popen.pid, False
        proc.starts += 1
        tmp = self.pid_file(proc.name).with_suffix(".pid.tmp")
        tmp.write_text(f"{popen.pid}\n")
        os.replace(tmp, self.pid_file(proc.name))

    def starts(self, name: str) -> int:
        """How many times this supervisor started the process (0: adopted, or never)."""
        return self._procs[name].starts

    def said_hello(self, name: str) -> None:
        """The process connected: its crash count starts over."""
        with self._lock:
            if name in self._procs:
                self._procs[name].crashes = 0

    # -- watching -------------------------------------------------------------------------------------------

    def _exited(self, proc: _Process) -> tuple[str, bool] | None:
        """Why the process is gone and whether that counts as its crash (not when a signal killed it), or None."""
        if proc.gone:
            return None
        if proc.popen is not None:
            code = proc.popen.poll()
            return None if code is None else (f"its process {proc.pid} exited with status {code}", code >= 0)
        return None if running(proc.pid) else (f"its process {proc.pid} is gone", True)  # adopted: how is unknown

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for proc in list(self._procs.values()):
                with self._lock:
                    if self._stopping.is_set():
                        return
                    exited = self._exited(proc)
                    if exited is None:
                        continue
                    reason, crashed = exited
                    proc.gone = True
                    proc.crashes += crashed
                    give_up = proc.crashes > self.crash_limit
                if report_exit(proc.name, reason, give_up, self.on_exit, self.on_give_up,
                               f"{proc.crashes} times without connecting (its output is in "
                               f"{self.logs / (proc.name + '.log')})"):
                    continue
                with self._lock:
                    if not self._stopping.is_set():
                        self._spawn(proc)
                        self.restarts += 1

    def kill(self, name: str) -> None:
        """SIGKILL a process the controller declared lost while it still runs (hung); it is started again."""
        self._signal(name, signal.SIGKILL)

    def terminate(self, name: str) -> None:
        """SIGTERM a process the run could not tell to stop: it closes as on the stop command."""
        self._signal(name, signal.SIGTERM)

    def _signal(self, name: str, signum: int) -> None:
        with self._lock:
            proc = self._procs.get(name)
            if proc is None or proc.gone or not proc.pid:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

    # -- stopping -------------------------------------------------------------------------------------------

    def stop_watching(self) -> None:
        """No more restarts (the run is ending: its processes are told to stop)."""
        with self._lock:
            self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10)

    def alive(self, name: str) -> bool:
        return self._alive(self._procs[name])

    def _alive(self, proc: _Process) -> bool:
        return bool(proc.pid) and not proc.gone and self._exited(proc) is None

    def reap(self, timeout_s: float = 30.0) -> None:
        """Wait for every process to exit; terminate, then kill, what is left after ``timeout_s``."""
        self.stop_watching()
        deadline = time.monotonic() + timeout_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            left = [p for p in self._procs.values() if self._alive(p)]
            if not left:
                return
            for proc in left:
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, sig)
            while left and time.monotonic() < deadline:
                left = [p for p in left if self._alive(p)]
                time.sleep(0.05)
            deadline = time.monotonic() + 10


def report_exit(name: str, reason: str, give_up: bool, on_exit: Callable[[str, str], None],
                on_give_up: Callable[[str, str], None], crashes: str) -> bool:
    """Tell the run a supervised process exited (the lost-process path, `on_exit`), and, past its crash
    limit, that it is given up on; True then. One rule for every launcher (local processes, Ray actors)."""
    log.warning("%s: %s%s", name, reason, "" if give_up else "; starting it again")
    try:
        on_exit(name, reason)
    except Exception:  # the run's bug: logged, and supervision goes on
        log.exception("supervision: on_exit(%s) raised", name)
    if give_up:
        on_give_up(name, f"{reason}, {crashes}")
    return give_up

