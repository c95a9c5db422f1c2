"""The harness runner: executions as subprocesses in their own workspaces, scored when they end.

One execution, start to end:
    execution_queued    when submitted (it may wait for one of `max_concurrency` slots)
    execution_started   once the harness process runs (its pid and workspace)
    execution_finished  completed (exit 0) | timed_out (group killed, workspace kept) | harness_error
    reward_recorded     the evaluator's score (`partial` after a timeout), or
    evaluation_failed   the evaluator crashed / timed out / lacked infrastructure: excluded, never reward 0

Each harness runs in its own bubblewrap sandbox unless its configuration says `sandbox = "none"` (see
`gyre.harness.bwrap`): it sees its workspace, a fresh home, the system and the interpreter, and reaches
only the proxy, through a relay that keeps its base URL unchanged.

The runner is thread-based: `submit` returns a `concurrent.futures.Future`, `arun` awaits the same from
asyncio, `run_group` runs a GSPO group and returns its results in order. Nothing here knows the proxy: the
harness reaches it through the environment (base URL and the execution's token), like any real harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from gyre.events.fields import ExecutionStatus
from gyre.events.models import ExecutionFinished, ExecutionQueued, ExecutionStarted
from gyre.harness.bwrap import Limits, SandboxSpec, UidPool, check_available, give_to
from gyre.harness.config import HarnessConfig
from gyre.harness.errors import HarnessError, WorkspaceError
from gyre.harness.evaluation import EvaluationContext, EvaluationOutcome, RewardOutcome
from gyre.harness.process import GroupProcess, ProcessOutcome, become_subreaper, tail
from gyre.harness.relay import ProxyRelay
from gyre.harness.tasks import ID_PATTERN, Task
from gyre.harness.template import expand_all
from gyre.harness.workspace import ExecutionDirs, prepare
from gyre.sink import EventSink

_ID = re.compile(ID_PATTERN)
log = logging.getLogger(__name__)
UNSANDBOXED_WARNING = ("harness {name!r} runs unsandboxed (sandbox = \"none\"): its executions see the host's "
                       "files (the run's secret, other workspaces, task sets with their answers), processes and "
                       "network")


@dataclass(frozen=True)
class Execution:
    """One run of a harness on a task, as the training loop asks for it.

    `token` is the execution token the proxy issued (`Proxy.register_execution(...).token`); `env` adds or
    overrides variables for this execution only.
    """

    execution_id: str
    task: Task
    group_id: str
    token: str
    policy_version: int = 0
    attempt: int = 0
    cell_id: str | None = None
    step: int | None = None
    """The train step whose batch the execution feeds (None outside a training run)."""
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _ID.match(self.execution_id):
            raise ValueError(f"execution_id {self.execution_id!r} must match {ID_PATTERN} (it names a directory)")
        if self.attempt < 0 or self.policy_version < 0:
            raise ValueError("attempt and policy_version must be >= 0")


@dataclass(frozen=True)
class ExecutionResult:
    """How an execution ended and how it was scored (`evaluation` is None when it was not evaluated)."""

    execution_id: str
    task_id: str
    group_id: str
    status: ExecutionStatus
    exit_code: int | None
    duration_s: float
    message: str
    dirs: ExecutionDirs
    evaluation: EvaluationOutcome | None

    @property
    def workspace(self) -> Path:
        return self.dirs.workspace

    @property
    def reward(self) -> float | None:
        """The reward, or None when the execution is excluded (not evaluated, or the evaluation failed)."""
        return self.evaluation.reward if isinstance(self.evaluation, RewardOutcome) else None


class Gate:
    """Admits executions to their cell while it serves rollouts; the controller's actuator opens and closes it.

    An execution waits at a closed gate before its harness starts (it stays queued in the log); `wait_idle`
    returns once every admitted execution has ended and been scored (the drain of a role switch).
    """

    def __init__(self, is_open: bool = True) -> None:
        self._cond = threading.Condition()
        self._open = is_open
        self._inside = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._open = False

    def enter(self, stop: Callable[[], bool], execution_id: str = "", version: int = 0) -> bool:
        """Wait until the gate is open (True) or ``stop()`` holds (False); `interrupt` re-checks ``stop``.
        ``execution_id`` and its queued policy ``version``: for a gate that places executions on cells."""
        with self._cond:
            self._cond.wait_for(lambda: self._open or stop())
            if stop():
                return False
            self._inside += 1
            return True

    def place(self, execution_id: str) -> str | None:
        """The cell an admitted execution runs on (None: the one it was submitted with). A cluster's gate
        places it on the admitting cell with the most free slots."""
        return None

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def wait_idle(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._inside == 0)

    def interrupt(self) -> None:
        with self._cond:
            self._cond.notify_all()


class Holds:
    """Time each execution spends held by the scheduler — cut (partial rollouts) and waiting to be placed
    again — which its timeout does not count: ``timeout_s`` bounds an execution's time on cells, as the
    simulator's does (a cut there pauses the timeout), so a cut never turns into a timeout. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}
        self._total: dict[str, float] = {}

    def hold(self, execution_id: str) -> None:
        with self._lock:
            self._since.setdefault(execution_id, time.monotonic())

    def release(self, execution_id: str) -> None:
        with self._lock:
            since = self._since.pop(execution_id, None)
            if since is not None:
                self._total[execution_id] = self._total.get(execution_id, 0.0) + time.monotonic() - since

    def held_s(self, execution_id: str) -> float:
        with self._lock:
            since = self._since.get(execution_id)
            return self._total.get(execution_id, 0.0) + (time.monotonic() - since if since is not None else 0.0)

    def forget(self, execution_id: str) -> None:
        with self._lock:
            self._since.pop(execution_id, None)
            self._total.pop(execution_id, None)


