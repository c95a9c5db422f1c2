"""Graded partial credit for the toy tasks: similarity to the expected answer and unit checks passed.

Standard library only, and independent of Gyre: `evaluate.py` runs it as a command evaluator, and a task set
may name `grading.py:evaluate` as an in-process Python evaluator instead.

Why graded: a random-init model cannot pass a test, so an all-or-nothing reward would be 0 for every
rollout and every group advantage would vanish. Character similarity (difflib's ratio: 2 * matched / total
length) is > 0 for nearly any text and rises smoothly as the text approaches the answer; the fraction of
unit checks passed takes over once code starts to work. A reward is 1.0 only for an exact answer.

Kinds of `grading` table:
    text    expected: str, ignore_case: bool = false          reward = similarity (1.0 iff equal)
    python  checks: [expr], reference: str, similarity_weight  reward = (1-w) * checks passed + w * similarity
    json    expected: object                                   reward = 0.5 * keys right + 0.5 * similarity
A missing answer file scores 0.0: the agent produced nothing, which is a real outcome, not an error. A
`grading` table this module does not understand raises: that is a broken task set, an evaluator crash.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_ANSWER_CHARS = 4000
"""Longer answers are cut before comparing: similarity is quadratic in length, and a long answer to a short
question is far from right anyway (its ratio is small because the lengths differ)."""
CHECK_TIMEOUT_S = 5.0

CHECKER = r"""
import json, sys
path, checks = sys.argv[1], json.loads(sys.argv[2])
namespace = {"__name__": "solution"}
try:
    with open(path, encoding="utf-8", errors="replace") as f:
        exec(compile(f.read(), path, "exec"), namespace)
    load_error = None
except BaseException as e:  # untrusted code: any failure to load fails every check
    load_error = f"{type(e).__name__}: {e}"[:200]
passed = []
for check in checks:
    try:
        passed.append(load_error is None and bool(eval(check, dict(namespace))))
    except BaseException:  # a check that raises has failed
        passed.append(False)
sys.stdout.write("\n" + json.dumps({"passed": passed, "load_error": load_error}) + "\n")
"""


def similarity(answer: str, expected: str) -> float:
    return difflib.SequenceMatcher(None, answer[:MAX_ANSWER_CHARS], expected, autojunk=False).ratio()


def grade(grading: dict[str, Any], workspace: Path, answer_file: str) -> tuple[float, dict[str, Any]]:
    """(reward in [0, 1], details) for the workspace's answer file."""
    kind = grading.get("kind")
    path = workspace / answer_file
    if kind not in ("text", "python", "json"):
        raise ValueError(f"unknown grading kind {kind!r} (text | python | json)")
    if not path.is_file():
        return 0.0, {"kind": kind, "answer_file": answer_file, "missing": True}
    text = path.read_text(encoding="utf-8", errors="replace")
    details: dict[str, Any] = {"kind": kind, "answer_file": answer_file, "answer_chars": len(text)}
    if kind == "text":
        return _grade_text(grading, text, details)
    if kind == "python":
        return _grade_python(grading, path, text, details)
    return _grade_json(grading, text, details)


def _grade_text(grading: dict[str, Any], text: str, details: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    expected = str(grading["expected"])
    answer = text.strip()
    if grading.get("ignore_case", False):
        answer, expected = answer.lower(), expected.lower()
    score = similarity(answer, expected.strip())
    return score, details | {"similarity": round(score, 4), "exact": answer == expected.strip()}


def _grade_python(grading: dict[str, Any], path: Path, text: str,
                  details: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    checks = [str(c) for c in grading["checks"]]
    weight = float(grading.get("similarity_weight", 0.2))
    passed, problem = run_checks(path, checks)
    fraction = sum(passed) / len(checks)
    sim = similarity(text, str(grading.get("reference", "")))
    reward = 1.0 if all(passed) else (1.0 - weight) * fraction + weight * sim
    details |= {"checks_passed": sum(passed), "checks": len(checks), "similarity": round(sim, 4)}
    if problem:
        details["problem"] = problem
    return reward, details


def _grade_json(grading: dict[str, Any], text: str, details: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    expected = grading["expected"]
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if parsed == expected:
        return 1.0, details | {"exact": True}
    right = sum(1 for k, v in expected.items() if isinstance(parsed, dict) and parsed.get(k) == v)
    keys = right / len(expected) if expected else 0.0
    sim = similarity(text.strip(), json.dumps(expected))
    return 0.5 * keys + 0.5 * sim, details | {"keys_right": right, "keys": len(expected), "similarity": round(sim, 4),
                                              "parsed": parsed is not None}


def run_checks(path: Path, checks: list[str]) -> tuple[list[bool], str | None]:
    """Which checks pass when `path` is loaded in a fresh interpreter; a failure of the solution's code is a
    failed check (with the reason), never an error of the evaluator."""
    process = subprocess.Popen([sys.executable, "-I", "-c", CHECKER, str(path), json.dumps(checks)],
                               cwd=path.parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    try:
        out, _ = process.communicate(timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()  # what it spawned stays in the evaluator's process group, which Gyre kills afterwards
        process.wait()
        return [False] * len(checks), f"checks timed out after {CHECK_TIMEOUT_S:g}s"
    lines = out.decode("utf-8", errors="replace").strip().splitlines()
    try:
        result = json.loads(lines[-1])
        passed = [bool(p) for p in result["passed"]]
    except (IndexError, json.JSONDecodeError, KeyError, TypeError):
        return [False] * len(checks), f"the solution stopped the checker (exit code {process.returncode})"
    if len(passed) != len(checks):
        return [False] * len(checks), "the checker reported the wrong number of checks"
    return passed, result.get("load_error")


def evaluate(context: Any) -> tuple[float, dict[str, Any]]:
    """In-process entry point (`function = "grading.py:evaluate"`): takes Gyre's EvaluationContext."""
    return grade(dict(context.task.grading), Path(context.workspace), context.task.answer_file)
