"""Inside an evaluation sandbox: call a Python evaluator on a copy of its context, write what it returned.

    python -I sandbox_evaluate.py REQUEST RESULT

REQUEST (JSON, written by `PythonEvaluator`): `path` (directories to import from), `function` (`{"file",
"name"}` for a task set's `file.py:name`, else `{"pickle"}`: a module-level function by reference),
`context` (the `EvaluationContext` as plain values) and `memory_bytes` (for the message of a `MemoryError`).
RESULT (JSON): `{"reward", "details"}`, or `{"error": "crash" | "infrastructure", "message"}`.

Standard library only, like `sandbox_init`: importing the gyre package (pydantic, pyarrow) would cost about a
second per evaluation; so the evaluator gets a plain copy of its context with the same attributes
(`task` carries the task spec's fields) rather than the pydantic objects. RESULT is emptied first: an empty
file after the run means the function's process died without an answer; no file, that it never got here.
"""

import base64
import importlib.util
import json
import pickle
import sys
import traceback
import types
from pathlib import Path


class Context:
    """What an evaluator reads of `EvaluationContext`, from plain values."""

    def __init__(self, doc):
        self.execution_id = doc["execution_id"]
        self.task = types.SimpleNamespace(**doc["task"])
        self.workspace = Path(doc["workspace"])
        self.scratch_dir = Path(doc["scratch_dir"])
        self.status = doc["status"]
        self.sandbox = None  # already inside it

    @property
    def partial(self):
        return self.status == "timed_out"

    @property
    def answer_path(self):
        return self.workspace / self.task.answer_file


def load(function):
    if "file" in function:
        spec = importlib.util.spec_from_file_location(f"gyre_evaluator_{Path(function['file']).stem}", function["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, function["name"])
    return pickle.loads(base64.b64decode(function["pickle"]))


def answer(result):
    """A reward, `(reward, details)` or a `Score` (anything with `reward` and `details`) as JSON."""
    if hasattr(result, "reward") and hasattr(result, "details"):
        reward, details = result.reward, result.details
    elif isinstance(result, tuple) and len(result) == 2:
        reward, details = result
    else:
        reward, details = result, {}
    try:
        return json.dumps({"reward": reward, "details": dict(details) if hasattr(details, "keys") else details})
    except (TypeError, ValueError) as e:
        return json.dumps({"error": "crash", "message": f"the result is not JSON-serialisable: {e}"})


def failure(kind, e):
    where = traceback.extract_tb(e.__traceback__)[-1:]
    at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
    return json.dumps({"error": kind, "message": f"{type(e).__name__}: {e}{at}"})


def main(request_path, result_path):
    result = Path(result_path)
    result.write_text("")
    request = json.loads(Path(request_path).read_text())
    sys.path[:0] = request["path"]
    try:
        function = load(request["function"])
    except BaseException as e:  # a function that cannot be loaded here is infrastructure
        result.write_text(failure("infrastructure", e))
        return
    try:
        said = answer(function(Context(request["context"])))
    except MemoryError:
        limit = request["memory_bytes"]
        said = json.dumps({"error": "crash", "message": "MemoryError: out of memory (limit "
                           f"{'none' if limit is None else f'{limit >> 20} MiB'})"})
    except BaseException as e:  # SystemExit too: the caller reports it as a crash
        said = failure("crash", e)
    result.write_text(said)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
