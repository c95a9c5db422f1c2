"""The toy agent's tools: write_file, read_file, run (and the schema of delegate, which the agent runs).

Standard library only. Every path is resolved inside the workspace; a tool that fails returns an error
text to the model (the way real harnesses report tool errors) instead of stopping the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


SCHEMAS: dict[str, dict[str, Any]] = {
    "write_file": _function("write_file", "Write text to a file in the workspace (replaces it).",
                            {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    "read_file": _function("read_file", "Read a text file from the workspace.",
                           {"path": {"type": "string"}}, ["path"]),
    "run": _function("run", "Run a shell command in the workspace; returns exit code and output.",
                     {"command": {"type": "string"}, "timeout_s": {"type": "number"}}, ["command"]),
    "delegate": _function("delegate", "Hand a sub-task to a sub-agent; returns its final answer.",
                          {"task": {"type": "string"}}, ["task"]),
}

ARGUMENT_TYPES: dict[str, dict[str, type | tuple[type, ...]]] = {
    "write_file": {"path": str, "content": str},
    "read_file": {"path": str},
    "run": {"command": str, "timeout_s": (int, float)},
    "delegate": {"task": str},
}


class MalformedToolCall(ValueError):
    """The model's tool call cannot be executed as written: unknown tool, bad JSON, wrong arguments."""


class ToolFailed(RuntimeError):
    """A well-formed tool call that failed (missing file, path outside the workspace, ...)."""


def parse_arguments(name: str, raw: str | None, allowed: set[str]) -> dict[str, Any]:
    """The call's arguments as a dict, checked against the tool's schema; `MalformedToolCall` otherwise."""
    if name not in allowed:
        raise MalformedToolCall(f"unknown tool {name!r}; available: {', '.join(sorted(allowed))}")
    try:
        arguments = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise MalformedToolCall(f"arguments of {name} are not valid JSON ({e.msg} at {e.pos})") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f"arguments of {name} must be a JSON object")
    types = ARGUMENT_TYPES[name]
    required = SCHEMAS[name]["function"]["parameters"]["required"]
    missing = [k for k in required if k not in arguments]
    if missing:
        raise MalformedToolCall(f"{name} needs {', '.join(missing)}")
    for key, value in arguments.items():
        if key not in types:
            raise MalformedToolCall(f"{name} has no argument {key!r}")
        if isinstance(value, bool) or not isinstance(value, types[key]):
            raise MalformedToolCall(f"argument {key!r} of {name} has the wrong type")
    return arguments


@dataclass
class WorkspaceTools:
    """The file and shell tools, confined to `root`. Remembers what it wrote (for the plain-text fallback)."""

    root: Path
    run_timeout_s: float = 10.0
    output_chars: int = 2000
    written: set[Path] = field(default_factory=set)

    def resolve(self, path: str) -> Path:
        target = (self.root / path).resolve()
        if target != self.root and self.root not in target.parents:
            raise ToolFailed(f"path {path!r} is outside the workspace")
        return target

    def write_file(self, path: str, content: str) -> str:
        target = self.resolve(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8", errors="replace")
        except OSError as e:
            raise ToolFailed(f"cannot write {path}: {e.strerror}") from e
        self.written.add(target)
        return f"wrote {len(content)} characters to {path}"

    def read_file(self, path: str) -> str:
        try:
            text = self.resolve(path).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ToolFailed(f"cannot read {path}: {e.strerror}") from e
        return text[: self.output_chars]

    def run(self, command: str, timeout_s: float | None = None) -> str:
        """`sh -c command` in its own process group; on timeout the whole group is killed."""
        limit = self.run_timeout_s if timeout_s is None else max(0.1, min(float(timeout_s), self.run_timeout_s))
        process = subprocess.Popen(["/bin/sh", "-c", command], cwd=self.root, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=limit)
            status = f"exit code {process.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            status = f"timed out after {limit:g}s"
        text = output.decode("utf-8", errors="replace")
        return f"{status}\n{text[-self.output_chars:]}"

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        if name == "write_file":
            return self.write_file(arguments["path"], arguments["content"])
        if name == "read_file":
            return self.read_file(arguments["path"])
        if name == "run":
            return self.run(arguments["command"], arguments.get("timeout_s"))
        raise MalformedToolCall(f"tool {name!r} is not a workspace tool")
