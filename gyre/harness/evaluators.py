"""The two evaluator types: a command run on the workspace, and a Python function called in-process.

Both turn every failure of their own into a `FailureOutcome` (crash | timeout | infrastructure) with a
message; a score comes back only when the evaluator finished and produced a valid reward.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import json
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast, get_args

from gyre.errors import ConfigError
from gyre.events.fields import EvaluationFailure
from gyre.harness.bwrap import SandboxSpec, give_to, interpreter_paths
from gyre.harness.config import (
    DEFAULT_EVALUATOR_MEMORY_MB,
    DEFAULT_INHERITED_ENV,
    CommandEvaluatorConfig,
    EvaluatorConfig,
    PythonEvaluatorConfig,
)
from gyre.harness.evaluation import (
    EvaluationContext,
    EvaluationOutcome,
    Evaluator,
    FailureOutcome,
    Score,
    checked_outcome,
)
from gyre.harness.process import GroupProcess, tail
from gyre.harness.sandbox import FileFunction, Raised, Returned, call_in_child, check_picklable
from gyre.harness.template import expand_all

MESSAGE_CHARS = 800
EVALUATE_SCRIPT = Path(__file__).with_name("sandbox_evaluate.py")
FAILURE_KINDS: tuple[str, ...] = get_args(EvaluationFailure)


def grading_document(context: EvaluationContext) -> dict[str, object]:
    """What `{grading_file}` holds: the task's grading table and how the execution ended."""
    return {"task_id": context.task.id, "execution_id": context.execution_id,
            "answer_file": context.task.answer_file, "grading": context.task.grading,
            "status": context.status, "partial": context.partial}


class CommandEvaluator:
    """Runs a program in the workspace with its own timeout; reads a JSON result from its last stdout line.

    The program runs in its own process group, so a test it starts that hangs is killed with it. Given a
    sandbox (`EvaluationContext.sandbox`), it runs in it: the preserved workspace and its scratch directory
    writable, the task set's directory (its grader, the grading files) read-only and seen by it alone, no
    network, the execution's uid and limits, `memory_mb` as its address-space limit.
    """

    def __init__(self, config: CommandEvaluatorConfig, taskset_dir: Path) -> None:
        self.config = config
        self.name = config.name
        self.taskset_dir = taskset_dir

    def evaluate(self, context: EvaluationContext) -> EvaluationOutcome:
        started = time.monotonic()

        def failed(error: EvaluationFailure, message: str) -> FailureOutcome:
            return FailureOutcome(self.name, error, message[-MESSAGE_CHARS:], context.partial,
                                  time.monotonic() - started)

        if not context.workspace.is_dir():
            return failed("infrastructure", f"workspace {context.workspace} does not exist")
        scratch = context.scratch_dir
        grading_file = scratch / "grading.json"
        try:
            scratch.mkdir(parents=True, exist_ok=True)
            grading_file.write_text(json.dumps(grading_document(context), indent=2))
        except OSError as e:
            return failed("infrastructure", f"cannot write the grading file {grading_file}: {e}")
        values = {"python": sys.executable, "workspace": str(context.workspace),
                  "answer_file": context.task.answer_file, "grading_file": str(grading_file),
                  "task_id": context.task.id, "execution_id": context.execution_id,
                  "taskset_dir": str(self.taskset_dir), "status": context.status,
                  "partial": "1" if context.partial else "0"}
        where = f"evaluator {self.name!r}"
        argv = expand_all(self.config.command, values, where=where + " command")
        env = evaluator_env(scratch)
        env |= dict(zip(self.config.env, expand_all(list(self.config.env.values()), values, where=where + " env"),
                        strict=True))
        stdout, stderr = scratch / "evaluator.stdout", scratch / "evaluator.stderr"
        memory_bytes = None if self.config.memory_mb is None else self.config.memory_mb << 20
        if context.sandbox is not None:
            try:
                argv = evaluation_sandbox(context, (self.taskset_dir,), memory_bytes).argv(argv)
            except OSError as e:
                return failed("infrastructure", f"cannot hand the scratch directory {scratch} to the sandbox: {e}")
            env["TMPDIR"] = "/tmp"
            memory_bytes = None  # set inside, with the other limits
        try:
            process = GroupProcess(argv, cwd=context.workspace, env=env, stdout=stdout, stderr=stderr,
                                   memory_bytes=memory_bytes, sandboxed=context.sandbox is not None)
        except OSError as e:
            return failed("infrastructure", f"cannot start evaluator command {argv[0]!r}: {e}")
        ended = process.wait(self.config.timeout_s, grace_s=self.config.kill_grace_s)
        if ended.timed_out:
            return failed("timeout", f"evaluator timed out after {self.config.timeout_s:g}s; "
                                     f"stderr: {tail(stderr, MESSAGE_CHARS)}")
        if ended.returncode != 0:
            return failed("crash", f"evaluator exited with code {ended.returncode}: {tail(stderr, MESSAGE_CHARS)}")
        lines = [line for line in stdout.read_text(errors="replace").splitlines() if line.strip()]
        if not lines:
            return failed("crash", f"evaluator printed nothing; stderr: {tail(stderr, MESSAGE_CHARS)}")
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError as e:
            return failed("crash", f"evaluator's last line is not JSON ({e}): {lines[-1][:200]!r}")
        if not isinstance(result, dict):
            return failed("crash", f"evaluator's last line is not a JSON object: {lines[-1][:200]!r}")
        return reported_outcome(self.name, result, partial=context.partial, duration_s=time.monotonic() - started)


