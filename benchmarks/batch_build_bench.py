"""Batch build per step as a run grows: does step 50 cost more than step 1 on the same per-step workload?

A log grows step by step as a live run's does (each step: the same synthetic executions under new ids,
queued with their step, their calls, finishes and rewards); after each step the step's batch is built the
way `gyre train` builds it — `LiveLogSource.refresh()` then the step's groups only — and, for comparison,
the old way (a fresh `LogSource` over the whole log, filtered in Python). The figure is the ratio of the
median build time of the last three steps to that of steps 1-3 (goal: <= 1.5).

``--remote``: also build each step from the log served by a controller's hub over gRPC (`RemoteLog`, as a
cluster's core reads it, possibly from another host) and report its median time over the file-tailing one.

    python benchmarks/batch_build_bench.py --steps 50 --json [--remote]
"""

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from gyre.events import ExecutionFinished, ExecutionQueued, RewardRecorded, RunStarted
from gyre.log import LogWriter
from gyre.trajectory import BatchBuilder, TrajectoryConfig
from gyre.trajectory.source import LiveLogSource, LogSource
from gyre.trajectory.synth import SynthConfig, generate
from gyre.trajectory.synth_log import call_batch

RUN = "bench"


def step_executions(template, step: int):
    out = []
    for e in template:
        calls = [dataclasses.replace(c, call_id=f"s{step}-{c.call_id}") for c in e.calls]
        out.append(dataclasses.replace(e, execution_id=f"s{step}-{e.execution_id}",
                                       group_id=f"s{step}-{e.group_id}", calls=calls))
    return out


def write_step(writer: LogWriter, executions, step: int) -> None:
    writer.append([ExecutionQueued(execution_id=e.execution_id, task_id=e.task_id, group_id=e.group_id, step=step)
                   for e in executions])
    writer.append_batch(call_batch([(e, i) for e in executions for i in range(len(e.calls))], RUN))
    writer.append([ExecutionFinished(execution_id=e.execution_id, status="completed", duration_s=1.0)
                   for e in executions])
    writer.append([RewardRecorded(execution_id=e.execution_id, reward=e.reward) for e in executions])
    writer.commit()


def build(source, groups: set[str], builder: BatchBuilder) -> int:
    return sum(mb.tokens for mb in builder.batches(source.groups(group_ids=sorted(groups))))


def _hub(root: Path):
    """A controller's hub serving the benchmark's log (its own sink writes elsewhere: one writer per log)."""
    from gyre import auth
    from gyre.cluster.hub import Hub
    from gyre.cluster.log_client import RemoteLog
    from gyre.sink import LogSink

    sink = LogSink.create(root / "hub-log", RUN)
    secret = auth.mint(auth.RUN_PREFIX)
    hub = Hub(sink, run_id=RUN, secret=secret, log_path=root / "log")
    address = hub.start()
    return hub, sink, RemoteLog(address, secret=secret)


def run(steps: int, executions: int, root: Path, remote: bool = False) -> dict:
    template = generate(SynthConfig(executions=executions, group_size=4, seed=1, min_tokens=4_000,
                                    max_tokens=16_000, timeout_rate=0.0, harness_error_rate=0.0,
                                    eval_failure_rate=0.0, concurrency=executions))
    config = TrajectoryConfig(cap=5, min_valid_per_group=2)
    live_times, fresh_times, remote_times = [], [], []
    with LogWriter(root / "log", run_id=RUN) as writer:
        writer.append(RunStarted(run_id=RUN, name="bench", policy="elastic", policy_version="elastic/1"))
        writer.commit()
        live = LiveLogSource(root / "log", run_id=RUN)
        if remote:
            hub, sink, log = _hub(root)
            served = LiveLogSource(root / "log", run_id=RUN, follow=log.follow)
        for step in range(steps):
            batch = step_executions(template, step)
            write_step(writer, batch, step)
            groups = {e.group_id for e in batch}
            started = time.perf_counter()
            live.refresh(writer.durable_seq)
            tokens = build(live, groups, BatchBuilder(config))
            live_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            fresh = LogSource(root / "log", run_id=RUN)
            assert build(fresh, groups, BatchBuilder(config)) == tokens
            fresh_times.append(time.perf_counter() - started)
            if remote:
                started = time.perf_counter()
                served.refresh(writer.durable_seq)
                assert build(served, groups, BatchBuilder(config)) == tokens
                remote_times.append(time.perf_counter() - started)
        live.close()
        if remote:
            served.close()
            log.close()
            hub.stop()
            sink.close()
    first = statistics.median(live_times[1:4])
    last = statistics.median(live_times[-3:])
    return {
        "steps": steps, "executions_per_step": executions,
        "live_step1_s": round(first, 4), "live_last_s": round(last, 4), "live_ratio": round(last / first, 3),
        "fresh_step1_s": round(statistics.median(fresh_times[1:4]), 4),
        "fresh_last_s": round(statistics.median(fresh_times[-3:]), 4),
        "fresh_ratio": round(statistics.median(fresh_times[-3:]) / statistics.median(fresh_times[1:4]), 3),
        **({"remote_median_s": round(statistics.median(remote_times), 4),
            "live_median_s": round(statistics.median(live_times), 4),
            "remote_over_file": round(statistics.median(remote_times) / statistics.median(live_times), 3)}
           if remote else {}),
        "passed": last / first <= 1.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--executions", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--remote", action="store_true", help="also read the log through a controller's hub")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-batch-bench-") as root:
        result = run(args.steps, args.executions, Path(root), remote=args.remote)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
