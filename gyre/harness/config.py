"""Configuration of the harness runner and of evaluators: pydantic models, validated when loaded.

A harness is any command line. Claude Code, the bundled toy agent or a shell one-liner differ only in
their `HarnessConfig`, never in code; every placeholder is checked when the configuration is built, so a
typo fails at start-up with the list of known names instead of halfway through a run.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from gyre.errors import ConfigError
from gyre.harness.template import check_templates

HARNESS_PLACEHOLDERS: dict[str, str] = {
    "prompt": "the task's prompt text (one argument, however many spaces or quotes it holds)",
    "task_file": "a file holding the prompt (outside the workspace), for long prompts or harnesses that read files",
    "workspace": "absolute path of the execution's workspace; also the harness's working directory",
    "answer_file": "the task's answer file, relative to the workspace (where a plain-text answer belongs)",
    "task_id": "the task's id",
    "execution_id": "the execution's id",
    "group_id": "the execution's GSPO group",
    "attempt": "the attempt number (0 for the first)",
    "policy_version": "the policy version the execution samples from",
    "model": "the model name the harness should ask for (HarnessConfig.model)",
    "proxy_url": "the proxy's base URL (what ANTHROPIC_BASE_URL holds)",
    "openai_base_url": "the proxy's OpenAI base URL, `{proxy_url}/v1` (what OPENAI_BASE_URL holds)",
    "home": "the HOME directory the harness gets",
    "python": "the Python interpreter running Gyre (sys.executable)",
    "config_dir": "the directory of the configuration file (the current directory when built in code)",
    "timeout_s": "the execution's wall-clock limit in seconds",
    "started_at": "when the runner began the execution (Unix seconds, before its workspace and sandbox were made): "
                  "what a harness that paces itself measures its start-up from",
}
"""Placeholders of `HarnessConfig.command` and `HarnessConfig.env`."""

ENV_ONLY_PLACEHOLDERS: dict[str, str] = {
    "token": "the execution token (env only: command lines are visible to every user through `ps`)",
}

EVALUATOR_PLACEHOLDERS: dict[str, str] = {
    "python": "the Python interpreter running Gyre (sys.executable)",
    "workspace": "absolute path of the workspace to score; also the evaluator's working directory",
    "answer_file": "the task's answer file, relative to the workspace",
    "grading_file": "a JSON file (outside the workspace) with task_id, answer_file, grading, status, partial",
    "task_id": "the task's id",
    "execution_id": "the execution's id",
    "taskset_dir": "the directory of the task set file (where its evaluator scripts live)",
    "status": "how the execution ended: completed | timed_out | harness_error",
    "partial": "1 when the execution timed out (partial evaluation), else 0",
}
"""Placeholders of `CommandEvaluatorConfig.command` and `.env`."""

DEFAULT_INHERITED_ENV: tuple[str, ...] = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
"""Variables a harness inherits from Gyre's environment. Everything else (credentials above all) stays out."""