class PythonEvaluator:
    """Calls `function(context)` in a child process with a time and a memory limit (see `sandbox`).

    The function returns a reward, `(reward, details)` or a `Score`; whatever it raises is a crash, an
    exhausted memory limit too, and a child that dies (`os._exit`, a signal) or overruns `timeout_s` is
    killed with everything it started: the runner only ever sees an outcome. The function must pickle by
    reference: a module-level function, or what `load_function` returns for a `file.py:name`.

    Given a sandbox (`EvaluationContext.sandbox`), it runs there like a command evaluator, through
    `sandbox_evaluate` in a fresh interpreter: its task set's directory and the package that defines it are
    mounted read-only (seen by it alone); other modules it imports must be installed in the interpreter. It
    gets a plain copy of the context (same attributes) and its result must be JSON. Unsandboxed, it is
    called in a child forked from a warm parent (`gyre.harness.sandbox`).
    """

    def __init__(self, function: Callable[[EvaluationContext], object], *, name: str = "python",
                 timeout_s: float = 60.0, memory_mb: int | None = DEFAULT_EVALUATOR_MEMORY_MB,
                 taskset_dir: Path | None = None) -> None:
        """Raises `TypeError` when `function` cannot be sent to a child (a lambda, a nested function).
        `taskset_dir`: mounted in its sandbox (default: a `file.py` function's directory)."""
        check_picklable(function)
        self.function = function
        self.name = name
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.taskset_dir = taskset_dir

    def evaluate(self, context: EvaluationContext) -> EvaluationOutcome:
        started = time.monotonic()

        def failed(error: EvaluationFailure, message: str) -> FailureOutcome:
            return FailureOutcome(self.name, error, message[-MESSAGE_CHARS:], context.partial,
                                  time.monotonic() - started)

        if not context.workspace.is_dir():
            return failed("infrastructure", f"workspace {context.workspace} does not exist")
        stdout, stderr = context.scratch_dir / "evaluator.stdout", context.scratch_dir / "evaluator.stderr"
        if context.sandbox is not None:
            return self._evaluate_in_sandbox(context, failed, stdout, stderr)
        try:
            context.scratch_dir.mkdir(parents=True, exist_ok=True)
            ended = call_in_child(self.function, context, functools.partial(_score, self.name, context.partial),
                                  timeout_s=self.timeout_s, stdout=stdout, stderr=stderr,
                                  memory_bytes=None if self.memory_mb is None else self.memory_mb << 20)
        except OSError as e:
            return failed("infrastructure", f"cannot start evaluator {self.name!r} in a child process: {e}")
        if isinstance(ended, Returned):
            return dataclasses.replace(ended.value, duration_s=time.monotonic() - started)
        if isinstance(ended, Raised):
            return failed("crash", ended.message)
        said = tail(stderr, MESSAGE_CHARS)
        said = f"; stderr: {said}" if said else ""
        if ended.timed_out:
            return failed("timeout", f"evaluator {self.name!r} did not return within {self.timeout_s:g}s{said}")
        if not ended.started:
            return failed("infrastructure", f"the child process of evaluator {self.name!r} "
                                            f"{_exit_reason(ended.exitcode)} before calling it (see the "
                                            "runner's stderr; a script must guard its entry point with "
                                            "`if __name__ == '__main__':`)")
        return failed("crash", f"evaluator {self.name!r} {_exit_reason(ended.exitcode)} without a result{said}")


    def _evaluate_in_sandbox(self, context: EvaluationContext,
                             failed: Callable[[EvaluationFailure, str], FailureOutcome], stdout: Path,
                             stderr: Path) -> EvaluationOutcome:
        started = time.monotonic()
        scratch = context.scratch_dir
        request, result = scratch / "evaluation.request.json", scratch / "evaluation.result.json"
        memory_bytes = None if self.memory_mb is None else self.memory_mb << 20
        function, mounts, path = self._reference()
        try:
            scratch.mkdir(parents=True, exist_ok=True)
            result.unlink(missing_ok=True)
            request.write_text(json.dumps({
                "path": path, "function": function, "memory_bytes": memory_bytes,
                "context": {"execution_id": context.execution_id, "task": context.task.model_dump(mode="json"),
                            "workspace": str(context.workspace), "scratch_dir": str(scratch),
                            "status": context.status}}))
            sandbox = evaluation_sandbox(context, (*mounts, EVALUATE_SCRIPT), memory_bytes)
        except OSError as e:
            return failed("infrastructure", f"cannot prepare the sandbox of evaluator {self.name!r}: {e}")
        argv = sandbox.argv([sys.executable, "-I", "-B", str(EVALUATE_SCRIPT), str(request), str(result)])
        try:
            process = GroupProcess(argv, cwd=context.workspace, env=evaluator_env(scratch), stdout=stdout,
                                   stderr=stderr, sandboxed=True)
        except OSError as e:
            return failed("infrastructure", f"cannot start the sandbox of evaluator {self.name!r}: {e}")
        ended = process.wait(self.timeout_s, grace_s=0.0)
        said = tail(stderr, MESSAGE_CHARS)
        said = f"; stderr: {said}" if said else ""
        if ended.timed_out:
            return failed("timeout", f"evaluator {self.name!r} did not return within {self.timeout_s:g}s{said}")
        try:
            answer = result.read_text()
        except FileNotFoundError:
            return failed("infrastructure", f"the sandbox of evaluator {self.name!r} "
                                            f"{_exit_reason(ended.returncode)} before calling it{said}")
        if not answer:
            return failed("crash", f"evaluator {self.name!r} {_exit_reason(ended.returncode)} without a result{said}")
        return reported_outcome(self.name, json.loads(answer), partial=context.partial,
                                duration_s=time.monotonic() - started)

    def _reference(self) -> tuple[dict[str, str], list[Path], list[str]]:
        """How `sandbox_evaluate` finds the function: its reference, what to mount, where to import from."""
        mounts = [self.taskset_dir] if self.taskset_dir is not None else []
        if isinstance(self.function, FileFunction):
            mounts = mounts or [self.function.path.parent]
            return {"file": str(self.function.path), "name": self.function.name}, mounts, []
        target = self.function.func if isinstance(self.function, functools.partial) else self.function
        top = sys.modules[target.__module__.partition(".")[0]]
        found = [Path(p) for p in getattr(top, "__path__", [])] or [Path(str(top.__file__))]
        found = [p for p in found if not any(p.is_relative_to(i) for i in interpreter_paths())]  # installed: there
        reference = {"pickle": base64.b64encode(pickle.dumps(self.function)).decode()}
        return reference, [*mounts, *found], sorted({str(p.parent) for p in found})


