"""Tasks and task sets: what an execution is asked to do, its starting files, and how it is scored.

A task set is one TOML file:

    name = "toy"
    [evaluator]                      # default evaluator of every task
    type = "command"
    command = ["{python}", "{taskset_dir}/evaluate.py", "{grading_file}", "{workspace}"]

    [[tasks]]
    id = "hello"
    prompt = "Write the word hello into answer.txt."
    answer_file = "answer.txt"
    files = { "README.md" = "starting file content" }
    [tasks.grading]                  # opaque to Gyre: read by the task set's own evaluator
    kind = "text"
    expected = "hello"

`grading` is the one free-form table, on purpose: its shape belongs to the evaluator that reads it, and Gyre
only carries it to that evaluator (in `{grading_file}`, or `EvaluationContext.task`). It never reaches the
harness's workspace, so an agent cannot read the expected answer.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PositiveFloat,
    ValidationError,
    field_validator,
    model_validator,
)

from gyre.harness.config import EvaluatorConfig
from gyre.harness.errors import TaskSetError

if TYPE_CHECKING:
    from gyre.harness.evaluation import Evaluator

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
"""Ids name directories, so they are restricted to characters that are safe in a path component."""


def relative_path(value: str, *, what: str) -> str:
    """`value` if it is a relative path that stays below its base directory, else a ValueError."""
    path = PurePosixPath(value)
    if not value or path.is_absolute() or ".." in path.parts or value.startswith("~"):
        raise ValueError(f"{what} must be a relative path inside the workspace, got {value!r}")
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TaskSpec(_Frozen):
    """One task as written in a task set file."""

    id: str = Field(pattern=ID_PATTERN)
    prompt: str = Field(min_length=1)
    answer_file: str = Field("answer.txt", description="where the answer belongs, relative to the workspace")
    files: dict[str, str] = Field(default_factory=dict, description="starting files: relative path -> text")
    files_dir: str | None = Field(None, description="a directory (relative to the task set file) copied into "
                                                    "the workspace before `files` are written")
    timeout_s: PositiveFloat | None = Field(None, description="lower wall-clock limit than the harness's")
    evaluator: EvaluatorConfig | None = Field(None, description="overrides the task set's evaluator")
    rootfs: str | None = Field(None, description="a directory (relative to the task set file) used as the "
                                                 "sandbox's / for this task: an unpacked container image")
    grading: dict[str, JsonValue] = Field(default_factory=dict, description="evaluator-owned; opaque to Gyre")

    @field_validator("answer_file")
    @classmethod
    def _answer_inside(cls, value: str) -> str:
        return relative_path(value, what="answer_file")

    @field_validator("files")
    @classmethod
    def _files_inside(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            relative_path(name, what="a key of files")
        return value


class TaskSetSpec(_Frozen):
    """A task set file: a name, a default evaluator and the tasks."""

    name: str = Field(min_length=1)
    description: str = ""
    evaluator: EvaluatorConfig | None = None
    tasks: tuple[TaskSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        seen: set[str] = set()
        for task in self.tasks:
            if task.id in seen:
                raise ValueError(f"task id {task.id!r} appears twice")
            seen.add(task.id)
            if task.evaluator is None and self.evaluator is None:
                raise ValueError(f"task {task.id!r} has no evaluator and the task set names no default one")
        return self


@dataclass(frozen=True)
class Task:
    """A task ready to run: its spec, the directory its relative paths start from, and its evaluator."""

    spec: TaskSpec
    base_dir: Path
    evaluator: Evaluator

    @property
    def id(self) -> str:
        return self.spec.id


class TaskSet:
    """The tasks of one task set file, by id, each with its evaluator built."""

    def __init__(self, spec: TaskSetSpec, base_dir: Path) -> None:
        from gyre.harness.evaluators import build_evaluator

        self.spec = spec
        self.base_dir = base_dir.resolve()
        built: dict[str, Evaluator] = {}

        def evaluator_for(config: EvaluatorConfig) -> Evaluator:
            key = config.model_dump_json()
            if key not in built:
                built[key] = build_evaluator(config, self.base_dir)
            return built[key]

        self.tasks: dict[str, Task] = {}
        for task in spec.tasks:
            config = task.evaluator or spec.evaluator
            assert config is not None  # TaskSetSpec validated it
            if task.files_dir is not None and not (self.base_dir / task.files_dir).is_dir():
                raise TaskSetError(f"task {task.id!r}: files_dir {task.files_dir!r} is not a directory "
                                   f"under {self.base_dir}")
            self.tasks[task.id] = Task(task, self.base_dir, evaluator_for(config))

    @classmethod
    def load(cls, path: str | Path) -> TaskSet:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise TaskSetError(f"cannot read task set {path}: {e}") from e
        try:
            spec = TaskSetSpec.model_validate(data)
        except ValidationError as e:
            raise TaskSetError(f"task set {path}: {e}") from e
        return cls(spec, path.parent)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ids(self) -> list[str]:
        return list(self.tasks)

    def __getitem__(self, task_id: str) -> Task:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise TaskSetError(f"task set {self.name!r} has no task {task_id!r}; "
                               f"its tasks: {', '.join(self.tasks)}") from None

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks.values())

    def __len__(self) -> int:
        return len(self.tasks)