class HarnessRunner:
    """Runs executions with bounded concurrency and records their events in `sink`."""

    def __init__(self, config: HarnessConfig, *, sink: EventSink, proxy_url: str, root: str | os.PathLike[str],
                 gate: Gate | None = None,
                 finishing: Callable[[str], contextlib.AbstractContextManager[object]] | None = None) -> None:
        """``finishing(execution_id)``: held while an execution's `execution_finished` is recorded, so an owner
        that re-queues running executions (a cut) can order itself against their end."""
        self.config = config
        self.finishing = finishing if finishing is not None else (lambda execution_id: contextlib.nullcontext())
        self.sink = sink
        self.gate = gate
        self.proxy_url = proxy_url.rstrip("/")
        self.root = Path(root).resolve()
        self.sandboxed = config.sandbox == "bwrap"
        self._relay: ProxyRelay | None = None
        self._uids: UidPool | None = None
        if self.sandboxed:
            check_available()  # one clear error now rather than a harness_error per execution
            parts = urlsplit(self.proxy_url)
            self._relay = ProxyRelay(parts.hostname or "127.0.0.1", parts.port or 80)
            self._uids = UidPool.shared() if os.geteuid() == 0 else None
            # Inside, the relay listens on loopback: a base URL naming another host is rewritten to it.
            self.harness_url = urlunsplit(parts._replace(netloc=f"127.0.0.1:{parts.port or 80}")).rstrip("/")
        else:
            self.harness_url = self.proxy_url
            warning = UNSANDBOXED_WARNING.format(name=config.name)
            log.warning(warning)
            print(f"warning: {warning}", file=sys.stderr)
        self.subreaper = become_subreaper()  # harness children that leave their session come back here to die
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="gyre-harness")
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0
        self._running = 0
        self._closed = False
        self.holds = Holds()
        """Time the scheduler holds an execution (a cut), which its timeout does not count."""

    # -- the training loop's API -------------------------------------------------------------------------

    def submit(self, execution: Execution) -> Future[ExecutionResult]:
        """Record `execution_queued` and schedule the execution; the future resolves once it is scored."""
        # Under the lock: `queued` must reach the sink before the worker's `started`, and `close` must not
        # slip in between the check and the pool's submit (which would then refuse a recorded execution).
        with self._lock:
            if self._closed:
                raise HarnessError("the harness runner is closed")
            self.sink.record(ExecutionQueued(execution_id=execution.execution_id, task_id=execution.task.id,
                                             group_id=execution.group_id, policy_version=execution.policy_version,
                                             attempt=execution.attempt, cell_id=execution.cell_id,
                                             step=execution.step))
            self._queued += 1
            return self._pool.submit(self._execute, execution)

    def run(self, execution: Execution) -> ExecutionResult:
        return self.submit(execution).result()

    async def arun(self, execution: Execution) -> ExecutionResult:
        return await asyncio.wrap_future(self.submit(execution))

    def run_group(self, executions: Iterable[Execution]) -> list[ExecutionResult]:
        """Run every execution (at most `max_concurrency` at once); results in the order given."""
        futures = [self.submit(e) for e in executions]
        return [f.result() for f in futures]

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    def close(self, *, kill_running: bool = False) -> None:
        """Stop accepting executions and wait for those submitted.

        With `kill_running`, running harnesses are killed (their group, as on a timeout) and queued ones end
        without starting; both finish as `harness_error` "cancelled" and are not evaluated (Ctrl-C).
        """
        with self._lock:
            was_closed, self._closed = self._closed, True
        if kill_running:
            self._cancel.set()
        if self.gate is not None:
            self.gate.interrupt()  # executions held at a closed gate end without starting
        self._pool.shutdown(wait=True)
        if self._relay is not None and not was_closed:
            self._relay.stop()

    def __enter__(self) -> HarnessRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill_running=exc[0] is not None)

    # -- one execution ----------------------------------------------------------------------------------

    def _execute(self, execution: Execution) -> ExecutionResult:
        with self._lock:
            self._queued -= 1
            self._running += 1
        try:
            if self.gate is None:
                return self._execute_counted(execution)
            if not self.gate.enter(lambda: self._cancel.is_set() or (self._closed and not self.gate.is_open),
                                   execution.execution_id, execution.policy_version):
                dirs = ExecutionDirs.for_execution(self.root, execution.execution_id, execution.attempt)
                return self._finish(execution, dirs, "harness_error", None, 0.0,
                                    "cancelled before it started (runner closed while its cell was not serving)",
                                    False)
            try:
                cell_id = self.gate.place(execution.execution_id)
                if cell_id is not None:
                    execution = replace(execution, cell_id=cell_id)
                return self._execute_counted(execution)
            finally:
                self.gate.leave()
        finally:
            with self._lock:
                self._running -= 1

    def _execute_counted(self, execution: Execution) -> ExecutionResult:
        uid = self._uids.acquire() if self._uids is not None else None
        try:
            return self._execute_as(execution, uid)
        finally:
            if self._uids is not None and uid is not None:
                self._uids.release(uid)

    def _execute_as(self, execution: Execution, uid: int | None) -> ExecutionResult:
        began, began_at = time.monotonic(), time.time()
        dirs = ExecutionDirs.for_execution(self.root, execution.execution_id, execution.attempt)

        def not_started(message: str) -> ExecutionResult:
            return self._finish(execution, dirs, "harness_error", None, time.monotonic() - began, message, False)

        if self._cancel.is_set():
            return not_started("cancelled before it started (runner closed)")
        try:
            prepare(dirs, execution.task)
        except WorkspaceError as e:
            return not_started(str(e))
        timeout_s = min(self.config.timeout_s, execution.task.spec.timeout_s or self.config.timeout_s)
        values = self._values(execution, dirs, timeout_s, began_at)
        argv = expand_all(self.config.command, values, where=f"harness {self.config.name!r} command")
        env = self._env(execution, dirs, values)
        relay_socket = None
        sandbox = None
        if self.sandboxed:
            assert self._relay is not None
            program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
            if program is None or not os.access(program, os.X_OK):
                # Inside, a missing program would only be exit code 127 after a sandbox start: say it here.
                return not_started(f"cannot start harness {argv[0]!r}: no such executable file")
            sandbox = self._sandbox(execution, dirs, uid)
            try:
                give_to(uid, dirs.workspace, dirs.home)
                relay_socket = self._relay.open(uid)  # closed below, once the harness has ended
            except OSError as e:
                return not_started(f"cannot prepare the sandbox of {dirs.root}: {e}")
            argv = replace(sandbox, relay_socket=relay_socket, proxy_port=urlsplit(self.harness_url).port,
                           writable=(dirs.home,),
                           readable=(*sandbox.readable, *self._harness_readable(dirs))).argv(argv)
            env["TMPDIR"] = "/tmp"
        try:
            try:
                process = GroupProcess(argv, cwd=dirs.workspace, env=env, stdout=dirs.stdout, stderr=dirs.stderr,
                                       sandboxed=self.sandboxed)
            except OSError as e:
                return not_started(f"cannot start harness {argv[0]!r}: {e}")
            self.sink.record(ExecutionStarted(execution_id=execution.execution_id, cell_id=execution.cell_id,
                                              workspace=str(dirs.workspace), pid=process.pid))
            ended = process.wait(timeout_s, grace_s=self.config.kill_grace_s, cancel=self._cancel,
                                 held=lambda: self.holds.held_s(execution.execution_id))
        finally:
            if relay_socket is not None:
                assert self._relay is not None
                self._relay.close(relay_socket)
        status, message = self._status(ended, timeout_s, tail(dirs.stderr, self.config.message_chars))
        evaluate = status != "harness_error" or (self.config.evaluate_harness_errors and not ended.cancelled)
        return self._finish(execution, dirs, status, ended.returncode, ended.duration_s, message, evaluate, sandbox)

    def _sandbox(self, execution: Execution, dirs: ExecutionDirs, uid: int | None) -> SandboxSpec:
        """The sandbox both the harness and the evaluator get: the workspace and the configured mounts."""
        base = Path(self.config.config_dir or os.getcwd())
        limits = self.config.limits
        rootfs = None
        if execution.task.spec.rootfs is not None:
            rootfs = execution.task.base_dir / execution.task.spec.rootfs
        elif self.config.rootfs is not None:
            rootfs = base / self.config.rootfs
        return SandboxSpec(
            workspace=dirs.workspace, uid=uid, rootfs=rootfs,
            readable=tuple(base / p for p in self.config.ro_mounts),
            limits=Limits(nproc=limits.nproc or None, nofile=limits.nofile or None,
                          fsize_bytes=(limits.fsize_mb or 0) << 20 or None,
                          memory_bytes=(limits.memory_mb or 0) << 20 or None),
            tmp_bytes=limits.tmp_mb << 20)

    def _harness_readable(self, dirs: ExecutionDirs) -> list[Path]:
        """What the harness alone sees besides its workspace: its home, its task file, its own program."""
        paths = [dirs.task_file]
        templates = [*self.config.command, *self.config.env.values()]
        if self.config.config_dir is not None and any("{config_dir}" in t for t in templates):
            paths.append(Path(self.config.config_dir))  # the harness's own files, bound only when named
        if self.config.home == "inherit" and "HOME" in os.environ:
            paths.append(Path(os.environ["HOME"]))
        return paths

    def _finish(self, execution: Execution, dirs: ExecutionDirs, status: ExecutionStatus, exit_code: int | None,
                duration_s: float, message: str, evaluate: bool,
                sandbox: SandboxSpec | None = None) -> ExecutionResult:
        message = message[-self.config.message_chars:]
        with self.finishing(execution.execution_id):
            position = self.sink.record(ExecutionFinished(execution_id=execution.execution_id, status=status,
                                                          duration_s=duration_s, exit_code=exit_code,
                                                          message=message))
        self.holds.forget(execution.execution_id)  # after `finishing`: no cut holds an ended execution
        outcome = None
        if evaluate:
            scoring = None if sandbox is None else replace(sandbox, writable=(dirs.evaluation,))
            context = EvaluationContext(execution_id=execution.execution_id, task=execution.task.spec,
                                        workspace=dirs.workspace, scratch_dir=dirs.evaluation, status=status,
                                        sandbox=scoring)
            outcome = execution.task.evaluator.evaluate(context)
            position = self.sink.record(outcome.event(execution.execution_id))
        self.sink.commit(position)  # an execution's end and score are durable before its future resolves
        return ExecutionResult(execution.execution_id, execution.task.id, execution.group_id, status, exit_code,
                               duration_s, message, dirs, outcome)

    @staticmethod
    def _status(ended: ProcessOutcome, timeout_s: float, stderr_tail: str) -> tuple[ExecutionStatus, str]:
        said = f": {stderr_tail}" if stderr_tail else ""
        if ended.cancelled:
            return "harness_error", f"cancelled (runner closed); process group killed{said}"
        if ended.timed_out:
            return "timed_out", f"timed out after {timeout_s:g}s; process group killed{said}"
        if ended.returncode == 0:
            return "completed", stderr_tail
        if ended.returncode < 0:
            return "harness_error", f"killed by {signal.Signals(-ended.returncode).name}{said}"
        return "harness_error", f"exit code {ended.returncode}{said}"

    # -- what the harness sees ------------------------------------------------------------------------------

    def _values(self, execution: Execution, dirs: ExecutionDirs, timeout_s: float,
                started_at: float) -> dict[str, str]:
        spec = execution.task.spec
        return {
            "prompt": spec.prompt,
            "task_file": str(dirs.task_file),
            "workspace": str(dirs.workspace),
            "answer_file": spec.answer_file,
            "task_id": spec.id,
            "execution_id": execution.execution_id,
            "group_id": execution.group_id,
            "attempt": str(execution.attempt),
            "policy_version": str(execution.policy_version),
            "model": self.config.model,
            "proxy_url": self.harness_url,
            "openai_base_url": f"{self.harness_url}/v1",
            "home": self._home(dirs),
            "python": sys.executable,
            "config_dir": self.config.config_dir or os.getcwd(),
            "timeout_s": f"{timeout_s:g}",
            "started_at": f"{started_at:.4f}",
        }

    def _home(self, dirs: ExecutionDirs) -> str:
        if self.config.home == "inherit" and "HOME" in os.environ:
            return os.environ["HOME"]
        return str(dirs.home)

    def _env(self, execution: Execution, dirs: ExecutionDirs, values: Mapping[str, str]) -> dict[str, str]:
        """Inherited basics < the proxy variables < `HarnessConfig.env` < `Execution.env`."""
        env = {k: os.environ[k] for k in self.config.inherit_env if k in os.environ}
        env.setdefault("PATH", os.defpath)
        env["HOME"] = values["home"]
        token, model = execution.token, self.config.model
        env |= {
            "ANTHROPIC_BASE_URL": self.harness_url,
            "ANTHROPIC_AUTH_TOKEN": token,
            "ANTHROPIC_API_KEY": token,
            "ANTHROPIC_MODEL": model,
            "OPENAI_BASE_URL": values["openai_base_url"],
            "OPENAI_API_KEY": token,
            "OPENAI_MODEL": model,
            "GYRE_EXECUTION_ID": execution.execution_id,
            "GYRE_TASK_ID": execution.task.id,
        }
        templates = self.config.env
        expanded = expand_all(list(templates.values()), {**values, "token": token},
                              where=f"harness {self.config.name!r} env")
        env |= dict(zip(templates, expanded, strict=True))
        env |= execution.env
        return env