def evaluation_sandbox(context: EvaluationContext, readable: tuple[Path, ...],
                       memory_bytes: int | None) -> SandboxSpec:
    """The execution's sandbox, for its evaluator: the scratch directory writable, `readable` (the grading files,
    the grader) seen by the evaluator alone, `memory_bytes` of address space. Raises `OSError` when the scratch
    directory cannot be handed to the sandbox's uid."""
    assert context.sandbox is not None
    sandbox = context.sandbox
    sandbox = dataclasses.replace(sandbox, readable=(*sandbox.readable, *readable),
                                  writable=tuple(dict.fromkeys((*sandbox.writable, context.scratch_dir))),
                                  limits=dataclasses.replace(sandbox.limits, memory_bytes=memory_bytes))
    give_to(sandbox.uid, context.scratch_dir)
    return sandbox


def evaluator_env(scratch: Path) -> dict[str, str]:
    """An evaluator process's environment: the basics, its scratch directory as home, no bytecode files."""
    env = {k: os.environ[k] for k in DEFAULT_INHERITED_ENV if k in os.environ}
    env.setdefault("PATH", os.defpath)
    env |= {"HOME": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}  # leave the workspace as the agent did
    return env


def reported_outcome(evaluator: str, result: dict[str, object], *, partial: bool,
                     duration_s: float) -> EvaluationOutcome:
    """What an evaluator process reported: `{"reward", "details"}` or `{"error": kind, "message"}`."""
    if "error" in result:
        error, message = result["error"], str(result.get("message", ""))
        if error not in FAILURE_KINDS:
            error, message = "crash", f"evaluator reported unknown error kind {error!r}: {message}"
        return FailureOutcome(evaluator, cast(EvaluationFailure, error), message[-MESSAGE_CHARS:], partial, duration_s)
    return checked_outcome(evaluator, result.get("reward"), result.get("details", {}), partial=partial,
                           duration_s=duration_s)


