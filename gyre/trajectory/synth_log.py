"""Writing a synthetic run to a Gyre log, in the order a live run would have written it.

Executions are queued together and start as one of ``concurrency`` slots frees up, so events of many
executions interleave and groups complete at different times, as in a live run. Model calls go through
the writer's columnar ``append_batch`` (hundreds of thousands of token ids per batch); the few lifecycle
events go through the validated per-event API.
"""

import heapq
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from gyre.events import (
    EvaluationFailed,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    RewardRecorded,
    RunFinished,
    RunStarted,
)
from gyre.events.schema import payload_type
from gyre.log import LogWriter
from gyre.log.segment import list_segments
from gyre.trajectory.errors import TrajectoryConfigError
from gyre.trajectory.synth import SynthConfig, SynthExecution, generate

CELLS = 4
FLUSH_TOKENS = 4_000_000
FLUSH_ROWS = 4096


@dataclass(frozen=True)
class SynthSummary:
    """What a synthetic run holds (printed by ``gyre trajectories synth``)."""

    path: str
    executions: int
    groups: int
    model_calls: int
    tokens: int
    policy_tokens: int
    min_execution_tokens: int
    max_execution_tokens: int
    completed: int
    timed_out: int
    harness_errors: int
    evaluation_failures: int
    compactions: int
    sub_agents: int
    retries: int
    events: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def synthesize(path: str | Path, config: SynthConfig) -> SynthSummary:
    """Generate a run from ``config`` and write it as a new log at ``path``."""
    path = Path(path)
    if path.exists() and list_segments(path):
        raise TrajectoryConfigError(f"{path} already holds a log; synthesize into a new directory")
    executions = generate(config)
    events = write(path, config, executions)
    sizes = [e.tokens for e in executions]
    return SynthSummary(
        path=str(path),
        executions=len(executions),
        groups=len({e.group_id for e in executions}),
        model_calls=sum(len(e.calls) for e in executions),
        tokens=sum(sizes),
        policy_tokens=sum(len(c.output) for e in executions for c in e.calls),
        min_execution_tokens=min(sizes),
        max_execution_tokens=max(sizes),
        completed=sum(e.status == "completed" for e in executions),
        timed_out=sum(e.status == "timed_out" for e in executions),
        harness_errors=sum(e.status == "harness_error" for e in executions),
        evaluation_failures=sum(e.evaluation == "failed" for e in executions),
        compactions=sum(e.compactions for e in executions),
        sub_agents=sum(e.sub_agents for e in executions),
        retries=sum(e.retries for e in executions),
        events=events,
    )


def _timeline(config: SynthConfig, executions: list[SynthExecution]) -> list[tuple[float, int, str, int, int]]:
    """``(time, tiebreak, what, execution, call)`` for every event, in the order they happen."""
    slots = [(0.0, slot) for slot in range(config.concurrency)]
    out: list[tuple[float, int, str, int, int]] = []
    order = 0

    def add(time: float, what: str, ex: int, call: int = -1) -> None:
        nonlocal order
        out.append((time, order, what, ex, call))
        order += 1

    for index, execution in enumerate(executions):
        add(0.0, "queued", index)
        free_at, slot = heapq.heappop(slots)
        start = free_at + 1.0
        add(start, f"started:{slot}", index)
        for c, call in enumerate(execution.calls):
            add(start + call.start_s + call.latency_s, "call", index, c)
        end = start + execution.duration_s
        add(end, "finished", index)
        add(end + 30.0 + 90.0 * (index % 7) / 7, "evaluated", index)
        heapq.heappush(slots, (end, slot))
    out.sort()
    return out


def _lifecycle(what: str, execution: SynthExecution, config: SynthConfig) -> Event | None:
    """The lifecycle event ``what`` (log time stamps it: the columnar call rows cannot carry a ts)."""
    ids = {"execution_id": execution.execution_id}
    if what == "queued":
        return ExecutionQueued(
            **ids, task_id=execution.task_id, group_id=execution.group_id, policy_version=config.policy_version
        )
    if what.startswith("started:"):
        return ExecutionStarted(**ids, cell_id=f"cell-{int(what.split(':')[1]) % CELLS}")
    if what == "finished":
        return ExecutionFinished(**ids, status=execution.status, duration_s=execution.duration_s)
    if execution.evaluation == "reward":
        return RewardRecorded(
            **ids, reward=execution.reward, evaluator="synthetic-tests", partial=execution.status == "timed_out"
        )
    if execution.evaluation == "failed":
        return EvaluationFailed(
            **ids,
            error=execution.eval_error,
            evaluator="synthetic-tests",
            message="the evaluator did not produce a score",
        )
    return None


