"""Control-plane scale: one real controller against N cells over the real gRPC protocol.

`python -m benchmarks.control_plane_bench --cells 64,256 [--duration-s 40] [--profile DIR]` prints JSON.

The controller is the real one — `gyre.run.host.RunHost` over the cluster topology (`gyre.cluster.run.Cluster`): the
hub, the durable log (`LogSink` over `LogWriter`, fsync'd), the live folds, the elastic policy, one `RemoteCell`
actuator per cell and the plan — with one change: instead of launching `gyre cell` and `gyre proxy` processes (a
real cell process is over 300 MB with its imports alone, before its engine and trainer replica: 19 GB at 64 cells,
77 GB at 256, on a 24 GB machine), it launches *stand-ins* that speak the same protocol (`schemas/gyre.proto`): a
cell stand-in says hello, heartbeats as a link does (once nothing else went up for ``heartbeat_s``), and answers
every command at once (so a command's round trip is the control plane's own, with no engine work in it); the
core's stand-in answers Train by recording the step's trainer events and publishing a version. The proxy stand-in
is the real proxy's stream — a `ControllerLink` (its sink, its packing and coalescing, its one command thread)
— with only the engines and harnesses played: a workload thread places each queued execution on an admitting
cell holding its version, and each execution makes model calls — ``model_call_started``, then
``model_call_finished`` with real-sized token payloads — every ``call_interval_s``, finishes after a heavy-tailed
number of calls and is rewarded, each event recorded on its own as the proxy and the harness runner record them;
commands are answered as `gyre.cluster.proxy_node` answers them (routing, redirect, a queue's done once its
events are durable). Every
event is stamped and packed as Arrow by the link, so the hub does exactly the work it does in a live run. (An
earlier proxy stand-in ran the workload, the packing and the stream on one asyncio loop, answered commands
concurrently and sent a batch every 50 ms: its loop stalled behind its own event building, and the controller
saw a quarter of the batches the real link sends.)

Each cell count runs in its own controller process (so RSS and CPU are that run's); the cell stand-ins are spread
over ``cell_processes`` more processes (one asyncio loop each: with all 256 in one loop a command waited there
behind every other stand-in's work) and the proxy's is one more (its reported loop lag is its link's loop). What is
measured over the window after every cell registered: events ingested per second (folded by the controller),
command round trips (the actuator's `Hub.command_cell` call -> its `result()` returning the `CommandDone`, by kind)
cut into their parts (`PARTS`: the hub's queue, down, the stand-in, up, behind the stream's earlier batches, the
caller's wake-up; stamped on the one monotonic clock the processes of a machine share) and each stand-in
process's loop lag, so the controller's share of a round trip is named;
controller CPU (process time of every controller thread) and RSS per cell, log bytes per second, and each
controller round: fold of what arrived, then decide + act (`Controller.step`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import gc
import heapq
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import psutil

from gyre import auth
from gyre.cluster import link as link_module
from gyre.cluster.aio import GRPC_OPTIONS
from gyre.cluster.auth import SECRET_ENV, metadata
from gyre.cluster.config import ClusterConfig, ClusterSchedulerSection, ClusterSection
from gyre.cluster.link import COMMANDS_LANE, ControllerLink, Durable
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.cluster.run import Cluster
from gyre.config import RolloutSection
from gyre.errors import GyreError
from gyre.events.models import (
    CallRedirected,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    ModelCallFinished,
    ModelCallStarted,
    RewardRecorded,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.events.wire import pack_events
from gyre.log.writer import PREALLOCATE_BYTES
from gyre.run.host import RunHost
from gyre.scheduler import SchedulerView

ROOT = Path(__file__).resolve().parent.parent
GROUP_SIZE = 16  # the brief's GSPO group


@dataclasses.dataclass(frozen=True)
class Scenario:
    """The workload one controller faces. The defaults are the brief's scenario at the rate of one 8-GPU node
    per cell: a node serves ``slots`` long-horizon agents at once, each calling the model every
    ``call_interval_s`` (decode ``call_s`` of it, tool time the rest) with ~2.3K new tokens per call (~700K
    tokens over ~300 calls, the brief's rollout). Executions are shortened to a heavy-tailed ~``calls_mean``
    calls so that steps, tails, role switches and publishes happen within the window; that makes the lifecycle
    events (queued, started, finished, reward) ~75x more frequent than in the brief, which only adds load."""

    cells: int = 64
    slots: int = 8
    call_interval_s: float = 2.0
    call_s: float = 1.0
    calls_mean: float = 4.0
    prompt_delta_tokens: int = 1800
    output_tokens: int = 500
    heartbeat_s: float = 0.0
    """The run's `[cluster] heartbeat_s`; 0: its default (``dead_after_s / 3``). The stand-ins beat at the period
    the hub's Welcome names, as a link does."""
    train_s: float = 2.0
    tick_s: float = 0.005
    """The grid the proxy stand-in's calls and executions advance on: each event is recorded as its tick
    comes, on its own, and the proxy's `ControllerLink` sends them as the real proxy's does."""
    cell_processes: int = 4
    """Processes the cell stand-ins are spread over (each hosts a share, one asyncio loop each): with all of them
    in one loop, a command waited there behind every other stand-in's heartbeats and answers."""
    duration_s: float = 40.0
    warmup_s: float = 10.0
    """Run before the window opens: the first batch is queued and placed, the call stream has ramped up."""
    seed: int = 0
    raw: bool = False
    """Keep each round trip's stamps (``raw`` in the output): for reading a wave command by command."""
    no_gc_freeze: bool = False
    """An experiment: skip the `gc.freeze()` that `RunHost.run` does once the run is built (so that a full
    collection does not walk the cells, views and links); the benchmark freezes at the same point by default."""
    switch_interval_ms: float = 0.0
    """An experiment: the controller's `sys.setswitchinterval` (0: Python's default, 5 ms), how long a thread that
    wants the interpreter lock waits before the one holding it is asked to let go."""
    proxy_one_stream: bool = False
    """An experiment (the A/B of issue 30's command lane): the proxy stand-in on one stream, its commands and dones
    behind its events, as before its commands lane (`gyre.cluster.proxy_node`)."""
    cell_asks: bool = False
    """An experiment (the A/B of issue 30's plans): a returning cell stand-in asks which weights to load after its
    leave (`WeightsAsk`, a round trip) as a cell did before it read `ToRollout.plan`, kept current by the hub."""

    @property
    def calls_per_s(self) -> float:
        """Model calls per second when every slot is busy (two events each)."""
        return self.cells * self.slots / self.call_interval_s


# ---------------------------------------------------------------------------------------------------------
# the controller side: the real run host, with stand-ins launched in place of the processes
# ---------------------------------------------------------------------------------------------------------


class _StandIns:
    """What `Cluster` asks of its supervisor, over the stand-in processes (no restarts: none are lost)."""

    def __init__(self, cells: dict[str, subprocess.Popen[bytes]], proxy: subprocess.Popen[bytes]) -> None:
        self.cells, self.proxy = cells, proxy
        self.processes = [*{id(p): p for p in cells.values()}.values(), proxy]

    def starts(self, name: str) -> int:
        return 1

    def said_hello(self, name: str) -> None:
        return None

    def kill(self, name: str) -> None:
        return None

    def alive(self, name: str) -> bool:
        return (self.proxy if name == "proxy" else self.cells[name]).poll() is None

    def stop_watching(self) -> None:
        return None

    def reap(self) -> None:
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


PARTS = ("to_loop", "down", "standin", "up", "behind", "wake")
"""A command's round trip, cut where it changes hands (stamps on one monotonic clock, shared by the processes of one
machine): ``to_loop`` the caller's thread hands it to the hub (`Hub.command_cell`) until the hub's loop queues it
on the peer's stream; ``down`` the loop writes it, gRPC carries it, the stand-in's loop reads it; ``standin`` the
stand-in's own time (its queue of that cell's earlier commands; the proxy's ``events_wait`` is part of it:
recording the events the command made — a queue's done then waits for them to be durable, as the real proxy's does,
in ``up``; the proxy's ``down`` includes ``turn_wait``, from its link's loop reading the command to its one command
thread taking it up after the earlier ones); ``up`` the stand-in writes the done (behind what its stream has
queued), gRPC carries it, the hub's loop reads it; ``behind`` the event batches that stream sent before it are
recorded (a done takes effect after them); ``wake`` the hub resolves the caller's future and the caller's thread
wakes up with it (its `result()` returns: the round trip ends there)."""


PROXY_KINDS = frozenset(f.name for f in gyre_pb2.ProxyCommand.DESCRIPTOR.oneofs_by_name["body"].fields)
"""The proxy's command kinds (routing, redirect, queue, sync, stop); the rest go to cells."""


class Timings:
    """Command round trips by kind (and their parts), and each controller round's fold and decide+act, in s."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rtt: dict[str, list[float]] = collections.defaultdict(list)
        self.parts: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        self.queued: dict[int, float] = {}
        self.read: dict[int, float] = {}
        self.arrived: dict[int, float] = {}
        self.fold: list[float] = []
        self.step: list[float] = []
        self.decide: list[float] = []
        self.rounds: list[float] = []
        self.ticks: list[float] = []
        self.commit: list[float] = []
        self.fsync: list[float] = []
        self.decisions_durable: list[float] = []
        self.ingest: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
        """Per peer kind, each batch the hub's ingest thread recorded: (its wait in the thread's queue, wall
        time recording it, the thread's CPU time for it), s."""
        self.recording = False
        self.keep_raw = False
        self.raw: list[tuple[Any, ...]] = []
        """With ``keep_raw``: each round trip's (kind, target, *stamps) in `PARTS` order (monotonic s)."""

    def clear(self) -> None:
        with self.lock:
            self.rtt.clear()
            self.parts.clear()
            self.ingest.clear()
            for values in (self.fold, self.step, self.decide, self.rounds, self.ticks, self.commit, self.fsync,
                           self.decisions_durable):
                values.clear()

    def command(self, send: Callable[..., Future[Any]]) -> Callable[..., Future[Any]]:
        """``send`` (`Hub.command_cell` / `command_proxy`) timed from the caller's call until the caller's
        ``result()`` returns the done: the round trip as the actuator lives it, its thread's wake-up included."""
        def timed(*args: Any, **kwargs: Any) -> Future[Any]:
            kind = args[-1].WhichOneof("body") or "?"  # command_cell(cell_id, command), command_proxy(command)
            target = args[0] if len(args) > 1 else "proxy"
            started = time.monotonic()
            future = send(*args, **kwargs)
            result = future.result

            def timed_result(timeout: float | None = None) -> Any:
                answer = result(timeout)  # a failed command raises here: not timed
                self._took(kind, target, started, time.monotonic(), answer)
                return answer
            future.result = timed_result  # type: ignore[method-assign]
            return future
        return timed

    def _took(self, kind: str, target: str, started: float, woken: float, answer: Any) -> None:
        queued = self.queued.pop(answer.command_id, None)
        read = self.read.pop(answer.command_id, None)
        arrived = self.arrived.pop(answer.command_id, read)
        with self.lock:
            if not self.recording:
                return
            self.rtt[kind].append(woken - started)
            figures = answer.figures
            if queued is None or read is None or "bench_received_at" not in figures:
                return
            received, answered = figures["bench_received_at"], figures["bench_answered_at"]
            stamps = (started, queued, received, answered, arrived, read, woken)
            if self.keep_raw:  # a proxy's done adds: queued on its link's loop, written, messages ahead of it
                extra = tuple(figures[k] for k in ("bench_queued_at", "bench_written_at", "bench_ahead")
                              if k in figures)
                self.raw.append((kind, target, *stamps, *extra))
            parts = self.parts[kind]
            for part, a, b in zip(PARTS, stamps, stamps[1:], strict=False):
                parts[part].append(b - a)
            if "bench_handled_at" in figures:
                parts["events_wait"].append(answered - figures["bench_handled_at"])
            if "bench_read_at" in figures:
                parts["turn_wait"].append(received - figures["bench_read_at"])
            if "bench_written_at" in figures:  # the proxy's ``up``, cut: to its link's loop, its queue, the wire
                queued, written = figures["bench_queued_at"], figures["bench_written_at"]
                parts["up_to_loop"].append(queued - answered)
                parts["up_queue"].append(written - queued)
                parts["up_wire"].append(arrived - written)

    def hub(self, hub: Any) -> None:
        """Stamp, on the hub's loop, when a command is queued on its peer's stream, when its done is read and
        when it takes effect (after the batches sent before it). No lock: one dict store each (atomic under
        the interpreter lock; `_took` pops them later, on the caller's thread). Under `self.lock` the loop
        waited whenever one of the ~120 actuator threads of a wave lost the interpreter lock inside `_took`."""
        enqueue, on_done, after_ingest = hub._enqueue, hub._on_done, hub._after_ingest

        def timed_after_ingest(peer: Any, stream: Any, done: Any) -> None:
            self.arrived[done.command_id] = time.monotonic()
            after_ingest(peer, stream, done)

        def timed_enqueue(key: Any, command: Any, *args: Any, **kwargs: Any) -> None:
            self.queued[command.command_id] = time.monotonic()
            enqueue(key, command, *args, **kwargs)

        def timed_on_done(peer: Any, done: Any) -> None:
            self.read[done.command_id] = time.monotonic()
            on_done(peer, done)
        hub._enqueue, hub._on_done, hub._after_ingest = timed_enqueue, timed_on_done, timed_after_ingest
        on_events, record = hub._on_events, hub._record
        submitted: dict[int, float] = {}

        def timed_on_events(peer: Any, stream: Any, batch: Any) -> Any:
            submitted[id(batch)] = time.monotonic()
            return on_events(peer, stream, batch)

        def timed_record(peer: Any, stream: Any, batch: Any) -> int:  # the ingest thread: its queue, wall, CPU
            start, cpu = time.monotonic(), time.thread_time()
            try:
                return record(peer, stream, batch)
            finally:
                if self.recording:
                    wait = start - submitted.pop(id(batch), start)
                    self.ingest[peer.kind].append((wait, time.monotonic() - start, time.thread_time() - cpu))
        hub._on_events, hub._record = timed_on_events, timed_record


class BenchCluster(Cluster):
    """The cluster topology with the stand-in processes launched instead of `gyre cell` / `gyre proxy`."""

    def __init__(self, scenario: Scenario, timings: Timings, stats_dir: Path) -> None:
        super().__init__()
        self.scenario, self.timings, self.stats_dir = scenario, timings, stats_dir

    def open(self, host: RunHost) -> None:
        super().open(host)
        self.hub.command_cell = self.timings.command(self.hub.command_cell)  # type: ignore[method-assign]
        self.hub.command_proxy = self.timings.command(self.hub.command_proxy)  # type: ignore[method-assign]
        self.timings.hub(self.hub)

    def _spawn(self, adopt: bool) -> dict[str, str]:
        scenario = json.dumps(dataclasses.asdict(self.scenario))
        env = {**os.environ, SECRET_ENV: self.secret}
        base = [sys.executable, "-m", "benchmarks.control_plane_bench", "standin", "--address", self.address,
                "--scenario", scenario, "--core", self.config.cluster.core]
        cell_ids = self.config.cluster.cell_ids
        n = max(1, min(self.scenario.cell_processes, len(cell_ids)))
        cells: dict[str, subprocess.Popen[bytes]] = {}
        for i in range(n):
            share = cell_ids[i::n]
            process = subprocess.Popen([*base, "--cells", ",".join(share),
                                        "--stats", str(self.stats_dir / f"cells-{i}.json")], env=env, cwd=ROOT)
            cells.update(dict.fromkeys(share, process))
        proxy = subprocess.Popen([*base, "--proxy", "--stats", str(self.stats_dir / "proxy.json")], env=env, cwd=ROOT)
        self.supervisor = _StandIns(cells, proxy)  # type: ignore[assignment]
        self._closers.append(self.supervisor.reap)
        return {}


class _Elapsed(Exception):
    """The measurement window is over: ends the controller's loop."""


def _percentiles(values: list[float], scale: float = 1e3, *, summary: bool = False) -> dict[str, float | int]:
    """n, p50, p99, max and mean (with ``summary``: p50 and p99 only) of ``values``, times ``scale``."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 3)
    if summary:
        return {"p50": at(0.50), "p99": at(0.99)}
    return {"n": len(ordered), "p50": at(0.50), "p99": at(0.99), "max": round(ordered[-1] * scale, 3),
            "mean": round(statistics.fmean(ordered) * scale, 3)}


def _standin_stats(work: Path, start: float, end: float) -> dict[str, Any]:
    """The stand-in processes' reports: the cell processes' counts summed, each process's CPU and its loop's lag
    inside the measurement window (``start``..``end``, monotonic)."""
    def lag(report: dict[str, Any]) -> dict[str, float | int]:
        return _percentiles([value for at, value in report.pop("loop_lag", []) if start <= at <= end])

    result: dict[str, Any] = {}
    proxy = work / "proxy.json"
    if proxy.exists():
        report = json.loads(proxy.read_text())
        loop_lag = lag(report)
        result["proxy"] = {**report, "loop_lag_ms": loop_lag}
    cells: collections.Counter[str] = collections.Counter()
    processes = []
    for path in sorted(work.glob("cells-*.json")):
        report = json.loads(path.read_text())
        processes.append({"cpu_s": report.pop("cpu_s", 0.0), "loop_lag_ms": lag(report)})
        cells.update(report)
    if processes:
        result["cells"] = {**cells, "processes": processes}
    return result


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, by group (one actuator thread per cell: one group)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    groups: collections.Counter[str] = collections.Counter()
    for thread in psutil.Process().threads():
        name = names.get(thread.id, "native (grpc, ...)")
        group = "actuators (gyre-cell-*)" if name.startswith("gyre-cell-") else name
        groups[group] += thread.user_time + thread.system_time
    return dict(groups)


class LoopLag:
    """How late the hub's event loop runs a 10 ms timer: the wait any message on any stream sees there."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.lags: list[float] = []
        self.recording = False
        self.task = asyncio.run_coroutine_threadsafe(self._probe(), loop)

    async def _probe(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            if self.recording:
                self.lags.append(time.perf_counter() - started - 0.01)


class GcPauses:
    """The controller's garbage-collector pauses by generation (every thread stops for one)."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = collections.defaultdict(list)
        self.recording = False
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.recording:
            self.pauses[info["generation"]].append(time.perf_counter() - self._started)

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def _dir_bytes(path: Path) -> int:
    """Bytes the log holds: each file's size less the zeros the live segment keeps written ahead of its last
    frame (`gyre.log.writer.PREALLOCATE_BYTES`), which would otherwise hide its growth."""
    return sum(_written(f) for f in path.rglob("*") if f.is_file())


def _written(file: Path) -> int:
    size = file.stat().st_size
    tail = min(size, PREALLOCATE_BYTES + 4096)
    with file.open("rb") as f:
        f.seek(size - tail)
        data = f.read(tail)
    return size - (len(data) - len(data.rstrip(b"\0")))


def bench_config(scenario: Scenario, run_dir: Path) -> ClusterConfig:
    groups = max(1, scenario.cells * scenario.slots // (2 * GROUP_SIZE))  # staleness 1: two batches fill every slot
    return ClusterConfig(
        name="control-plane-bench", run_dir=str(run_dir), seed=scenario.seed, steps=10_000,
        cluster=ClusterSection(cells=scenario.cells, slots=scenario.slots, heartbeat_s=scenario.heartbeat_s or None,
                               dead_after_s=60.0, start_timeout_s=300.0),
        scheduler=ClusterSchedulerSection(policy="elastic", staleness=1,
                                          params={"switch_to_training_s": 0.5, "switch_to_rollout_s": 0.5}),
        rollout=RolloutSection(tasks=ROOT / "tasks/toy/tasks.toml", harness=ROOT / "agents/toy_agent/harness.toml",
                               groups_per_step=groups, group_size=GROUP_SIZE))


def measure(scenario: Scenario) -> dict[str, Any]:
    """One controller against ``scenario.cells`` stand-in cells; the figures over the measurement window."""
    work = Path(tempfile.mkdtemp(prefix="gyre-cp-bench-"))
    me = psutil.Process()
    rss_before = me.memory_info().rss
    timings = Timings()
    timings.keep_raw = scenario.raw
    topology = BenchCluster(scenario, timings, work)
    host: RunHost | None = None
    try:
        registered_started = time.perf_counter()
        host = RunHost(bench_config(scenario, work / "run"), topology)  # starts the stand-ins; registers the cells
        registered_s = time.perf_counter() - registered_started
        if not scenario.no_gc_freeze:
            gc.freeze()  # as `RunHost.run` does before it runs the controller
        if scenario.switch_interval_ms > 0:
            sys.setswitchinterval(scenario.switch_interval_ms / 1e3)
        controller = host.controller
        policy = controller.policy

        def decide(view: SchedulerView, params: Any) -> Any:
            started = time.perf_counter()
            try:
                return policy.decide(view, params)
            finally:
                timings.decide.append(time.perf_counter() - started)
        controller.policy = dataclasses.replace(policy, decide=decide)
        fold, step = controller._fold_new, controller.step
        round_ = {"started": 0.0, "open": False, "in_step": False, "fold": 0.0}

        def timed_fold() -> None:
            started = time.perf_counter()
            fold()
            if not round_["in_step"]:  # the round's folds (not the one after its decisions are recorded)
                timings.fold.append(time.perf_counter() - started)
                if not round_["open"]:
                    round_.update(started=started, open=True)

        def timed_step() -> None:
            started = time.perf_counter()
            round_["in_step"] = True
            try:
                step()
            finally:
                round_["in_step"] = False
            end = time.perf_counter()
            timings.step.append(end - started)
            timings.rounds.append(round_["fold"] + end - started)
            timings.ticks.append(round_["fold"] + (timings.decide[-1] if timings.decide else 0.0))

        writer = host.sink.writer
        commit, sync = writer.commit, writer._sync

        def timed_commit(*args: Any, **kwargs: Any) -> int:
            started = time.perf_counter()
            try:
                return commit(*args, **kwargs)
            finally:
                if timings.recording:
                    timings.commit.append(time.perf_counter() - started)

        def timed_sync(*args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            try:
                sync(*args, **kwargs)
            finally:
                if timings.recording:
                    timings.fsync.append(time.perf_counter() - started)

        writer.commit, writer._sync = timed_commit, timed_sync  # type: ignore[method-assign]
        record = controller.record

        def timed_record(events: Any) -> int:
            started = time.perf_counter()
            try:
                return record(events)
            finally:
                if timings.recording:
                    timings.decisions_durable.append(time.perf_counter() - started)
        controller.record = timed_record  # type: ignore[method-assign]
        controller._fold_new = timed_fold  # type: ignore[method-assign]
        controller.step = timed_step  # type: ignore[method-assign]
        kinds: collections.Counter[str] = collections.Counter()
        # counted from a batch's kind column: an observer of every kind that took events would have each row
        # of the run (every model call's tokens) decoded on the ingest thread, a cost of the benchmark's own
        controller.observe(lambda seq, event: kinds.update((event.kind,)) if timings.recording else None,
                           columns=lambda first, columns: kinds.update(columns.kinds) if timings.recording else None)
        switches: dict[str, list[float]] = collections.defaultdict(list)

        def switched(seq: int, event: Any) -> None:  # what an actuator lives: a switch, its commands and waits
            if timings.recording:
                switches[f"to_{event.to_role}"].append(event.duration_s)
        controller.observe(switched, kinds=("role_switch_completed",))
        log_path = host.log_path
        lag = LoopLag(topology.hub._thread.loop)
        pauses = GcPauses()
        threads_before: dict[str, float] = {}
        received_before: collections.Counter[str] = collections.Counter()
        window: dict[str, float] = {}
        warm_until = time.perf_counter() + scenario.warmup_s

        def tick(view: SchedulerView) -> None:
            now = time.perf_counter()
            round_.update(open=False, fold=now - round_["started"] if round_["open"] else 0.0)
            topology.tick(view)
            if not window and now >= warm_until:  # the workload has ramped up: the window opens
                window.update(t=now, mono=time.monotonic(), cpu=time.process_time(), folded=controller.stats.folded,
                              bytes=_dir_bytes(log_path), decisions=controller.stats.decisions)
                threads_before.update(_thread_cpu())
                received_before.update(topology.hub.received)
                timings.clear()
                timings.recording = lag.recording = pauses.recording = True
            elif window and now >= window["t"] + scenario.duration_s:
                raise _Elapsed

        with contextlib.suppress(_Elapsed):
            controller.run(tick=tick, tick_s=topology.tick_s)
        timings.recording = lag.recording = pauses.recording = False
        pauses.close()
        window["mono_end"] = time.monotonic()
        lag.task.cancel()
        threads_cpu = {name: round((cpu - threads_before.get(name, 0.0)) / (time.perf_counter() - window["t"]), 3)
                       for name, cpu in sorted(_thread_cpu().items(), key=lambda kv: -kv[1])}
        elapsed = time.perf_counter() - window["t"]
        received = {kind: round((n - received_before[kind]) / elapsed, 1)
                    for kind, n in sorted(topology.hub.received.items())}
        cpu_s = time.process_time() - window["cpu"]
        rss = me.memory_info().rss
        folded = controller.stats.folded - window["folded"]
        calls = kinds["model_call_finished"]
        log_bytes = _dir_bytes(log_path) - window["bytes"]
        view = controller.view
        state = {"policy_version": view.trainer.policy_version, "steps_trained": len(view.work.trained),
                 "decisions": controller.stats.decisions - window["decisions"],
                 "roles": collections.Counter(c.role for c in view.cluster.cells.values())}
        threads = threading.active_count()
        stopping = time.perf_counter()
        topology.stop()
        stop_s = time.perf_counter() - stopping
    finally:
        if host is not None:
            host.close()
        else:
            topology.close()
    standins = _standin_stats(work, window.get("mono", 0.0), window.get("mono_end", 0.0))
    shutil.rmtree(work, ignore_errors=True)
    rtt = {kind: _percentiles(values) for kind, values in sorted(timings.rtt.items())}
    parts = {kind: {part: _percentiles(values, summary=True) for part, values in by_part.items()}
             for kind, by_part in sorted(timings.parts.items())}
    cell = [v for kind, values in timings.rtt.items() if kind not in PROXY_KINDS and kind != "train" for v in values]
    proxy = [v for kind, values in timings.rtt.items() if kind in PROXY_KINDS for v in values]
    return {
        "cells": scenario.cells,
        "window_s": round(elapsed, 2),
        "register_s": round(registered_s, 2),
        "stop_s": round(stop_s, 2),
        "events_per_s": round(folded / elapsed, 1),
        "offered_calls_per_s": scenario.calls_per_s,
        "model_calls_per_s": round(calls / elapsed, 1),
        "events_by_kind": dict(kinds.most_common()),
        "cell_command_rtt_ms": _percentiles(cell),
        "proxy_command_rtt_ms": _percentiles(proxy),
        "command_rtt_ms_by_kind": rtt,
        "command_parts_ms_by_kind": parts,
        "tick_ms": _percentiles(timings.ticks),
        "switch_ms_by_direction": {d: _percentiles(v) for d, v in sorted(switches.items())},
        "fold_ms": _percentiles(timings.fold),
        "round_ms": _percentiles(timings.rounds),
        "decide_act_ms": _percentiles(timings.step),
        "policy_decide_ms": _percentiles(timings.decide),
        "decisions_durable_ms": _percentiles(timings.decisions_durable),
        "log_commit_ms": _percentiles(timings.commit),
        "log_fsync_ms": _percentiles(timings.fsync),
        "controller_cpu_cores": round(cpu_s / elapsed, 3),
        "controller_cpu_ms_per_cell_s": round(1e3 * cpu_s / elapsed / scenario.cells, 3),
        "controller_rss_mb": round(rss / 2**20, 1),
        "controller_rss_mb_per_cell": round((rss - rss_before) / 2**20 / scenario.cells, 3),
        "controller_threads": threads,
        "controller_cpu_cores_by_thread": {k: v for k, v in threads_cpu.items() if v >= 0.001},
        "hub_loop_lag_ms": _percentiles(lag.lags),
        "hub_ingest_ms_by_peer": {kind: {part: _percentiles([t[i] for t in values], summary=True)
                                         for i, part in enumerate(("queue", "wall", "cpu"))}
                                  for kind, values in sorted(timings.ingest.items())},
        "hub_messages_up_per_s": received,
        "gc_pause_ms_by_generation": {g: _percentiles(v) for g, v in sorted(pauses.pauses.items())},
        "log_mb_per_s": round(log_bytes / 2**20 / elapsed, 2),
        "log_bytes_per_call": round(log_bytes / max(1, calls)),
        "run": state,
        "standins": standins,
        **({"raw": timings.raw} if timings.keep_raw else {}),
    }


# ---------------------------------------------------------------------------------------------------------
# the stand-ins: the protocol's other end, in asyncio
# ---------------------------------------------------------------------------------------------------------


class _Stream:
    """One stand-in's stream: ordered writes, stamped event batches acknowledged by the hub."""

    def __init__(self, stub_connect: Any, secret: str, producers: list[str]) -> None:
        self.call = stub_connect(metadata=metadata(secret))
        self.write_lock = asyncio.Lock()
        self.producers = producers
        self.next_seq: dict[str, int] = {}
        self.run_id = ""
        self.batch_ids = 0
        self.acks: dict[int, asyncio.Future[gyre_pb2.EventAck]] = {}
        self.ack_s: list[float] = []
        self.closed = False
        self.last_up = time.monotonic()
        """When the last message was handed to `write` (the heartbeat is due ``heartbeat_s`` after it)."""
        self.heartbeat_s = 1.0
        """The period the hub's Welcome names (until it arrives, a second)."""

    async def write(self, message: Any) -> None:
        self.last_up = time.monotonic()
        async with self.write_lock:
            if not self.closed:
                await self.call.write(message)

    async def close(self) -> None:
        """No more writes (after a Stop's done): the hub sees the stream end, as a process's exit."""
        async with self.write_lock:
            if not self.closed:
                self.closed = True
                await self.call.done_writing()

    def welcomed(self, welcome: gyre_pb2.Welcome) -> None:
        self.run_id = welcome.run_id
        self.heartbeat_s = welcome.heartbeat_s
        self.next_seq = {p: welcome.held.get(p, -1) + 1 for p in self.producers}

    def stamp(self, producer: str, events: list[Event]) -> list[Event]:
        first = self.next_seq[producer]
        self.next_seq[producer] = first + len(events)
        return [e.model_copy(update={"producer": producer, "producer_seq": first + i, "run_id": self.run_id})
                for i, e in enumerate(events)]

    async def send(self, up: Callable[..., Any], events: list[Event]) -> asyncio.Future[gyre_pb2.EventAck]:
        self.batch_ids += 1
        batch_id = self.batch_ids
        future: asyncio.Future[gyre_pb2.EventAck] = asyncio.get_running_loop().create_future()
        self.acks[batch_id] = future
        sent = time.perf_counter()
        future.add_done_callback(lambda _: self.ack_s.append(time.perf_counter() - sent))
        await self.write(up(events=gyre_pb2.EventBatch(batch_id=batch_id, arrow_ipc=pack_events(events), wait=True)))
        return future

    def acked(self, ack: gyre_pb2.EventAck) -> None:
        if ack.error:
            raise RuntimeError(f"the hub refused batch {ack.batch_id}: {ack.error}")
        for batch_id in [b for b in self.acks if b <= ack.batch_id]:
            future = self.acks.pop(batch_id)
            if not future.done():
                future.set_result(ack)


CELL_FIGURES = {"serve": {"engine_resume_s": 0.0}, "pause": {"engine_pause_s": 0.0}, "release": {"release_s": 0.0},
                "load_weights": {"weights_bytes": 0.0, "weights_s": 0.0}, "join_step": {"trainer_join_s": 0.0},
                "to_rollout": {"trainer_leave_s": 0.0, "weights_bytes": 0.0, "weights_s": 0.0, "engine_resume_s": 0.0},
                "to_training": {"engine_pause_s": 0.0, "release_s": 0.0, "trainer_join_s": 0.0}}


async def _probe_lag(lags: list[tuple[float, float]]) -> None:
    """How late a stand-in process's loop runs a 10 ms timer (its share of a round trip), with when, on the
    monotonic clock: the controller keeps those inside its window."""
    while True:
        started = time.monotonic()
        await asyncio.sleep(0.01)
        lags.append((started, time.monotonic() - started - 0.01))


async def _cell(channel: grpc.aio.Channel, secret: str, cell_id: str, core: bool, scenario: Scenario,
                stats: dict[str, int]) -> None:
    stub = gyre_pb2_grpc.CellStub(channel)
    stream = _Stream(stub.Connect, secret, [f"cell:{cell_id}"] + (["trainer"] if core else []))
    hello = gyre_pb2.CellHello(cell_id=cell_id, slots=scenario.slots, is_core=core,
                               engine_url=f"http://stand-in/{cell_id}", trainer_endpoint="stand-in:0" if core else "",
                               incarnation=uuid.uuid4().hex, producers=stream.producers)
    await stream.write(gyre_pb2.CellUp(hello=hello))
    commands: asyncio.Queue[tuple[gyre_pb2.CellCommand, float] | None] = asyncio.Queue()
    asks: dict[int, asyncio.Future[gyre_pb2.WeightsAnswer]] = {}
    plans: dict[int, gyre_pb2.WeightsAnswer] = {}  # newer plans the hub sent, by command (as `ControllerLink`)

    async def beat() -> None:  # as `ControllerLink` does: once nothing else went up for heartbeat_s
        while True:
            wait = stream.last_up + stream.heartbeat_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                await stream.write(gyre_pb2.CellUp(heartbeat=gyre_pb2.Heartbeat(sent_us=time.time_ns() // 1000)))

    async def work() -> None:  # one command at a time, in order, as a cell's link runs them
        while (item := await commands.get()) is not None:
            command, received = item
            kind = command.WhichOneof("body")
            stats[kind] = stats.get(kind, 0) + 1
            figures = {**CELL_FIGURES.get(kind, {}), "bench_received_at": received}
            if kind == "to_rollout" and command.to_rollout.ask:  # its leave is over: which weights now?
                if command.to_rollout.HasField("plan") and not scenario.cell_asks:
                    stats["weights_planned"] = stats.get("weights_planned", 0) + 1
                    weights = plans.pop(command.command_id, command.to_rollout.plan)
                else:
                    stats["weights_ask"] = stats.get("weights_ask", 0) + 1
                    answer = asks[len(asks) + 1] = asyncio.get_running_loop().create_future()
                    await stream.write(gyre_pb2.CellUp(ask=gyre_pb2.WeightsAsk(ask_id=len(asks))))
                    weights = await answer
                if weights.load:
                    figures["weights_version"] = float(weights.weights.version)
            done = gyre_pb2.CommandDone(command_id=command.command_id, ok=True, figures=figures)
            if kind == "train":
                done.detail = (await _train(stream, command.train, scenario)).SerializeToString()
            done.figures["bench_answered_at"] = time.monotonic()
            await stream.write(gyre_pb2.CellUp(done=done))
            if kind == "stop":
                await stream.close()
                return

    beating, working = asyncio.create_task(beat()), asyncio.create_task(work())
    try:
        while (message := await stream.call.read()) is not grpc.aio.EOF:
            body = message.WhichOneof("body")
            if body == "welcome":
                stream.welcomed(message.welcome)
            elif body == "ack":
                stream.acked(message.ack)
            elif body == "command":
                commands.put_nowait((message.command, time.monotonic()))
            elif body == "weights" and message.weights.command_id:
                stats["weights_plan_changed"] = stats.get("weights_plan_changed", 0) + 1
                plans[message.weights.command_id] = message.weights
            elif body == "weights":
                asks[message.weights.ask_id].set_result(message.weights)
    except grpc.aio.AioRpcError:
        pass  # the controller went away: the benchmark is over
    finally:
        beating.cancel()
        commands.put_nowait(None)
        working.cancel()


async def _train(stream: _Stream, train: gyre_pb2.Train, scenario: Scenario) -> gyre_pb2.WeightsRef:
    """The core's Train: the step's trainer events, as the step coordinator records them, then a publish."""
    version = train.step + 1
    location = f"weights/v{version:06d}.safetensors"
    await stream.send(lambda **b: gyre_pb2.CellUp(**b), stream.stamp("trainer", [TrainStepStarted(
        step=train.step, policy_version=train.step, planned_micro_steps=1, groups=len(train.groups))]))
    await asyncio.sleep(scenario.train_s)
    ack = await stream.send(lambda **b: gyre_pb2.CellUp(**b), stream.stamp("trainer", [
        TrainStepFinished(step=train.step, policy_version=version, micro_steps=1, samples=len(train.groups),
                          duration_s=scenario.train_s),
        WeightsPublished(policy_version=version, location=location, sha256="0" * 64, bytes=1 << 30)]))
    await ack
    return gyre_pb2.WeightsRef(version=version, location=location, sha256="0" * 64)


@dataclasses.dataclass
class _Execution:
    spec: gyre_pb2.ExecutionSpec
    calls_left: int
    cell: str = ""
    call: int = 0
    in_call: bool = False
    started: float = 0.0
    prefix: int = 0


class _ProxyStandIn:
    """The proxy's side of the workload (see the module docstring)."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.rng = random.Random(scenario.seed)
        self.tokens = [self.rng.randrange(150_000) for _ in range(1 << 16)]
        self.logprobs = [-self.rng.expovariate(1.0) for _ in range(1 << 16)]
        self.routes: dict[str, gyre_pb2.CellRoute] = {}
        self.load: collections.Counter[str] = collections.Counter()
        self.pending: collections.deque[_Execution] = collections.deque()
        self.running: dict[str, _Execution] = {}
        self.due: list[tuple[float, int, str]] = []
        self.order = 0
        self.out: dict[str, list[Event]] = {"proxy": [], "harness": []}
        self.moved: list[Event] = []
        """`call_redirected` of the calls a redirect moved, recorded by the workload at its next tick: the real
        proxy's calls record them as they move (after the abort and the KV move), not its redirect command."""
        self.stats = collections.Counter[str]()

    def _slice(self, pool: list, n: int) -> list:
        at = self.rng.randrange(len(pool) - n)
        return pool[at:at + n]

    def _calls(self) -> int:
        """Heavy-tailed (log-normal, sigma 0.6, mean ``calls_mean``), cut at 3x the mean so that a step's tail
        ends within the window."""
        mean = self.s.calls_mean
        return max(1, min(round(self.rng.lognormvariate(0, 0.6) * mean / 1.197), round(3 * mean)))

    def _schedule(self, at: float, execution_id: str) -> None:
        self.order += 1
        heapq.heappush(self.due, (at, self.order, execution_id))

    def command(self, command: gyre_pb2.ProxyCommand) -> tuple[gyre_pb2.CommandDone, bool]:
        """The command's answer, and whether it waits for the events it recorded to be durable."""
        kind = command.WhichOneof("body")
        self.stats[f"command:{kind}"] += 1
        done = gyre_pb2.CommandDone(command_id=command.command_id, ok=True)
        if kind == "routing":
            self.routes = {r.cell_id: r for r in command.routing.cells}
        elif kind == "queue":
            for spec in command.queue.executions:
                self.pending.append(_Execution(spec, self._calls()))
                self.out["harness"].append(ExecutionQueued(
                    execution_id=spec.execution_id, task_id=spec.task_id, group_id=spec.group_id,
                    policy_version=spec.policy_version, attempt=spec.attempt,
                    step=spec.step if spec.step >= 0 else None))
            return done, True
        elif kind == "redirect":  # records nothing: its calls do as they move (`gyre.cluster.proxy_node`)
            self._redirect(command.redirect, done)
        elif kind == "redirects":  # each cell's in order, its figures named by cell (as `gyre.cluster.proxy_node`)
            for redirect in command.redirects.cells:
                one = gyre_pb2.CommandDone()
                self._redirect(redirect, one)
                for name, value in one.figures.items():
                    done.figures[f"{redirect.from_cell_id}/{name}"] = value
        elif kind == "sync":
            done.detail = json.dumps(sorted(self.running)).encode()
        return done, False

    def _redirect(self, redirect: gyre_pb2.RedirectCell, done: gyre_pb2.CommandDone) -> None:
        source = redirect.from_cell_id
        if source in self.routes:
            self.routes[source].admitting = False
        for move in redirect.calls:
            execution = self.running.get(move.execution_id)
            if execution is None or execution.cell != source:
                continue
            self._move(execution, move.to_cell_id)
            self.moved.append(CallRedirected(execution_id=move.execution_id, call_id=move.call_id,
                                             from_cell_id=source, to_cell_id=move.to_cell_id))
        for execution in [e for e in self.running.values() if e.cell == source]:
            target = self._place(execution.spec.policy_version)
            if target is not None:
                self._move(execution, target)
        done.figures["redirected_calls"] = float(len(redirect.calls))
        done.figures["redirect_s"] = 0.0

    def _move(self, execution: _Execution, cell: str) -> None:
        self.load[execution.cell] -= 1
        execution.cell = cell
        self.load[cell] += 1

    def _place(self, version: int) -> str | None:
        best, free = None, 0
        for route in self.routes.values():
            room = route.slots - self.load[route.cell_id]
            if route.admitting and route.weights_version >= version and room > free:
                best, free = route.cell_id, room
        return best

    def advance(self, now: float) -> None:
        """Start what has a slot; make the calls that are due; finish what made its last call."""
        self.out["proxy"] += self.moved
        self.moved = []
        while self.pending:
            cell = self._place(self.pending[0].spec.policy_version)
            if cell is None:
                break
            execution = self.pending.popleft()
            execution.cell, execution.started = cell, now
            self.load[cell] += 1
            self.running[execution.spec.execution_id] = execution
            self.out["harness"].append(ExecutionStarted(execution_id=execution.spec.execution_id, cell_id=cell))
            first_call = now + self.rng.uniform(0, self.s.call_interval_s - self.s.call_s)
            self._schedule(first_call, execution.spec.execution_id)
        while self.due and self.due[0][0] <= now:
            _, _, execution_id = heapq.heappop(self.due)
            execution = self.running[execution_id]
            spec = execution.spec
            call_id = f"{execution_id}-c{execution.call}"
            if not execution.in_call:
                execution.in_call = True
                self.out["proxy"].append(ModelCallStarted(
                    execution_id=execution_id, call_id=call_id, cell_id=execution.cell, attempt=spec.attempt,
                    prompt_tokens=execution.prefix + self.s.prompt_delta_tokens, policy_version=spec.policy_version))
                self._schedule(now + self.s.call_s, execution_id)
                continue
            self.out["proxy"].append(ModelCallFinished(
                execution_id=execution_id, call_id=call_id, cell_id=execution.cell, attempt=spec.attempt,
                parent_call_id=f"{execution_id}-c{execution.call - 1}" if execution.call else None,
                prefix_len=execution.prefix, prompt_delta_ids=self._slice(self.tokens, self.s.prompt_delta_tokens),
                output_ids=self._slice(self.tokens, self.s.output_tokens),
                output_logprobs=self._slice(self.logprobs, self.s.output_tokens),
                policy_version=spec.policy_version, latency_s=self.s.call_s))
            self.stats["calls_finished"] += 1
            execution.in_call, execution.call = False, execution.call + 1
            execution.prefix += self.s.prompt_delta_tokens + self.s.output_tokens
            execution.calls_left -= 1
            if execution.calls_left > 0:
                self._schedule(now + self.s.call_interval_s - self.s.call_s, execution_id)
                continue
            del self.running[execution_id]
            self.load[execution.cell] -= 1
            self.out["harness"] += [
                ExecutionFinished(execution_id=execution_id, status="completed", duration_s=now - execution.started),
                RewardRecorded(execution_id=execution_id, reward=self.rng.random(), evaluator="stand-in")]
            self.stats["executions_finished"] += 1

    def take(self) -> dict[str, list[Event]]:
        """What happened since the last take, by producer (``proxy``: calls; ``harness``: executions)."""
        out, self.out = self.out, {"proxy": [], "harness": []}
        return out


def _proxy(address: str, secret: str, scenario: Scenario, stats: dict[str, Any],
           lags: list[tuple[float, float]]) -> None:
    """The proxy stand-in on the real proxy's streams: its events lane, a `ControllerLink` (its loop packs and
    sends what was recorded, coalescing what waits) fed by a workload thread that records each event on its own,
    as the proxy's HTTP loop and the harness runner do, and its commands lane, a second `ControllerLink` whose
    command thread runs one command at a time (``proxy_one_stream``: one link for both, as before). Only the
    engines and harnesses are played (`_ProxyStandIn`); commands are answered as `gyre.cluster.proxy_node`
    answers them (a queue once its events are in the controller's log, a sync once everything is; a redirect at
    once — the real proxy's `call_redirected` are recorded by the calls as they move, after the command)."""
    state, recording = threading.Lock(), threading.Lock()
    stopping = threading.Event()
    proxy = _ProxyStandIn(scenario)
    producers: dict[str, Any] = {}

    def record(events: dict[str, list[Event]]) -> int:
        """Each event recorded on its own, as the proxy and the runner record them; the last position."""
        position = -1
        for producer in ("proxy", "harness"):  # the calls before their executions' fate
            for event in events[producer]:
                position = producers[producer].record(event)
        return position

    read_at: dict[int, float] = {}

    def handle(command: gyre_pb2.ProxyCommand) -> gyre_pb2.CommandDone | Durable:
        received = time.monotonic()
        with state:
            done, durable = proxy.command(command)
            events = proxy.take()
            made = any(events.values())
            if made:  # a command that made none (a routing) waits for no tick's recording: the real one does not
                recording.acquire()  # in the order they happened, but the workload goes on meanwhile
        position = -1
        if made:
            try:
                position = record(events)
            finally:
                recording.release()
        done.figures["bench_received_at"] = received
        done.figures["bench_read_at"] = read_at.pop(command.command_id, received)
        done.figures["bench_handled_at"] = time.monotonic()
        if command.WhichOneof("body") == "sync":
            link.sink.commit(remote=True)
            commands.wait_deferred()
        if command.WhichOneof("body") == "stop":
            stopping.set()
        done.figures["bench_answered_at"] = time.monotonic()
        if not durable:
            return done
        # on one stream the done goes up behind its events; up the commands lane, once the controller holds them
        return Durable(done, position, sink=link.sink, remote=lanes)

    lanes = not scenario.proxy_one_stream
    hello = gyre_pb2.ProxyHello(proxy_id="proxy", url="http://stand-in/proxy", producers=["proxy", "harness"],
                                lanes=[COMMANDS_LANE] if lanes else [])
    link = ControllerLink(address, secret=secret, handler=None if lanes else handle, hello=hello)
    commands = link if not lanes else ControllerLink(address, secret=secret, handler=handle, hello=gyre_pb2.ProxyHello(
        proxy_id="proxy", incarnation=link.hello.incarnation, lanes=[COMMANDS_LANE], lane=COMMANDS_LANE))
    on_command = commands._on_command

    def timed_on_command(command: gyre_pb2.ProxyCommand) -> None:  # when the link's loop read it
        read_at.setdefault(command.command_id, time.monotonic())
        on_command(command)
    commands._on_command = timed_on_command  # type: ignore[method-assign]
    finished = commands._finished

    def timed_finished(done: gyre_pb2.CommandDone) -> None:  # the done queued up the call (the link's loop)
        done.figures["bench_queued_at"] = time.monotonic()
        conn = commands._conn
        done.figures["bench_ahead"] = float(conn.queue.qsize()) if conn is not None else -1.0
        finished(done)
    commands._finished = timed_finished  # type: ignore[method-assign]

    class TimedConn(link_module._Conn):  # stamps a done as its write begins (after everything queued before it)
        def __init__(self, call: Any) -> None:
            super().__init__(call)
            write = call.write

            async def timed_write(message: Any) -> None:
                if message.WhichOneof("body") == "done":
                    message.done.figures["bench_written_at"] = time.monotonic()
                await write(message)
            call.write = timed_write
    link_module._Conn = TimedConn  # type: ignore[misc]
    link.start()
    if lanes:
        commands.start()
    producers.update(proxy=link.producer("proxy"), harness=link.producer("harness"))
    probe = asyncio.run_coroutine_threadsafe(_probe_lag(lags), link._thread.loop)  # the stream's loop
    acks: list[float] = []

    def play() -> None:  # the engines and harnesses: calls finish on a grid of tick_s
        next_at = time.perf_counter()
        while not stopping.wait(max(0.0, next_at - time.perf_counter())):
            next_at += scenario.tick_s
            with state:
                proxy.advance(time.perf_counter())
                events = proxy.take()
                recording.acquire()
            try:
                record(events)
            finally:
                recording.release()

    def sample_acks() -> None:  # how long what was just recorded takes to be durable (a reply waits for it)
        while not stopping.wait(0.1):
            sent = time.perf_counter()
            try:
                link.sink.commit(remote=True, timeout_s=60)
            except (GyreError, TimeoutError):
                return
            acks.append(time.perf_counter() - sent)

    threads = [threading.Thread(target=play, daemon=True), threading.Thread(target=sample_acks, daemon=True)]
    for thread in threads:
        thread.start()
    stopping.wait()
    for thread in threads:
        thread.join(10)
    probe.cancel()
    link.close(timeout_s=30)
    if lanes:
        commands.close(timeout_s=30)
    stats.update(proxy.stats)
    stats["event_ack_ms"] = _percentiles(acks)
    stats["sent"] = dict(link.sent)
    stats["sent_commands_lane"] = dict(commands.sent) if lanes else {}


def standin_main(args: argparse.Namespace) -> None:
    scenario = Scenario(**json.loads(args.scenario))
    secret = auth.from_env(SECRET_ENV, "run secret")
    stats: dict[str, Any] = {}
    started = time.process_time()
    lags: list[tuple[float, float]] = []

    async def main() -> None:
        probe = asyncio.create_task(_probe_lag(lags))
        try:
            await serve()
        finally:
            probe.cancel()

    async def serve() -> None:
        channels = [grpc.aio.insecure_channel(args.address, options=GRPC_OPTIONS) for _ in args.cells.split(",")]
        try:
            await asyncio.gather(*(_cell(channel, secret, cell, cell == args.core, scenario, stats)
                                   for channel, cell in zip(channels, args.cells.split(","), strict=True)))
        finally:
            for channel in channels:
                await channel.close()

    if args.proxy:
        _proxy(args.address, secret, scenario, stats, lags)
    else:
        asyncio.run(main())
    stats["cpu_s"] = round(time.process_time() - started, 2)
    stats["loop_lag"] = lags
    Path(args.stats).write_text(json.dumps(stats))


# ---------------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------------


def _profile_summary(collapsed: Path, top: int = 12) -> dict[str, Any]:
    """py-spy's collapsed stacks (wall clock: idle samples included) -> per thread group, the share of its
    samples in each function, leaf (self) and anywhere on the stack (total). Actuator threads (one per cell)
    are one group."""
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    samples: collections.Counter[str] = collections.Counter()
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].partition(": ")[2] or "unnamed"
        group = "gyre-cell-*" if name.startswith("gyre-cell-") else name
        samples[group] += int(count)
        own[group][frames[-1]] += int(count)
        for frame in set(frames[1:]):
            total[group][frame] += int(count)
    return {group: {"samples": n,
                    "self_pct": [[f, round(100 * c / n, 1)] for f, c in own[group].most_common(top)],
                    "total_pct": [[f, round(100 * c / n, 1)] for f, c in total[group].most_common(top)]}
            for group, n in samples.most_common(6)}


def run_one(scenario: Scenario, profile: Path | None) -> dict[str, Any]:
    """``scenario`` in a fresh controller process (under py-spy with ``profile``)."""
    out = Path(tempfile.mkdtemp(prefix="gyre-cp-result-")) / "result.json"
    command = [sys.executable, "-m", "benchmarks.control_plane_bench", "controller",
               "--scenario", json.dumps(dataclasses.asdict(scenario)), "--out", str(out)]
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        collapsed = profile / f"controller-{scenario.cells}.txt"
        command = [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking",
                   "--threads", "--format", "raw", "-r", "100", "-o", str(collapsed), "--", *command]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the controller for {scenario.cells} cells failed ({done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent)
    if profile is not None:
        result["profile"] = _profile_summary(collapsed)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    parser.add_argument("--cells", default="64,256", help="cell counts, comma-separated")
    for field in dataclasses.fields(Scenario):
        if field.name not in ("cells",):
            flag = f"--{field.name.replace('_', '-')}"
            if isinstance(field.default, bool):
                parser.add_argument(flag, action="store_true")
            else:
                parser.add_argument(flag, type=type(field.default), default=field.default)
    parser.add_argument("--profile", type=Path, help="sample each controller with py-spy; stacks go here")
    parser.add_argument("--json", action="store_true", help="accepted for scripts: the report is always JSON")
    controller = sub.add_parser("controller")
    controller.add_argument("--scenario", required=True)
    controller.add_argument("--out", type=Path, required=True)
    standin = sub.add_parser("standin")
    standin.add_argument("--address", required=True)
    standin.add_argument("--scenario", required=True)
    standin.add_argument("--core", required=True)
    standin.add_argument("--cells", default="")
    standin.add_argument("--proxy", action="store_true")
    standin.add_argument("--stats", required=True)
    args = parser.parse_args(argv)
    if args.role == "standin":
        standin_main(args)
        return {}
    if args.role == "controller":
        result = measure(Scenario(**json.loads(args.scenario)))
        args.out.write_text(json.dumps(result))
        return result
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(Scenario) if f.name != "cells"}
    results = [run_one(Scenario(cells=int(n), **base), args.profile) for n in args.cells.split(",")]
    report = {"benchmark": "control_plane", "machine": f"{os.cpu_count()} cores", "scenario": base,
              "runs": results}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
