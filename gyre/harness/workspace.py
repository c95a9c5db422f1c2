"""The directory of one execution: the workspace the harness works in, and what Gyre keeps beside it.

    <root>/<execution_id>[.attempt<k>]/
        workspace/        the harness's working directory, created from the task's starting files; kept
        home/             HOME for the harness (when `HarnessConfig.home == "execution"`)
        task.md           the prompt ({task_file})
        harness.stdout    the harness's output, whole
        harness.stderr
        evaluation/       the evaluator's scratch directory (grading file, its output)

Everything but `workspace/` sits outside the harness's working directory, so an agent that lists its files
sees only the task's files. The directory is never deleted by the runner: a timed-out workspace is scored
as it was left, and a person debugging a run can look at it afterwards.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from gyre.harness.errors import WorkspaceError
from gyre.harness.tasks import Task


@dataclass(frozen=True)
class ExecutionDirs:
    root: Path

    @classmethod
    def for_execution(cls, base: Path, execution_id: str, attempt: int = 0) -> ExecutionDirs:
        name = execution_id if attempt == 0 else f"{execution_id}.attempt{attempt}"
        return cls((base / name).resolve())

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def task_file(self) -> Path:
        return self.root / "task.md"

    @property
    def stdout(self) -> Path:
        return self.root / "harness.stdout"

    @property
    def stderr(self) -> Path:
        return self.root / "harness.stderr"

    @property
    def evaluation(self) -> Path:
        return self.root / "evaluation"


def prepare(dirs: ExecutionDirs, task: Task) -> None:
    """Create the execution's directories and its workspace from the task's starting files.

    Raises `WorkspaceError` when the directory exists (an execution id is used once; a retry is a new
    attempt) or the files cannot be written.
    """
    try:
        dirs.root.parent.mkdir(parents=True, exist_ok=True)
        dirs.root.mkdir()
    except FileExistsError:
        raise WorkspaceError(f"execution directory {dirs.root} exists already; execution ids are single-use "
                             "(a retry is a new attempt)") from None
    except OSError as e:
        raise WorkspaceError(f"cannot create execution directory {dirs.root}: {e}") from e
    try:
        if task.spec.files_dir is not None:
            shutil.copytree(task.base_dir / task.spec.files_dir, dirs.workspace, symlinks=True)
        else:
            dirs.workspace.mkdir()
        for name, text in task.spec.files.items():
            path = dirs.workspace / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        dirs.home.mkdir()
        dirs.evaluation.mkdir()
        dirs.task_file.write_text(task.spec.prompt)
    except OSError as e:
        raise WorkspaceError(f"cannot prepare workspace {dirs.workspace} for task {task.id!r}: {e}") from e
