"""`gyre run CONFIG`: the controller of a cluster run, with every cell and the proxy as its own process.

The controller process holds the run's one log writer, folds it, runs the configured policy and the run's
plan (`gyre.controller.Controller`, the same loop `gyre train` runs in one process), and serves the Cell,
Proxy and Admin services (`gyre.cluster.hub`). It starts the processes — ``cells`` × `gyre cell` and one
`gyre proxy serve --controller` (which runs the harnesses) — hands them the run secret through their
environment, waits until each has connected, records `cell_registered` for each in cell order with the
policy's initial roles, and then drives the run; when the plan is finished it tells every process to stop.

What a user sees: live progress (watermark, each cell's role, step, reward) and, at the end, a summary and a
per-cell role timeline — both folded from the log, so `gyre log sql` reproduces them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre import auth
from gyre.cluster.actuator import CellInfo, ClusterRollouts, Commands, Directory, RemoteCell
from gyre.cluster.auth import SECRET_ENV
from gyre.cluster.config import ClusterConfig
from gyre.cluster.proto import gyre_pb2
from gyre.controller import Controller, RunPlan
from gyre.errors import ConfigError
from gyre.events.models import (
    CellLost,
    CellRegistered,
    Event,
    ExecutionQueued,
    RewardRecorded,
    RoleSwitchCompleted,
    RunFinished,
    RunStarted,
    TrainStepFinished,
)
from gyre.log import LogWriter
from gyre.scheduler import CellSpec, SchedulerView, get_policy
from gyre.sink import LogSink
from gyre.train.build import PlannedExecution, rollout_tasks, step_plan

Progress = Callable[[str, dict], None]


@dataclass
class RoleSpan:
    cell_id: str
    role: str
    start_s: float
    end_s: float | None = None


@dataclass
class ClusterSummary:
    run_id: str
    log: Path
    status: str
    policy: str
    wall_s: float
    steps: list[dict] = field(default_factory=list)
    switches: int = 0
    timeline: list[RoleSpan] = field(default_factory=list)


class ClusterRun:
    """Owns the controller, the hub and the child processes of one cluster run."""

    def __init__(self, config: ClusterConfig, progress: Progress | None = None) -> None:
        from gyre.cluster.hub import Hub

        self.config = config
        self.progress = progress or (lambda phase, figures: None)
        self.run_dir = Path(config.run_dir)
        self.log_path = self.run_dir / "log"
        if self.log_path.exists() and any(self.log_path.glob("*.seg")):
            raise ConfigError(f"{self.run_dir} already holds a run's log; give another run_dir (a cluster run "
                              f"cannot be resumed yet)")
        _, self.task_ids = rollout_tasks(config.rollout)  # unknown task ids refused before anything starts
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        self.secret = auth.mint(auth.RUN_PREFIX)
        self.policy = get_policy(config.scheduler.policy)
        try:
            self.params = self.policy.params(config.policy_params())
        except ValueError as error:
            raise ConfigError(f"scheduler.params do not fit policy {self.policy.version}: {error}") from error
        self.sink = LogSink(LogWriter(self.log_path, run_id=self.run_id))
        self.directory = Directory()
        self.processes: dict[str, subprocess.Popen] = {}
        self._closers: list[Callable[[], None]] = []
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._rewards: dict[int, list[float]] = {}
        self._step_of: dict[str, int] = {}
        self._steps: list[dict] = []
        try:
            self.hub = Hub(self.sink, run_id=self.run_id, secret=self.secret, host=config.cluster.host,
                           port=config.cluster.port, heartbeat_s=config.cluster.heartbeat_s,
                           dead_after_s=config.cluster.dead_after_s, status=self.status)
            self.hub.on_cell_hello = self._hello
            self.hub.on_cell_lost = self._cell_lost
            self.commands = Commands(self.hub)
            self.controller = Controller(self.sink, self.policy, self.params,
                                         RunPlan(steps=config.steps, staleness=config.scheduler.staleness),
                                         cells={}, rollouts=ClusterRollouts(self.commands, self._plan, self._queued))
            self.controller.observe(self._observe)
            self.address = self.hub.start()
            self._closers.append(self.hub.stop)
            self.controller.record(RunStarted(
                run_id=self.run_id, name=config.name, policy=self.policy.name, policy_version=self.policy.version,
                policy_params=self.params.model_dump_json(), config=config.model_dump_json(), seed=config.seed,
                decision_points="explicit"))
            self._spawn()
            self._register()
        except BaseException:
            self.close()
            raise

    # -- processes -------------------------------------------------------------------------------------------

    def _spawn(self) -> None:
        """Start every cell and the proxy; the secret travels in the environment, never on argv."""
        config_file = self.run_dir / "cluster-config.json"
        config_file.write_text(self.config.model_dump_json(indent=2))
        env = {**os.environ, SECRET_ENV: self.secret}
        logs = self.run_dir / "processes"
        logs.mkdir(exist_ok=True)
        gyre = [sys.executable, "-m", "gyre"]
        commands = {cell: [*gyre, "cell", "--controller", self.address, "--cell-id", cell, "--config", str(config_file)]
                    for cell in self.config.cluster.cell_ids}
        commands["proxy"] = [*gyre, "proxy", "serve", "--controller", self.address, "--config", str(config_file)]
        for name, argv in commands.items():
            with open(logs / f"{name}.log", "ab") as out:
                self.processes[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                        stdin=subprocess.DEVNULL)
        self.progress("spawned", {"processes": sorted(self.processes), "logs": str(logs)})
        self._closers.append(self._reap)

    def _hello(self, hello: gyre_pb2.CellHello) -> None:
        """A process (a new incarnation: its engine holds the initial weights) says where it serves."""
        with self.directory.lock:
            known = self.directory.cells.get(hello.cell_id)
            self.directory.cells[hello.cell_id] = CellInfo(
                hello.cell_id, hello.slots, hello.is_core, hello.engine_url, hello.trainer_endpoint,
                role=known.role if known else "rollout")

    def _cell_lost(self, cell_id: str, reason: str) -> None:
        self.controller.fail(RuntimeError(f"cell {cell_id} was lost: {reason}"))

    def _register(self) -> None:
        """Wait for every process, then record the cells with the policy's initial roles and set them so."""
        cluster = self.config.cluster
        try:
            self.hub.wait_for(cluster.cell_ids, proxy=True, timeout_s=cluster.start_timeout_s)
        except TimeoutError as error:
            dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
            raise ConfigError(f"the cluster did not come up: {error}; exited: {dead or 'none'} (their output is "
                              f"in {self.run_dir / 'processes'})") from error
        cells = [self.directory.cells[c] for c in cluster.cell_ids]
        cores = [c.cell_id for c in cells if c.is_core]
        if cores != [cluster.core]:
            raise ConfigError(f"cells {cores} say they are the core; the config names {cluster.core}")
        roles = self.policy.initial_roles([CellSpec(c.cell_id, is_core=c.is_core, slots=c.slots) for c in cells],
                                          self.params)
        self.controller.record([CellRegistered(cell_id=c.cell_id, role=roles[c.cell_id], is_core=c.is_core,
                                               slots=c.slots, address=c.engine_url) for c in cells])
        for c in cells:
            c.role = roles[c.cell_id]
            if c.role == "training":
                self.commands.cell(c.cell_id, "pause", pause=gyre_pb2.Pause(mode="abort"))
            self.controller.cells[c.cell_id] = RemoteCell(
                c.cell_id, commands=self.commands, directory=self.directory,
                sink=self.sink.producer(f"actuator:{c.cell_id}"), fail=self.controller.fail,
                upto=lambda: self.controller.folded_seq)
            self._closers.append(self.controller.cells[c.cell_id].close)
        self.commands.proxy("routing", routing=self.directory.routing())

    def _plan(self, step: int) -> list[PlannedExecution]:
        return step_plan(self.run_id, self.config.rollout, self.task_ids, step)

    # -- progress -------------------------------------------------------------------------------------------

    def _queued(self, step: int, executions: int, version: int) -> None:
        self.progress("rollout", {"step": step, "queued": executions, "version": version})

    def _observe(self, seq: int, event: Event) -> None:
        with self._lock:
            if isinstance(event, ExecutionQueued) and event.step is not None:
                self._step_of[event.execution_id] = event.step
            elif isinstance(event, RewardRecorded) and event.execution_id in self._step_of:
                self._rewards.setdefault(self._step_of[event.execution_id], []).append(event.reward)
            elif isinstance(event, TrainStepFinished):
                rewards = self._rewards.get(event.step, [])
                record = {"step": event.step, "policy_version": event.policy_version,
                          "micro_steps": event.micro_steps, "loss": event.loss,
                          "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                          "scored": len(rewards), "wall_s": time.monotonic() - self._started}
                self._steps.append(record)
                self.progress("step", record)
            elif isinstance(event, RoleSwitchCompleted):
                self.progress("switch", {"cell": event.cell_id, "to": event.to_role, "seconds": event.duration_s})

    def _tick(self, view: SchedulerView) -> None:
        cells = {c.cell_id: (c.switching_to and f"{c.role}->{c.switching_to}") or c.role
                 for c in sorted(view.cluster.cells.values(), key=lambda c: c.cell_id)}
        self.progress("tick", {"watermark": view.watermark, "cells": cells,
                               "version": view.trainer.policy_version, "trained": len(view.work.trained),
                               "steps": self.config.steps})

    def status(self) -> gyre_pb2.StatusReply:
        view = self.controller.view
        cells = [gyre_pb2.CellStatus(cell_id=c.cell_id, role=c.role, switching_to=c.switching_to or "",
                                     connected=self.hub.connected(c.cell_id), is_core=c.is_core, slots=c.slots,
                                     load=view.load(c.cell_id),
                                     last_heartbeat_age_s=self.hub.heartbeat_age(c.cell_id) or 0.0)
                 for c in sorted(view.cluster.cells.values(), key=lambda c: c.cell_id)]
        return gyre_pb2.StatusReply(run_id=self.run_id, folded_seq=self.controller.folded_seq,
                                    watermark=view.watermark, policy_version=view.trainer.policy_version,
                                    steps_trained=len(view.work.trained), cells=cells, policy=self.policy.version)

    # -- the run ------------------------------------------------------------------------------------------

    def run(self) -> ClusterSummary:
        status = "completed"
        try:
            self.controller.run(tick=self._tick, tick_s=0.5)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except BaseException:
            status = "failed"
            raise
        finally:
            self._stop_processes()
            try:
                self.controller.record(RunFinished(run_id=self.run_id, status=status,
                                                   message=json.dumps({"steps": len(self._steps)})))
            finally:
                self.close()
        return self.summary(status)

    def _stop_processes(self) -> None:
        """Ask every connected process to stop (the proxy first: its harnesses end), then wait for them."""
        for name in ["proxy", *self.config.cluster.cell_ids]:
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            try:
                if name == "proxy":
                    self.hub.command_proxy(gyre_pb2.ProxyCommand(stop=gyre_pb2.Stop())).result(60)
                elif self.hub.connected(name):
                    self.hub.command_cell(name, gyre_pb2.CellCommand(stop=gyre_pb2.Stop())).result(60)
            except Exception:  # a process that cannot be told is terminated below
                continue
        self._reap()

    def _reap(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def summary(self, status: str) -> ClusterSummary:
        return ClusterSummary(self.run_id, self.log_path, status, self.policy.version,
                              time.monotonic() - self._started, list(self._steps), *role_timeline(self.log_path))

    def close(self) -> None:
        """Stop everything this run started, then commit and close the log. Idempotent."""
        try:
            while self._closers:
                self._closers.pop()()
        finally:
            self.sink.close()


def role_timeline(log_path: Path) -> tuple[int, list[RoleSpan]]:
    """Each cell's roles over the run (seconds from run start), folded from the log; and the switch count."""
    from gyre.log import LogReader

    spans: dict[str, RoleSpan] = {}
    timeline: list[RoleSpan] = []
    start = None
    switches = 0
    last = 0.0
    for event in LogReader(log_path).events(kinds=["run_started", "cell_registered", "role_switch_completed",
                                                   "run_finished", "cell_lost"]):
        assert event.ts is not None
        if start is None:
            start = event.ts
        t = (event.ts - start).total_seconds()
        last = t
        if isinstance(event, CellRegistered):
            spans[event.cell_id] = RoleSpan(event.cell_id, event.role, t)
        elif isinstance(event, RoleSwitchCompleted):
            switches += 1
            previous = spans.get(event.cell_id)
            if previous is not None:
                previous.end_s = t
                timeline.append(previous)
            spans[event.cell_id] = RoleSpan(event.cell_id, event.to_role, t)
        elif isinstance(event, CellLost) and event.cell_id in spans:
            spans[event.cell_id].end_s = t
            timeline.append(spans.pop(event.cell_id))
    for span in spans.values():
        span.end_s = last
        timeline.append(span)
    return switches, sorted(timeline, key=lambda s: (s.cell_id, s.start_s))
