"""Durable-log benchmark: `gyre log bench --json [--quick]`.

Every figure counts an event only once it is durable (fsynced). Ratios compare two paths measured in
the same run on the same disk, interleaved, because absolute numbers on shared machines are noisy.
"""

import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from gyre.events.models import (
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    MicroStepClaimed,
    ModelCallFinished,
    ModelCallStarted,
    RewardRecorded,
)
from gyre.events.schema import TS_TYPE, event_schema, payload_type
from gyre.log.frames import BATCH_FRAME, FORMAT_V0, FORMAT_V1, Frame, OpenHead, scan
from gyre.log.reader import LogReader
from gyre.log.segment import batch_frame_parts
from gyre.log.writer import LogWriter
from gyre.state import ClusterView, ExecutionsView, TrainerView, fold_batches

TOKENS_PER_CALL = 2048


# -- payload efficiency ------------------------------------------------------------------------------------


def model_call_batch(first_call: int, n: int, tokens: int, rng: np.random.Generator) -> pa.RecordBatch:
    """``n`` model_call_finished rows with ``tokens`` output tokens each, built columnar (as a proxy would)."""
    ids = rng.integers(0, 150_000, size=n * tokens, dtype=np.int32)
    logprobs = -rng.exponential(1.0, size=n * tokens).astype(np.float32)
    offsets = pa.array(np.arange(0, (n + 1) * tokens, tokens, dtype=np.int32))
    struct = payload_type("model_call_finished")
    children = []
    for field in struct:
        if field.name == "output_ids":
            children.append(pa.ListArray.from_arrays(offsets, pa.array(ids)))
        elif field.name == "output_logprobs":
            children.append(pa.ListArray.from_arrays(offsets, pa.array(logprobs)))
        elif field.name == "prompt_delta_ids":
            children.append(pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.int32())))
        elif field.name == "branch":
            children.append(pa.array(["main"] * n))
        elif field.name == "finish_reason":
            children.append(pa.array(["stop"] * n))
        elif field.name == "parent_call_id":
            children.append(pa.nulls(n, pa.string()))
        else:
            children.append(pa.array(np.zeros(n), field.type) if field.type != pa.string() else pa.nulls(n))
    calls = [f"c{first_call + i}" for i in range(n)]
    return pa.RecordBatch.from_pydict({
        "kind": pa.array(["model_call_finished"] * n),
        "execution_id": pa.array([f"e{(first_call + i) % 64}" for i in range(n)]),
        "call_id": pa.array(calls),
        "cell_id": pa.array(["cell0"] * n),
        "model_call_finished": pa.StructArray.from_arrays(children, fields=list(struct)),
    })