def _score(evaluator: str, partial: bool, result: object) -> EvaluationOutcome:
    """What a Python evaluator's result means; runs in the child, so a result that does not pickle is fine."""
    if isinstance(result, Score):
        reward, details = result.reward, result.details
    elif isinstance(result, tuple) and len(result) == 2:
        reward, details = result
    else:
        reward, details = result, {}
    return checked_outcome(evaluator, reward, details, partial=partial, duration_s=0.0)


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def load_function(reference: str, base_dir: Path) -> Callable[[EvaluationContext], object]:
    """`module.path:name` (imported) or `file.py:name` (loaded from `base_dir`), as a `ConfigError` if missing.

    A `file.py` function comes back as a `FileFunction`, which a child process can load again.
    """
    module_ref, _, attr = reference.rpartition(":")
    try:
        if module_ref.endswith(".py"):
            function: object = FileFunction((base_dir / module_ref).resolve(), attr)
            cast(FileFunction, function).load()
        else:
            function = getattr(importlib.import_module(module_ref), attr, None)
    except AttributeError as e:
        raise ConfigError(f"python evaluator {reference!r}: {module_ref!r} has no callable {attr!r}") from e
    except (ImportError, OSError, SyntaxError) as e:
        raise ConfigError(f"python evaluator {reference!r}: cannot load {module_ref!r}: {e}") from e
    if not callable(function):
        raise ConfigError(f"python evaluator {reference!r}: {module_ref!r} has no callable {attr!r}")
    return function


def build_evaluator(config: EvaluatorConfig, taskset_dir: Path) -> Evaluator:
    if isinstance(config, CommandEvaluatorConfig):
        return CommandEvaluator(config, taskset_dir)
    assert isinstance(config, PythonEvaluatorConfig)
    return PythonEvaluator(load_function(config.function, taskset_dir), name=config.name,
                           timeout_s=config.timeout_s, memory_mb=config.memory_mb, taskset_dir=taskset_dir)