def write(path: Path, config: SynthConfig, executions: list[SynthExecution]) -> int:
    """Write the run; returns the number of events."""
    pending: list[tuple[SynthExecution, int]] = []
    pending_tokens = 0
    written = 0
    with LogWriter(path, run_id=config.run_id) as writer:
        writer.append(
            RunStarted(
                run_id=config.run_id,
                name="synthetic trajectories",
                policy="synthetic",
                policy_version="synth-1",
                seed=config.seed,
                config=f'{{"executions": {config.executions}, "seed": {config.seed}}}',
            )
        )
        written += 1

        def flush() -> None:
            nonlocal pending, pending_tokens, written
            if pending:
                writer.append_batch(call_batch(pending, config.run_id))
                written += len(pending)
                writer.commit()
            pending, pending_tokens = [], 0

        for _, _, what, ex, call in _timeline(config, executions):
            execution = executions[ex]
            if what == "call":
                pending.append((execution, call))
                c = execution.calls[call]
                pending_tokens += len(c.delta) + len(c.output)
                if pending_tokens >= FLUSH_TOKENS or len(pending) >= FLUSH_ROWS:
                    flush()
                continue
            event = _lifecycle(what, execution, config)
            if event is not None:
                flush()
                writer.append(event)
                written += 1
        flush()
        writer.append(RunFinished(run_id=config.run_id, status="completed"))
        written += 1
    return written


def _lists(parts: list[np.ndarray], dtype: type, value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, value_type))


def call_batch(rows: list[tuple[SynthExecution, int]], run_id: str) -> pa.RecordBatch:
    """``model_call_finished`` rows in the log's columnar form (envelope ids, kind, payload struct)."""
    calls = [(e, e.calls[i]) for e, i in rows]
    n = len(calls)
    struct_type = payload_type("model_call_finished")
    children = {
        "parent_call_id": pa.array(
            [e.calls[c.parent].call_id if c.parent >= 0 else None for e, c in calls], pa.string()
        ),
        "branch": pa.array([c.branch for _, c in calls], pa.string()),
        "prefix_len": pa.array([c.prefix_len for _, c in calls], pa.int64()),
        "prompt_delta_ids": _lists([c.delta for _, c in calls], np.int32, pa.int32()),
        "output_ids": _lists([c.output for _, c in calls], np.int32, pa.int32()),
        "output_logprobs": _lists([c.logprobs for _, c in calls], np.float32, pa.float32()),
        "policy_version": pa.array([c.version for _, c in calls], pa.int64()),
        "engine_version": pa.array([c.version for _, c in calls], pa.int64()),  # the simulated engine serves it
        "cached_tokens": pa.array([c.prefix_len for _, c in calls], pa.int64()),
        "latency_s": pa.array([c.latency_s for _, c in calls], pa.float64()),
        "finish_reason": pa.array([c.finish_reason for _, c in calls], pa.string()),
        "drift_tokens": pa.array(np.zeros(n, dtype=np.int64)),
        "attempt": pa.array(np.zeros(n, dtype=np.int64)),
    }
    payload = pa.StructArray.from_arrays([children[f.name] for f in struct_type], fields=list(struct_type))
    cells = [f"cell-{zlib.crc32(e.execution_id.encode()) % CELLS}" for e, _ in calls]
    return pa.RecordBatch.from_pydict(
        {
            "kind": pa.array(["model_call_finished"] * n, pa.string()),
            "run_id": pa.array([run_id] * n, pa.string()),
            "execution_id": pa.array([e.execution_id for e, _ in calls], pa.string()),
            "call_id": pa.array([c.call_id for _, c in calls], pa.string()),
            "cell_id": pa.array(cells, pa.string()),
            "model_call_finished": payload,
        }
    )
