"""Calling a Python function in a killable child process with a memory and a time limit.

A thread cannot be killed and an out-of-memory error in it takes the whole runner down, so an in-process
evaluator runs in a child instead. Children are forked from a warm parent (multiprocessing's
`forkserver`, started once per process with the harness modules imported): a fresh child costs a fork,
not an interpreter start, and the runner's own threads are never forked (forking a threaded process can
deadlock the child on a lock another thread held).

The child leads its own session, so whatever it starts dies with it; it limits its address space
(`RLIMIT_AS`) before calling the function, so a runaway allocation raises `MemoryError` in the child.
The function and its argument travel by pickle: a module-level function, or a `FileFunction`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generic, TypeVar

from gyre.harness.process import TAG_VAR, kill_tagged, new_tag

T = TypeVar("T")
R = TypeVar("R")

_STARTED = "started"
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["gyre.harness.evaluators"])


@dataclass(frozen=True)
class FileFunction:
    """`name` from the Python file `path`: picklable by its path, loaded again where it is called.

    A module loaded from a file path is not importable by name, so pickling the function itself would fail
    in the child; this carries the reference instead.
    """

    path: Path
    name: str
    _cache: dict[str, Callable[..., Any]] = field(default_factory=dict, compare=False, repr=False)

    def load(self) -> Callable[..., Any]:
        """The function; raises `ImportError`, `OSError`, `SyntaxError` or `AttributeError` naming the cause."""
        if "f" not in self._cache:
            digest = hashlib.sha1(str(self.path).encode()).hexdigest()[:12]
            spec = importlib.util.spec_from_file_location(f"gyre_evaluator_{self.path.stem}_{digest}", self.path)
            if spec is None or spec.loader is None:
                raise ImportError(f"not a Python file: {self.path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            function = getattr(module, self.name, None)
            if not callable(function):
                raise AttributeError(f"{self.path.name!r} has no callable {self.name!r}")
            self._cache["f"] = function
        return self._cache["f"]

    def __call__(self, *args: Any) -> Any:
        return self.load()(*args)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "_cache": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)


@dataclass(frozen=True)
class Returned(Generic[R]):
    """The function returned; `value` is what `finish` made of its result, in the child."""

    value: R


@dataclass(frozen=True)
class Raised:
    """The function raised: `kind` is `memory` for a `MemoryError` (the limit was hit), else `exception`."""

    kind: str
    message: str


@dataclass(frozen=True)
class Died:
    """The child ended without an answer: killed at the time limit (`timed_out`) or exited on its own.

    `started` is False when it died before reaching the function: multiprocessing could not prepare it
    (the parent's `__main__` is not importable, say), a failure of the infrastructure, not of the function.
    """

    timed_out: bool
    exitcode: int | None
    started: bool


Ended = Returned[R] | Raised | Died


def check_picklable(function: Callable[..., Any]) -> None:
    """Raises `TypeError` when `function` cannot be sent to a child (a lambda or a nested function)."""
    try:
        pickle.dumps(function)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(f"{function!r} cannot run in a subprocess: it must be a module-level function "
                        f"(or a FileFunction) so that it pickles by reference ({e})") from e


def call_in_child(function: Callable[[T], object], argument: T, finish: Callable[[object], R], *,
                  timeout_s: float, memory_bytes: int | None, stdout: Path, stderr: Path) -> Ended[R]:
    """Run `finish(function(argument))` in a fresh child; never raises for what the function does.

    `finish` runs in the child too, so that a result which does not pickle (or is not valid) is judged
    there. Raises `OSError` only when no child could be started.
    """
    receiver, sender = _CONTEXT.Pipe(duplex=False)
    tag = new_tag()
    process = _CONTEXT.Process(target=_child, args=(sender, tag, function, argument, finish, memory_bytes, stdout,
                                                     stderr), name="gyre-evaluator", daemon=True)
    try:
        process.start()
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        receiver.close()
        raise OSError(f"cannot send the function to a child process: {e}") from e
    finally:
        sender.close()
    try:
        deadline = time.monotonic() + timeout_s
        answer: Returned[R] | Raised | None = None
        started = timed_out = False
        while answer is None:
            ready = multiprocessing.connection.wait([receiver, process.sentinel], max(0.0, deadline - time.monotonic()))
            if not ready:
                timed_out = True
                break
            if receiver not in ready and not receiver.poll(0):
                break  # exited without a word
            try:
                message = receiver.recv()
            except EOFError:  # the pipe closed: the child is gone
                break
            if message == _STARTED:
                started = True
            else:
                answer = message
        # Whatever the child started in its session goes too (it is also how a timed-out child is killed).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        kill_tagged(tag, process.pid)
        process.join()
        return answer if answer is not None else Died(timed_out, process.exitcode, started)
    finally:
        receiver.close()
        process.close()


def _child(sender: Connection, tag: str, function: Callable[[T], object], argument: T,
           finish: Callable[[object], R], memory_bytes: int | None, stdout: Path, stderr: Path) -> None:
    os.setsid()
    sender.send(_STARTED)
    os.environ[TAG_VAR] = tag  # what it starts inherits the tag, so one that leaves the session is found
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    answer: Returned[R] | Raised
    try:
        answer = Returned(finish(function(argument)))
    except MemoryError:
        answer = Raised("memory", f"MemoryError: out of memory (limit {_mib(memory_bytes)})")
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the caller reports it as a crash
        where = traceback.extract_tb(e.__traceback__)[-1:]
        at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
        answer = Raised("exception", f"{type(e).__name__}: {e}{at}")
    sender.send(answer)
    sender.close()


def _mib(memory_bytes: int | None) -> str:
    return "none" if memory_bytes is None else f"{memory_bytes >> 20} MiB"