def _raw_write(path: Path, chunk: bytes, commits: int) -> float:
    """Sequential append + fdatasync of ``chunk`` per commit: the disk's limit for this commit pattern."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        offset = 0
        for _ in range(commits):
            offset += os.pwrite(fd, chunk, offset)
            os.fdatasync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def _log_payload(path: Path, batches: list[pa.RecordBatch], commits: int, producers: int,
                 wait: bool, frame_format: int = FORMAT_V1) -> tuple[float, int, int]:
    """``producers`` threads each appending model-call batches, ``commits`` appends in all, each followed
    by a commit. Returns (seconds until all of it is durable, bytes written, fsyncs).

    ``wait=True``: every commit waits for its fsync (a synchronous caller). ``wait=False``: a producer
    asks for the commit and goes on appending, as the proxy's event loop does (it awaits durability
    asynchronously); the clock stops when the last commit is durable.
    """
    per_producer = commits // producers
    with LogWriter(path, seal=False, segment_bytes=1 << 30, frame_format=frame_format) as writer:
        def produce(worker: int) -> None:
            for i in range(per_producer):
                seqs = writer.append_batch(batches[(worker + i) % len(batches)])
                writer.commit(seqs.last, wait=wait)

        threads = [threading.Thread(target=produce, args=(w,)) for w in range(producers)]
        start = time.perf_counter()  # steady state: opening the log is not part of the write path
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        writer.commit()
        elapsed = time.perf_counter() - start
        return elapsed, writer.stats.bytes, writer.stats.fsyncs


def _payload_round(root: Path, batches: list[pa.RecordBatch], commits: int, producers: int,
                   wait: bool) -> tuple[float, float, int]:
    """One round: the log's and the raw baseline's durable bytes/s, and the bytes per fsync.

    The raw baseline writes the same bytes in the same number of fsyncs, twice, averaged: one raw run is
    noisier than the log run.
    """
    path = root / "payload"
    log_time, log_bytes, fsyncs = _log_payload(path, batches, commits, producers, wait)
    shutil.rmtree(path)
    chunk = os.urandom(log_bytes // fsyncs)
    raw_time = (_raw_write(root / "raw_a", chunk, fsyncs) + _raw_write(root / "raw_b", chunk, fsyncs)) / 2
    for name in ("raw_a", "raw_b"):
        os.unlink(root / name)
    return log_bytes / log_time, len(chunk) * fsyncs / raw_time, log_bytes // fsyncs


PAYLOAD_MODES = {
    "": (1, False),  # the headline: a producer that does not block on each commit (the proxy's case)
    "_blocking": (4, True),  # four threads, each waiting for every commit it makes
    "_single_producer": (1, True),  # one thread waiting for every commit: no overlap is possible
}
"""Suffix of the JSON keys -> (producer threads, whether each commit waits for its fsync)."""


def payload_efficiency(root: Path, commits: int, calls_per_commit: int, rounds: int) -> dict:
    """Durable MB/s of model-call events against raw write + fsync of the same bytes in the same number of
    fsyncs, measured back to back in each round."""
    rng = np.random.default_rng(0)
    batches = [model_call_batch(i * calls_per_commit, calls_per_commit, TOKENS_PER_CALL, rng) for i in range(8)]
    out: dict = {}
    for label, (producers, wait) in PAYLOAD_MODES.items():
        measured = [_payload_round(root, batches, commits, producers, wait) for _ in range(rounds)]
        out[f"payload_efficiency{label}"] = statistics.median(log / raw for log, raw, _ in measured)
        out[f"payload_log_mb_per_s{label}"] = statistics.median(log for log, _, _ in measured) / 1e6
        out[f"payload_raw_mb_per_s{label}"] = statistics.median(raw for _, raw, _ in measured) / 1e6
        out[f"payload_bytes_per_fsync{label}"] = statistics.median(b for _, _, b in measured)
        out[f"payload_producers{label}"] = producers
        out[f"payload_commits_wait{label}"] = wait
    out.update({"payload_calls_per_append": calls_per_commit, "payload_tokens_per_call": TOKENS_PER_CALL})
    return out


def payload_efficiency_by_commit_size(root: Path, sizes: tuple[int, ...], megabytes: int, rounds: int) -> dict:
    """Single, blocking producer's efficiency as a function of calls per commit: the log's per-append CPU is fixed, so
    its share shrinks as commits grow (the raw baseline commits the same bytes per fsync)."""
    rng = np.random.default_rng(2)
    out = {}
    for calls in sizes:
        batches = [model_call_batch(i * calls, calls, TOKENS_PER_CALL, rng) for i in range(4)]
        commits = max(8, (megabytes << 20) // (calls * TOKENS_PER_CALL * 8))
        measured = [_payload_round(root, batches, commits, 1, True) for _ in range(rounds)]
        out[str(calls)] = statistics.median(log / raw for log, raw, _ in measured)
    return {"payload_efficiency_by_calls_per_commit": out}


def payload_event_api(root: Path, commits: int, calls_per_commit: int) -> dict:
    """The same payload through pydantic events (``append(event)``), for comparison with the columnar path."""
    rng = np.random.default_rng(1)
    events = [ModelCallFinished(execution_id=f"e{i % 64}", call_id=f"c{i}", cell_id="cell0",
                                output_ids=rng.integers(0, 150_000, TOKENS_PER_CALL).tolist(),
                                output_logprobs=(-rng.exponential(1.0, TOKENS_PER_CALL)).tolist())
              for i in range(calls_per_commit * 4)]
    path = root / "payload_events"
    with LogWriter(path, seal=False, segment_bytes=1 << 30) as writer:
        start = time.perf_counter()
        for i in range(commits):
            for j in range(calls_per_commit):
                writer.append(events[(i * calls_per_commit + j) % len(events)])
            writer.commit()
        elapsed = time.perf_counter() - start
    log_bytes = sum(p.stat().st_size for p in path.glob("*.seg"))
    shutil.rmtree(path)
    return {"payload_event_api_mb_per_s": log_bytes / elapsed / 1e6}


# -- small events: columnar batches and the event API against a naive loop ------------------------------------


def batch_events_per_s(root: Path, batches: int, rows: int) -> float:
    """Envelope-only events through ``append_batch``: durable events per second."""
    struct = payload_type("micro_step_claimed")  # payload: micro_step, tokens
    template = pa.RecordBatch.from_pydict({
        "kind": pa.array(["micro_step_claimed"] * rows),
        "cell_id": pa.array(["cell1"] * rows),
        "step": pa.array(np.full(rows, 3, np.int64)),
        "micro_step_claimed": pa.StructArray.from_arrays(
            [pa.array(np.arange(rows, dtype=np.int64) % 64), pa.array(np.full(rows, 4096, np.int64))],
            fields=list(struct)),
    })
    path = root / "batch"
    with LogWriter(path, seal=False, segment_bytes=1 << 30) as writer:
        start = time.perf_counter()
        for _ in range(batches):
            writer.append_batch(template)
            writer.commit()
        elapsed = time.perf_counter() - start
    shutil.rmtree(path)
    return batches * rows / elapsed


def small_events(n: int) -> list:
    out = []
    for i in range(n):
        execution = f"e{i % 97}"
        match i % 4:
            case 0:
                out.append(ModelCallStarted(execution_id=execution, call_id=f"c{i}", cell_id="cell0",
                                            prompt_tokens=i))
            case 1:
                out.append(ExecutionStarted(execution_id=execution, cell_id="cell0"))
            case 2:
                out.append(RewardRecorded(execution_id=execution, reward=0.5, evaluator="tests"))
            case _:
                out.append(MicroStepClaimed(step=1, cell_id="cell0", micro_step=i % 64, tokens=i))
    return out


def naive_write(path: Path, events: list, per_commit: int) -> float:
    """The naive loop: pydantic objects -> ``Table.from_pylist`` -> IPC write -> flush + fsync."""
    schema = event_schema()
    start = time.perf_counter()
    with open(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as stream:
        for first in range(0, len(events), per_commit):
            rows = []
            for seq, event in enumerate(events[first:first + per_commit], start=first):
                row = {"seq": seq, "ts": time.time_ns() // 1000, "kind": event.kind}
                row.update(event.model_dump(exclude={"seq", "ts"}, include=set(type(event).model_fields)))
                row[event.kind] = {k: row.pop(k) for k in event.payload_fields()}
                rows.append(row)
            stream.write_table(pa.Table.from_pylist(rows, schema=schema))
            sink.flush()
            os.fsync(sink.fileno())
    return time.perf_counter() - start


def event_api_write(path: Path, events: list, per_commit: int) -> float:
    start = time.perf_counter()
    with LogWriter(path, seal=False, segment_bytes=1 << 30) as writer:
        for index, event in enumerate(events, start=1):
            writer.append(event)
            if index % per_commit == 0:
                writer.commit()
        elapsed = time.perf_counter() - start
    return elapsed


def event_api_speedup(root: Path, n: int, per_commit: int, rounds: int) -> dict:
    events = small_events(n)
    ratios, ours = [], []
    for round_ in range(rounds):
        naive = naive_write(root / f"naive{round_}.arrows", events, per_commit)
        api = event_api_write(root / f"api{round_}", events, per_commit)
        ratios.append(naive / api)
        ours.append(n / api)
    return {"event_api_speedup": statistics.median(ratios), "event_api_events_per_s": statistics.median(ours),
            "event_api_events_per_commit": per_commit}


# -- group commit latency -----------------------------------------------------------------------------------


def commit_latency(root: Path, producers: int, commits_each: int) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()
    with LogWriter(root / "group", seal=False, segment_bytes=1 << 30) as writer:
        def produce(worker: int) -> None:
            mine = []
            for i in range(commits_each):
                event = ModelCallStarted(execution_id=f"e{worker}", call_id=f"c{worker}-{i}", cell_id="cell0")
                start = time.perf_counter()
                seqs = writer.append(event)
                writer.commit(seqs.last)
                mine.append(time.perf_counter() - start)
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=produce, args=(w,)) for w in range(producers)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    ms = np.array(latencies) * 1000
    return {"commit_p50_ms": float(np.percentile(ms, 50)), "commit_p99_ms": float(np.percentile(ms, 99)),
            "group_commit_producers": producers, "group_commit_events_per_s": len(latencies) / elapsed}


# -- replay and recovery -----------------------------------------------------------------------------------


def execution_events(e: int, calls: int, tokens: Callable[[], int]) -> list:
    """One execution of a run: queued, started, ``calls`` model calls (start + finish), finished."""
    execution, cell = f"e{e}", f"cell{e % 4}"
    events = [ExecutionQueued(execution_id=execution, task_id=f"t{e // 16}", group_id=f"g{e // 16}"),
              ExecutionStarted(execution_id=execution, cell_id=cell)]
    for c in range(calls):
        call, n = f"{execution}-c{c}", tokens()
        events.append(ModelCallStarted(execution_id=execution, call_id=call, cell_id=cell))
        events.append(ModelCallFinished(execution_id=execution, call_id=call, cell_id=cell,
                                        output_ids=[1] * n, output_logprobs=[-0.5] * n))
    events.append(ExecutionFinished(execution_id=execution, status="completed", duration_s=1.0))
    return events


def realistic_log(path: Path, executions: int, calls_per_execution: int, frame_format: int = FORMAT_V1) -> int:
    """A run-shaped log: executions queued/started/finished, call starts and finishes, rewards."""
    rng = np.random.default_rng(7)
    n = 0
    with LogWriter(path, seal=True, segment_bytes=32 << 20, frame_format=frame_format) as writer:
        for e in range(executions):
            events = execution_events(e, calls_per_execution, lambda: int(rng.integers(1, 64)))
            events.append(RewardRecorded(execution_id=f"e{e}", reward=0.5))
            writer.append(events)
            n += len(events)
            if e % 64 == 63:
                writer.commit()
    return n


def replay_speed(root: Path, executions: int, calls: int) -> dict:
    """Events per second folded from the log on disk (read, checksum, decode, fold), best of two."""
    path = root / "replay"
    n = realistic_log(path, executions, calls)
    reader = LogReader(path)
    out = {"replay_log_events": n}
    for projection in (ClusterView(), ExecutionsView(), TrainerView()):
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            fold_batches(projection, reader.read(full_schema=False))
            best = min(best, time.perf_counter() - start)
        out[f"replay_{projection.name}_events_per_s"] = n / best
    # Headline: the executions view, which folds every execution, reward and finished call of the run.
    # The cluster view also folds every call start (in-flight tracking) and is reported beside it.
    out["replay_events_per_s"] = out["replay_executions_events_per_s"]
    out["replay_projection"] = "executions"
    return out


def replay_small_frames(root: Path, executions: int, calls: int) -> dict:
    """Replay of a log committed event by event, as a proxy serving one call at a time writes it: frames of
    one event each (the reader merges them into batches; without that this ran at ~6K events/s)."""
    path = root / "replay_small"
    n = 0
    with LogWriter(path, seal=False) as writer:
        for e in range(executions):
            events = execution_events(e, calls, lambda: 32)
            for event in events:
                writer.append(event)
                writer.commit(wait=False)  # one frame per event, without an fsync each
            n += len(events)
    reader = LogReader(path)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        fold_batches(ExecutionsView(), reader.read(full_schema=False))
        best = min(best, time.perf_counter() - start)
    shutil.rmtree(path)
    return {"replay_small_frames_events_per_s": n / best, "replay_small_frames_events": n}


def _frame_offsets(segment: Path) -> list[int]:
    data = memoryview(segment.read_bytes())
    return [f.offset for f in scan(data, verify=False) if isinstance(f, Frame) and f.frame_type == BATCH_FRAME]


def recovery_speed(root: Path, megabytes: int) -> dict:
    """Time to open a log whose live segment holds ``megabytes`` (scan + checksum every frame)."""
    path = root / "recovery"
    rng = np.random.default_rng(3)
    batch = model_call_batch(0, 32, TOKENS_PER_CALL, rng)
    with LogWriter(path, seal=False, segment_bytes=1 << 40) as writer:
        while writer._offset < megabytes << 20:
            writer.append_batch(batch)
            writer.commit()
    segment = next(path.glob("*.seg"))
    with open(segment, "rb") as f:  # the first 1,000 bytes of a frame: a torn write, as a crash leaves it
        f.seek(_frame_offsets(segment)[-1])
        torn = f.read(1000)
    with open(segment, "ab") as f:
        f.write(torn)
    size = sum(p.stat().st_size for p in path.glob("*.seg"))
    start = time.perf_counter()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LogWriter(path, seal=False).close()
    elapsed = time.perf_counter() - start
    return {"recovery_s_per_gb": elapsed / (size / 1e9), "recovery_bytes": size}


# -- A/B: the writer before frame format v1 against the current one ------------------------------------------

AB_WRITERS = {"old": FORMAT_V0, "new": FORMAT_V1}
"""The old writer is the current pipeline writing format v0 frames (one CRC per frame, no watermark, no
CLOSE marker): what format v1 adds to the write path is exactly the difference between the two."""


def ab_benchmark(root: Path, rounds: int = 10, commits: int = 256, calls_per_commit: int = 16,
                 replay_executions: int = 200) -> dict:
    """Old and new writers alternating in one run (the order flips every round, so drift in the machine's
    load hits both), ``rounds`` rounds each: durable MB/s in every payload mode, and replay (read, verify,
    fold) of a run-shaped log in each format. Medians per writer, and the median of per-round ratios."""
    rng = np.random.default_rng(0)
    batches = [model_call_batch(i * calls_per_commit, calls_per_commit, TOKENS_PER_CALL, rng) for i in range(8)]
    out: dict = {"ab_rounds": rounds, "ab_commits": commits, "ab_calls_per_append": calls_per_commit}
    for label, (producers, wait) in PAYLOAD_MODES.items():
        speeds: dict[str, list[float]] = {name: [] for name in AB_WRITERS}
        for round_ in range(rounds):
            order = list(AB_WRITERS) if round_ % 2 == 0 else list(reversed(AB_WRITERS))
            for name in order:
                path = root / f"ab_{name}"
                elapsed, written, _ = _log_payload(path, batches, commits, producers, wait, AB_WRITERS[name])
                shutil.rmtree(path)
                speeds[name].append(written / elapsed / 1e6)
        _ab_summary(out, f"payload{label}_mb_per_s", speeds)
    out.update(_ab_framing(batches, rounds))
    logs = {}
    for name, fmt in AB_WRITERS.items():
        logs[name] = root / f"ab_replay_{name}"
        events = realistic_log(logs[name], replay_executions, 200, frame_format=fmt)
    speeds = {name: [] for name in AB_WRITERS}
    for round_ in range(rounds):
        order = list(AB_WRITERS) if round_ % 2 == 0 else list(reversed(AB_WRITERS))
        for name in order:
            start = time.perf_counter()
            fold_batches(ExecutionsView(), LogReader(logs[name]).read(full_schema=False))
            speeds[name].append(events / (time.perf_counter() - start))
    _ab_summary(out, "replay_events_per_s", speeds)
    for path in logs.values():
        shutil.rmtree(path)
    return out


def _ab_framing(batches: list[pa.RecordBatch], rounds: int, appends: int = 200) -> dict:
    """The CPU the write path adds per append, without the disk's noise: framing a payload batch (and, in
    v1, sealing its header as the writer does), in appends per CPU second (process time: on a shared
    machine, wall time would count other processes' turns)."""
    schema = event_schema()
    stored = []
    for i, batch in enumerate(batches):
        n = batch.num_rows
        seq = pa.array(np.arange(i * n, (i + 1) * n, dtype=np.int64))
        ts = pa.array(np.zeros(n, np.int64), TS_TYPE)
        full = pa.RecordBatch.from_arrays([seq, ts, *batch.columns], names=["seq", "ts", *batch.schema.names])
        stored.append(full.cast(pa.schema([schema.field(name) for name in full.schema.names])))
    speeds: dict[str, list[float]] = {name: [] for name in AB_WRITERS}
    for round_ in range(rounds):
        order = list(AB_WRITERS) if round_ % 2 == 0 else list(reversed(AB_WRITERS))
        for name in order:
            start = time.process_time()
            for i in range(appends):
                parts = batch_frame_parts(stored[i % len(stored)], i, schema, AB_WRITERS[name])
                if isinstance(parts[0], OpenHead):
                    parts[0].seal(i - 1)
            speeds[name].append(appends / (time.process_time() - start))
    out: dict = {}
    _ab_summary(out, "framing_appends_per_s", speeds)
    return out


def _ab_summary(out: dict, key: str, speeds: dict[str, list[float]]) -> None:
    for name, values in speeds.items():
        out[f"ab_{key}_{name}"] = statistics.median(values)
    out[f"ab_{key}_new_over_old"] = statistics.median(n / o for n, o in zip(speeds["new"], speeds["old"], strict=True))


def run_benchmark(quick: bool = False, directory: Path | None = None, kill_points: int = 0) -> dict:
    root = Path(tempfile.mkdtemp(prefix="gyre-log-bench-", dir=directory))
    try:
        scale = 1 if quick else 4
        results: dict = {"quick": quick, "machine": f"{os.cpu_count()} cpu", "directory": str(root)}
        results.update(payload_efficiency(root, commits=256 * scale, calls_per_commit=16, rounds=5))
        results.update(payload_efficiency_by_commit_size(root, (16, 64, 128), megabytes=32 * scale, rounds=3))
        results.update(payload_event_api(root, commits=10 * scale, calls_per_commit=16))
        results["batch_events_per_s"] = batch_events_per_s(root, batches=10 * scale, rows=100_000)
        results.update(event_api_speedup(root, n=20_000 * scale, per_commit=1000, rounds=3))
        results.update(commit_latency(root, producers=64, commits_each=20 * scale))
        results.update(replay_speed(root, executions=500 * scale, calls=200))
        results.update(replay_small_frames(root, executions=10 * scale, calls=200))
        results.update(recovery_speed(root, megabytes=128 * scale))
        if kill_points:
            from gyre.log.crash import run_crash_points

            report = run_crash_points(root / "crash", kill_points, seed=12345)
            results.update({"kill_points": report.points, "kill_acknowledged_lost": report.lost,
                            "kill_failures": len(report.failures), "kill_torn_tails_cut": report.torn_tails_cut,
                            "kill_ambiguous_tails": report.ambiguous_tails})
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_ab(quick: bool = False, directory: Path | None = None, rounds: int = 10) -> dict:
    """`gyre log bench --ab`: the old and new writers alternating (see ``ab_benchmark``)."""
    root = Path(tempfile.mkdtemp(prefix="gyre-log-ab-", dir=directory))
    try:
        scale = 1 if quick else 4
        results: dict = {"quick": quick, "machine": f"{os.cpu_count()} cpu", "directory": str(root)}
        results.update(ab_benchmark(root, rounds=rounds, commits=256 * scale, replay_executions=100 * scale))
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)
