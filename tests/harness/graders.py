"""Python evaluators of the harness tests, in a module that imports nothing of Gyre.

A sandboxed Python evaluator runs in a fresh interpreter that imports its function's module (by reference):
this one costs nothing to import, where the test helpers would pull in the whole harness package.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre.harness import EvaluationContext


def read_answer(context: EvaluationContext) -> tuple[float, dict[str, Any]]:
    """An in-process evaluator: 1.0 when answer.txt says hello, 0.5 for any other text, 0.0 without a file."""
    path = context.answer_path
    if not path.exists():
        return 0.0, {"missing": True}
    text = path.read_text().strip()
    return (1.0 if text == "hello" else 0.5), {"text": text[:40]}


# Python evaluators run in a child process, so they are module-level functions (they pickle by reference).

def constant(result: object, _context: EvaluationContext) -> object:
    """Returns `result` (bind it with functools.partial)."""
    return result


def divides_by_zero(_context: EvaluationContext) -> float:
    return 1 / 0


def raises_key_error(_context: EvaluationContext) -> float:
    raise KeyError("expected")


def exits(_context: EvaluationContext) -> float:
    sys.exit(3)


def exits_hard(_context: EvaluationContext) -> float:
    os._exit(7)


def allocates_forever(_context: EvaluationContext) -> float:
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))


def loops_forever(context: EvaluationContext) -> float:
    (context.scratch_dir / "looping").touch()
    while True:
        pass


def probes_its_sandbox(context: EvaluationContext) -> tuple[float, dict[str, Any]]:
    """Reports what it can see: the paths named in the task's grading, its uid, the processes around it."""
    seen = {name: os.path.exists(path) for name, path in context.task.grading.items()}
    return 1.0, {"seen": seen, "uid": os.getuid(), "processes": sum(p.isdigit() for p in os.listdir("/proc"))}
