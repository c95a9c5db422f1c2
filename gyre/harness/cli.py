"""`gyre harness ...`: list a task set, run one execution against a proxy, score a workspace by hand."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.table import Table

from gyre.events.fields import ExecutionStatus
from gyre.events.models import Event
from gyre.harness.bwrap import SandboxSpec, UidPool, check_available, give_to
from gyre.harness.config import HarnessConfig
from gyre.harness.evaluation import EvaluationContext, RewardOutcome
from gyre.harness.runner import Execution, HarnessRunner
from gyre.harness.tasks import TaskSet
from gyre.sink import EventSink, LogSink, MemorySink

harness_app = typer.Typer(no_args_is_help=True, help="Harnesses, tasks and evaluators.")
console = Console()


@harness_app.command("tasks")
def list_tasks(taskset: Annotated[Path, typer.Argument(help="task set TOML file")]) -> None:
    """List the tasks of a task set."""
    tasks = TaskSet.load(taskset)
    table = Table(title=f"task set {tasks.name!r} ({len(tasks)} tasks)")
    for column in ("id", "answer file", "evaluator", "prompt"):
        table.add_column(column)
    for task in tasks:
        table.add_row(task.id, task.spec.answer_file, task.evaluator.name, task.spec.prompt)
    console.print(table)


@harness_app.command("run-one")
def run_one(
    taskset: Annotated[Path, typer.Argument(help="task set TOML file")],
    task_id: Annotated[str, typer.Argument(help="task id")],
    config: Annotated[Path, typer.Option(help="harness TOML file")] = Path("agents/toy_agent/harness.toml"),
    proxy_url: Annotated[str, typer.Option(help="base URL of the proxy (or any OpenAI/Anthropic server)")] = (
        "http://127.0.0.1:8000"),
    token: Annotated[str, typer.Option(help="execution token the proxy accepts")] = "gyre-debug-token",
    root: Annotated[Path, typer.Option(help="where execution directories go")] = Path("runs/harness-debug"),
    log: Annotated[Path | None, typer.Option(help="also record the events in this log directory")] = None,
) -> None:
    """Run one execution of TASK_ID and score it; prints its events and where its workspace is."""
    from gyre.log import LogWriter

    tasks = TaskSet.load(taskset)
    execution = Execution(f"debug-{uuid.uuid4().hex[:8]}", tasks[task_id], group_id="debug", token=token)
    memory = MemorySink()
    writer = LogWriter(log) if log is not None else None
    try:
        sinks: list[EventSink] = [memory] if writer is None else [memory, LogSink(writer, close_writer=False)]
        fanout = _Fanout(sinks)
        with HarnessRunner(HarnessConfig.load(config), sink=fanout, proxy_url=proxy_url, root=root) as runner:
            result = runner.run(execution)
        fanout.close()
    finally:
        if writer is not None:
            writer.close()
    for event in memory.events:
        console.print(f"[bold]{event.kind}[/bold] {json.dumps(event.payload(), default=str)}")
    console.print(f"workspace: {result.workspace}")
    console.print(f"reward: {result.reward}")


@harness_app.command("evaluate")
def evaluate(
    taskset: Annotated[Path, typer.Argument(help="task set TOML file")],
    task_id: Annotated[str, typer.Argument(help="task id")],
    workspace: Annotated[Path, typer.Argument(help="workspace directory to score")],
    status: Annotated[str, typer.Option(help="completed | timed_out | harness_error")] = "completed",
    sandbox: Annotated[bool, typer.Option(help="run the evaluator in a bubblewrap sandbox, as a run does "
                                               "(as root, the workspace is handed to an unprivileged uid)")] = True,
) -> None:
    """Score a workspace with the task's evaluator (scratch files go next to the workspace)."""
    if status not in ("completed", "timed_out", "harness_error"):
        raise typer.BadParameter(f"status must be completed, timed_out or harness_error, not {status!r}")
    task = TaskSet.load(taskset)[task_id]
    workspace = workspace.resolve()
    status_value = cast(ExecutionStatus, status)  # checked above
    scratch = workspace.parent / "evaluation"
    spec = None
    if sandbox:
        check_available()
        uid = UidPool.shared().acquire() if os.geteuid() == 0 else None
        give_to(uid, workspace)
        spec = SandboxSpec(workspace=workspace, uid=uid, writable=(scratch,))
    else:
        console.print("[yellow]warning:[/yellow] the evaluator runs unsandboxed (--no-sandbox): code in the "
                      "workspace that it runs sees the host")
    context = EvaluationContext(execution_id="manual", task=task.spec, workspace=workspace,
                                scratch_dir=scratch, status=status_value, sandbox=spec)
    outcome = task.evaluator.evaluate(context)
    console.print(outcome.event("manual").model_dump_json(exclude_none=True))
    if not isinstance(outcome, RewardOutcome):
        raise typer.Exit(1)


class _Fanout:
    """Records every event in each of several sinks (the printed summary and, optionally, a log)."""

    def __init__(self, sinks: list[EventSink]) -> None:
        self.sinks = sinks

    def record(self, events: Event | Sequence[Event]) -> int:
        return [sink.record(events) for sink in self.sinks][-1]

    def commit(self, position: int | None = None) -> None:
        for sink in self.sinks:
            sink.commit()

    async def durable(self, position: int) -> None:
        self.commit()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