DEFAULT_EVALUATOR_MEMORY_MB = 8192
"""Address-space limit of an evaluator process (RLIMIT_AS, MiB): it counts reserved virtual memory, so a
runtime that reserves large arenas (a JVM, V8's WebAssembly) may need a higher one, or None (no limit)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SandboxLimits(_Frozen):
    """rlimits of a sandboxed execution (and its evaluator), set before the harness starts; None: no limit.

    `nproc` counts the processes and threads of the execution's own uid (one per running execution), so a
    fork bomb stops there; `memory_mb` is address space (RLIMIT_AS), which runtimes that reserve large
    arenas exceed long before they use that much memory: Node (Claude Code, Codex) reserves ~10 GiB per
    WebAssembly memory, and 32 GiB already fails at four. 0 (TOML has no null) means no limit.
    """

    nproc: NonNegativeInt | None = Field(1024, description="processes and threads (RLIMIT_NPROC)")
    fsize_mb: NonNegativeInt | None = Field(2048, description="largest file it may write, MiB (RLIMIT_FSIZE)")
    memory_mb: NonNegativeInt | None = Field(65536, description="address space of each process, MiB (RLIMIT_AS)")
    nofile: NonNegativeInt | None = Field(4096, description="open files per process (RLIMIT_NOFILE)")
    tmp_mb: PositiveInt = Field(512, description="size of the sandbox's /tmp (a tmpfs, so it is memory)")


class HarnessConfig(_Frozen):
    """How to run one harness process: its command line, environment, limits and the runner's concurrency."""

    name: str = Field("harness", min_length=1, description="label for messages and the CLI")
    command: tuple[str, ...] = Field(min_length=1, description="argv template; element 0 is the program")
    env: dict[str, str] = Field(default_factory=dict, description="extra variables (templates); override the "
                                                                  "proxy variables when they name the same key")
    inherit_env: tuple[str, ...] = Field(DEFAULT_INHERITED_ENV, description="variables copied from Gyre's env")
    home: Literal["execution", "inherit"] = Field(
        "execution", description="execution: a fresh HOME per execution (harness state cannot leak between "
                                 "executions); inherit: Gyre's HOME (a harness that needs a login there)")
    model: str = Field("gyre-policy", min_length=1, description="model name handed to the harness")
    timeout_s: PositiveFloat = Field(600.0, description="wall-clock limit per execution (a task may lower it)")
    kill_grace_s: NonNegativeFloat = Field(5.0, description="SIGTERM to SIGKILL delay when a harness times out")
    max_concurrency: PositiveInt = Field(4, description="executions running at once; the rest wait queued")
    message_chars: PositiveInt = Field(800, description="stderr tail kept in execution_finished.message")
    evaluate_harness_errors: bool = Field(
        False, description="score executions that crashed too (off: a crashed harness is excluded, like an "
                           "evaluator failure, since its workspace says more about the crash than the policy)")
    config_dir: str | None = Field(None, description="what {config_dir} expands to; `load` sets it")
    sandbox: Literal["bwrap", "none"] = Field(
        "bwrap", description="bwrap: each execution in its own bubblewrap sandbox (see docs/design.md, "
                             "\"Sandboxed executions\"); none: the host's files, processes and network, "
                             "only by explicit choice (a warning says so)")
    ro_mounts: tuple[str, ...] = Field((), description="extra paths the sandbox sees read-only at the same "
                                                       "path (a toolchain, a Node install); relative ones "
                                                       "start at config_dir")
    rootfs: str | None = Field(None, description="a directory used as the sandbox's / (an unpacked container "
                                                 "image) instead of the host's system; a task may name its own")
    limits: SandboxLimits = Field(default_factory=SandboxLimits)

    @model_validator(mode="after")
    def _check_placeholders(self) -> Self:
        check_templates(self.command, HARNESS_PLACEHOLDERS, where=f"harness {self.name!r} command")
        check_templates(self.env.values(), HARNESS_PLACEHOLDERS | ENV_ONLY_PLACEHOLDERS,
                        where=f"harness {self.name!r} env")
        return self

    @classmethod
    def load(cls, path: str | Path, *, table: str | None = None) -> HarnessConfig:
        """From a TOML file (or one table of it, e.g. `harness`); `{config_dir}` becomes the file's directory."""
        path = Path(path)
        data = _read_toml(path, table)
        data.setdefault("config_dir", str(path.resolve().parent))
        return _validate(cls, data, path)


class CommandEvaluatorConfig(_Frozen):
    """Runs a program on the workspace; its last stdout line is a JSON object with `reward` and `details`.

    The program may instead report its own failure as `{"error": "infrastructure", "message": "..."}`
    (or `crash` / `timeout`): that becomes `evaluation_failed`, not a reward.
    """

    type: Literal["command"]
    name: str = Field("command", min_length=1, description="evaluator name recorded with every reward")
    command: tuple[str, ...] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: PositiveFloat = 60.0
    kill_grace_s: NonNegativeFloat = 1.0
    memory_mb: PositiveInt | None = Field(DEFAULT_EVALUATOR_MEMORY_MB,
                                          description="address-space limit of the program (None: no limit)")

    @model_validator(mode="after")
    def _check_placeholders(self) -> Self:
        check_templates(self.command, EVALUATOR_PLACEHOLDERS, where=f"evaluator {self.name!r} command")
        check_templates(self.env.values(), EVALUATOR_PLACEHOLDERS, where=f"evaluator {self.name!r} env")
        return self


class PythonEvaluatorConfig(_Frozen):
    """Calls a Python function in a child process: `module.path:function` or `file.py:function`.

    A `file.py` path is relative to the task set's directory. The function gets an `EvaluationContext` and
    returns a reward, `(reward, details)` or a `Score`. The child is forked from a warm parent (cheap), has
    `memory_mb` of address space and `timeout_s`; a crash, a timeout or an exhausted limit is
    `evaluation_failed`, never a reward.
    """

    type: Literal["python"]
    name: str = Field("python", min_length=1)
    function: str = Field(pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
    timeout_s: PositiveFloat = 60.0
    memory_mb: PositiveInt | None = Field(DEFAULT_EVALUATOR_MEMORY_MB,
                                          description="address-space limit of the child (None: no limit)")


EvaluatorConfig = Annotated[CommandEvaluatorConfig | PythonEvaluatorConfig, Field(discriminator="type")]


def _read_toml(path: Path, table: str | None) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if table is not None:
        if not isinstance(data.get(table), dict):
            raise ConfigError(f"{path}: no [{table}] table")
        data = data[table]
    return data


M = TypeVar("M", bound=BaseModel)


def _validate(cls: type[M], data: dict[str, Any], path: Path) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{path}: {e}") from e
