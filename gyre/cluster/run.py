"""`gyre run CONFIG`: the controller of a cluster run, with every cell and the proxy as its own process.

The controller process holds the run's one log writer, folds it, runs the configured policy and the run's
plan (`gyre.controller.Controller`, the same loop `gyre train` runs in one process), and serves the Cell,
Proxy and Admin services (`gyre.cluster.hub`). It starts the processes — ``cells`` × `gyre cell` and one
`gyre proxy serve --controller` (which runs the harnesses) — hands them the run secret through their
environment, waits until each has connected, records `cell_registered` for each in cell order with the
policy's initial roles, and then drives the run; when the plan is finished it tells every process to stop.

The controller also supervises (`gyre.cluster.supervisor`). A cell or the proxy that dies or stops answering
is declared lost at once: ``cell_lost`` is recorded, the proxy stops placing executions on the cell (its
in-flight calls move when its engine fails them), the process is started again, and its new incarnation is
registered (``cell_registered``) in the role the policy gives a new cell and brought up in it (weights
loaded, or a paused engine joining training; a restarted core restores its trainer from the last
checkpoint plus the log, and the step it died in is trained again). A restarted proxy lost its harnesses:
their executions run again as new attempts (`gyre.controller.plan.rollouts_to_resubmit`).

`gyre run CONFIG --resume` restarts a controller that was killed: it reads the run secret
(``secrets.toml``, 0600) and the address (``controller.addr``) from the run directory, folds the log, listens
where its processes reconnect, adopts the processes still running (pid files) and starts the others; then,
before it decides anything, it sends every process a Sync (done once every earlier command is done and
everything recorded is durable), folds again, and reconciles: a process that kept its incarnation keeps its
role, a switch that was under way is performed again, executions the proxy no longer holds are submitted
again, and ``run_resumed`` records what it found.

What a user sees: live progress (watermark, each cell's role, step, reward) and, at the end, a summary and a
per-cell role timeline — both folded from the log, so `gyre log sql` reproduces them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre import auth
from gyre.cluster.actuator import (
    CellInfo,
    ClusterRollouts,
    Commands,
    Directory,
    RemoteCell,
    execution_spec,
    wait_done,
)
from gyre.cluster.auth import SECRET_ENV
from gyre.cluster.config import ClusterConfig
from gyre.cluster.proto import gyre_pb2
from gyre.cluster.supervisor import Supervisor
from gyre.controller import Controller, RunPlan
from gyre.controller.actuator import OrderedActions
from gyre.controller.plan import rollouts_to_resubmit
from gyre.errors import ConfigError
from gyre.events.models import (
    CellLost,
    CellRegistered,
    Event,
    ExecutionQueued,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunFinished,
    RunResumed,
    RunStarted,
    TrainStepFinished,
    WeightsPublished,
)
from gyre.log import LogReader, LogWriter
from gyre.scheduler import CellSpec, SchedulerView, get_policy
from gyre.sink import LogSink
from gyre.train.build import PlannedExecution, rollout_tasks, step_plan
from gyre.train.loop import config_differences, queued_attempts, run_start

Progress = Callable[[str, dict], None]

SECRETS = "secrets.toml"
"""The run secret, in the run directory (0600): a resumed controller must hold the secret its processes use."""
ADDRESS = "controller.addr"
"""The hub's host:port, in the run directory: a resumed controller listens where the processes reconnect."""


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
    """Owns the controller, the hub and the processes of one cluster run (see the module docstring)."""

    def __init__(self, config: ClusterConfig, progress: Progress | None = None, *, resume: bool = False) -> None:
        from gyre.cluster.hub import Hub

        self.config = config
        self.progress = progress or (lambda phase, figures: None)
        self.run_dir = Path(config.run_dir)
        self.log_path = self.run_dir / "log"
        _, self.task_ids = rollout_tasks(config.rollout)  # unknown task ids refused before anything starts
        self.resumed = resume
        host, port = config.cluster.host, config.cluster.port
        secrets = auth.TokenFile(self.run_dir / SECRETS)
        held = run_start(self.log_path)
        if resume:
            self.run_id, self.secret, host, port = self._resumable(held, secrets)
        elif held is not None:
            raise ConfigError(f"{self.run_dir} already holds the log of run {held.run_id}; give another run_dir, "
                              f"or --resume to continue that run")
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
            self.secret = auth.mint(auth.RUN_PREFIX)
            secrets.write({"run": self.secret})
        self.policy = get_policy(config.scheduler.policy)
        try:
            self.params = self.policy.params(config.policy_params())
        except ValueError as error:
            raise ConfigError(f"scheduler.params do not fit policy {self.policy.version}: {error}") from error
        self.sink = LogSink(LogWriter(self.log_path, run_id=self.run_id))
        self.directory = Directory()
        self._closers: list[Callable[[], None]] = []
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._rewards: dict[int, list[float]] = {}
        self._step_of: dict[str, int] = {}
        self._steps: list[dict] = []
        self._hellos: dict[str, gyre_pb2.CellHello] = {}
        self._hello_starts: dict[str, int] = {}
        self._live = False  # registered: from now on a hello or a loss is a membership change
        self.lost_cells = 0
        try:
            self.hub = Hub(self.sink, run_id=self.run_id, secret=self.secret, host=host, port=port,
                           heartbeat_s=config.cluster.heartbeat_s, dead_after_s=config.cluster.dead_after_s,
                           status=self.status)
            self.hub.on_cell_hello = self._on_cell_hello
            self.hub.on_cell_lost = self._on_cell_lost
            self.hub.on_proxy_hello = self._on_proxy_hello
            self.hub.on_proxy_lost = self._on_proxy_lost
            self.commands = Commands(self.hub, self.directory, self.sink.producer("commands"))
            self.controller = Controller(self.sink, self.policy, self.params,
                                         RunPlan(steps=config.steps, staleness=config.scheduler.staleness),
                                         cells={}, rollouts=ClusterRollouts(self.commands, self._plan, self._queued))
            self.controller.observe(self._observe)
            self.membership_sink = self.sink.producer("membership")
            self._stopping = False
            self._membership = OrderedActions("membership", self.controller.fail,
                                              tolerate=lambda error: self._stopping)  # the run ends meanwhile
            self._closers.append(self._membership.close)
            if resume:
                self.controller.catch_up(self.log_path)
            self.address = self.hub.start()
            self._closers.append(self.hub.stop)
            address_file = self.run_dir / ADDRESS
            address_file.with_suffix(".tmp").write_text(self.address + "\n")
            os.replace(address_file.with_suffix(".tmp"), address_file)
            (self.run_dir / "processes").mkdir(exist_ok=True)
            (self.run_dir / "processes" / "controller.pid").write_text(f"{os.getpid()}\n")
            if not resume:
                self.controller.record(RunStarted(
                    run_id=self.run_id, name=config.name, policy=self.policy.name,
                    policy_version=self.policy.version, policy_params=self.params.model_dump_json(),
                    config=config.model_dump_json(), seed=config.seed, decision_points="explicit"))
            how = self._spawn(adopt=resume)
            if resume:
                self._reattach(how)
            else:
                self._register()
            self._live = True
        except BaseException:
            self.close()
            raise

    def _resumable(self, held: RunStarted | None, secrets: auth.TokenFile) -> tuple[str, str, str, int]:
        """The run to resume: its id, secret and address, after checking the config is the one it began with."""
        if held is None:
            raise ConfigError(f"--resume: {self.run_dir} holds no run to resume")
        differences = config_differences(json.loads(held.config), json.loads(self.config.model_dump_json()))
        if differences:
            raise ConfigError(f"--resume: the config differs from the one run {held.run_id} started with: "
                              + "; ".join(differences))
        finished = [e for e in LogReader(self.log_path).events(kinds=["run_finished"])]
        if any(e.status == "completed" for e in finished):
            raise ConfigError(f"--resume: run {held.run_id} in {self.run_dir} has completed; nothing to resume")
        secret = secrets.read().get("run")
        if secret is None:
            raise ConfigError(f"--resume: {secrets.path} holds no run secret (a cluster run writes it when it starts)")
        try:
            host, port = (self.run_dir / ADDRESS).read_text().strip().rsplit(":", 1)
            return held.run_id, secret, host, int(port)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--resume: cannot read the controller's address from {self.run_dir / ADDRESS}: "
                              f"{error}") from error

    # -- processes -------------------------------------------------------------------------------------------

    def _spawn(self, adopt: bool) -> dict[str, str]:
        """Start every cell and the proxy (or adopt those still running); the secret travels in the
        environment, never on argv."""
        config_file = self.run_dir / "cluster-config.json"
        if not adopt:
            config_file.write_text(self.config.model_dump_json(indent=2))
        gyre = [sys.executable, "-m", "gyre"]
        commands = {cell: [*gyre, "cell", "--controller", self.address, "--cell-id", cell, "--config", str(config_file)]
                    for cell in self.config.cluster.cell_ids}
        commands["proxy"] = [*gyre, "proxy", "serve", "--controller", self.address, "--config", str(config_file)]

        def identity(name: str) -> list[str]:
            return [str(config_file), name] if name != "proxy" else [str(config_file), "proxy", "serve"]

        logs = self.run_dir / "processes"
        self.supervisor = Supervisor(logs, commands, {**os.environ, SECRET_ENV: self.secret}, identity=identity,
                                     on_exit=self._on_exit, on_give_up=self._on_give_up)
        how = self.supervisor.start(adopt=adopt)
        self._closers.append(self.supervisor.reap)
        self.progress("spawned", {"processes": sorted(commands), "logs": str(logs), "how": how})
        return how

    def _on_exit(self, name: str, reason: str) -> None:
        """The supervisor saw a process exit: lost now, not after missed heartbeats (it is started again)."""
        self.hub.lose("proxy" if name == "proxy" else "cell", name, reason)

    def _on_give_up(self, name: str, reason: str) -> None:
        self.controller.fail(RuntimeError(f"{name} keeps failing: {reason}"))

    # -- membership (hub callbacks: on the hub's loop thread, they must not block) -----------------------------

    def _on_cell_hello(self, hello: gyre_pb2.CellHello) -> None:
        """A new incarnation of a cell (a process start) says where it serves."""
        self._hellos[hello.cell_id] = hello
        self._hello_starts[hello.cell_id] = self.supervisor.starts(hello.cell_id)
        self.supervisor.said_hello(hello.cell_id)
        if self._live:
            self._membership.put(lambda: self._registered_again(hello))
            return
        with self.directory.lock:
            self.directory.cells[hello.cell_id] = _info(hello, "rollout")

    def _on_cell_lost(self, cell_id: str, reason: str) -> None:
        hello = self._hellos.get(cell_id)
        if hello is None:
            return
        if self.supervisor.starts(cell_id) == self._hello_starts.get(cell_id):
            self.supervisor.kill(cell_id)  # the lost incarnation still runs (it hung): it is started again
        if self._live:
            self._membership.put(lambda: self._cell_gone(cell_id, hello.incarnation, reason))

    def _on_proxy_hello(self, hello: gyre_pb2.ProxyHello) -> None:
        self._hello_starts["proxy"] = self.supervisor.starts("proxy")
        self.supervisor.said_hello("proxy")
        if self._live:
            self._membership.put(self._proxy_back)

    def _on_proxy_lost(self, proxy_id: str) -> None:
        if self.supervisor.starts("proxy") == self._hello_starts.get("proxy"):
            self.supervisor.kill("proxy")

    # -- membership (the membership thread: one change at a time, in the order the hub reported them) --------

    def _cell_gone(self, cell_id: str, incarnation: str, reason: str) -> None:
        info = self.directory.cells.get(cell_id)
        if info is None or info.incarnation != incarnation or info.lost:
            return
        with self.directory.lock:
            info.lost = True
            if info.is_core:  # the core's Mooncake copies of the weights died with it: the files remain
                w = self.directory.weights
                self.directory.weights = gyre_pb2.WeightsRef(version=w.version, location=w.location, sha256=w.sha256)
        self.lost_cells += 1
        self.membership_sink.commit(self.membership_sink.record(CellLost(cell_id=cell_id, reason=reason)))
        if info.is_core:
            self.controller.forget_training()
        actuator = self.controller.cells.get(cell_id)
        if actuator is not None:
            actuator.close(wait=False)
        self.commands.proxy("routing", routing=self.directory.routing())
        self.progress("lost", {"cell": cell_id, "reason": reason})

    def _registered_again(self, hello: gyre_pb2.CellHello) -> None:
        """A restarted cell: registered in the role the policy gives a new cell, then brought up in it."""
        cell_id = hello.cell_id
        known = self.directory.cells.get(cell_id)
        if known is not None and not known.lost and known.incarnation != hello.incarnation:
            self._cell_gone(cell_id, known.incarnation, f"replaced by incarnation {hello.incarnation}")
        role = self._initial_role(cell_id)
        info = _info(hello, role)
        with self.directory.lock:
            self.directory.cells[cell_id] = info

        def rejoin() -> None:  # the satellites' old Trainer service died with the core
            for other in list(self.directory.cells.values()):
                if other.cell_id != cell_id and not other.lost and other.role == "training":
                    self.controller.cells[other.cell_id].rejoin()

        # The new actuator, with the bring-up first in its queue, before the registration is in the log: the
        # policy may decide for the cell as soon as it folds it, and that decision must follow the bring-up.
        self._actuator(cell_id).bring_up(role, then=rejoin if info.is_core else None)
        self.membership_sink.commit(self.membership_sink.record(CellRegistered(
            cell_id=cell_id, role=role, is_core=info.is_core, slots=info.slots, address=info.engine_url,
            incarnation=hello.incarnation)))
        self.progress("registered", {"cell": cell_id, "role": role})

    def _initial_role(self, cell_id: str) -> str:
        cells = [CellSpec(c.cell_id, is_core=c.is_core, slots=c.slots) for c in self.directory.cells.values()]
        return self.policy.initial_roles(cells, self.params)[cell_id]

    def _actuator(self, cell_id: str) -> RemoteCell:
        actuator = RemoteCell(cell_id, commands=self.commands, directory=self.directory,
                              sink=self.sink.producer(f"actuator:{cell_id}"), fail=self.controller.fail,
                              upto=lambda: self.controller.folded_seq)
        actuator.on_lost_train = self.controller.forget_training
        self.controller.cells[cell_id] = actuator
        self._closers.append(actuator.close)
        return actuator

    def _proxy_back(self) -> None:
        """A restarted proxy: it gets the routing, and (on the controller's thread) the executions it lost."""
        self.commands.proxy("routing", routing=self.directory.routing())
        self.controller.submit(self._resubmit_rollouts)

    def _resubmit_rollouts(self, held: list[str] | None = None) -> None:
        """Submit again what no harness runs any more (on the controller's thread, or before its loop)."""
        if held is None:
            done = self.commands.proxy("sync", sync=gyre_pb2.Sync())
            if done is None:
                return  # lost again: its next incarnation's hello comes back here
            held = json.loads(done.detail or b"[]")
            self.controller.fold_now()
        view = self.controller.view
        resubmit = rollouts_to_resubmit(view, queued_attempts(self.log_path, self.run_id), self._plan_triples, held)
        if not resubmit:
            return
        version = view.trainer.policy_version
        specs = [execution_spec(r.execution_id, r.group_id, r.task_id, r.step, version, r.attempt) for r in resubmit]
        self.commands.proxy("resubmit", queue=gyre_pb2.QueueExecutions(executions=specs))
        self.progress("resubmitted", {"executions": len(specs)})

    def _plan_triples(self, step: int) -> list[tuple[str, str, str]]:
        return [(e.execution_id, e.group_id, e.task_id) for e in self._plan(step)]

    # -- starting and resuming ---------------------------------------------------------------------------------

    def _wait_connected(self) -> None:
        cluster = self.config.cluster
        try:
            self.hub.wait_for(cluster.cell_ids, proxy=True, timeout_s=cluster.start_timeout_s)
        except TimeoutError as error:
            raise ConfigError(f"the cluster did not come up: {error} (the processes' output is in "
                              f"{self.run_dir / 'processes'})") from error

    def _register(self) -> None:
        """Wait for every process, then record the cells with the policy's initial roles and set them so."""
        cluster = self.config.cluster
        self._wait_connected()
        cells = [self.directory.cells[c] for c in cluster.cell_ids]
        cores = [c.cell_id for c in cells if c.is_core]
        if cores != [cluster.core]:
            raise ConfigError(f"cells {cores} say they are the core; the config names {cluster.core}")
        roles = self.policy.initial_roles([CellSpec(c.cell_id, is_core=c.is_core, slots=c.slots) for c in cells],
                                          self.params)
        self.controller.record([CellRegistered(cell_id=c.cell_id, role=roles[c.cell_id], is_core=c.is_core,
                                               slots=c.slots, address=c.engine_url, incarnation=c.incarnation)
                                for c in cells])
        for c in cells:
            c.role = roles[c.cell_id]
            if c.role == "training":
                self.commands.cell(c.cell_id, "pause", pause=gyre_pb2.Pause(mode="abort"))
            self._actuator(c.cell_id)
        self.commands.proxy("routing", routing=self.directory.routing())

    def _reattach(self, how: dict[str, str]) -> None:
        """A resumed controller: wait for every process, let each finish what it was doing (Sync), fold, and
        reconcile the processes with the log (see the module docstring)."""
        self._wait_connected()
        futures = {c: self.hub.command_cell(c, gyre_pb2.CellCommand(sync=gyre_pb2.Sync()))
                   for c in self.config.cluster.cell_ids}
        proxy = self.hub.command_proxy(gyre_pb2.ProxyCommand(sync=gyre_pb2.Sync()))
        for cell_id, future in futures.items():
            wait_done(future, f"sync on cell {cell_id}")
        held = json.loads(wait_done(proxy, "sync on the proxy").detail or b"[]")
        self.controller.fold_now()
        view = self.controller.view
        registered: dict[str, CellRegistered] = {}
        decisions: dict[str, RoleSwitchRequested] = {}
        for event in LogReader(self.log_path).events(kinds=["cell_registered", "role_switch_requested",
                                                            "weights_published"]):
            if isinstance(event, CellRegistered):
                registered[event.cell_id] = event
            elif isinstance(event, RoleSwitchRequested):
                decisions[event.cell_id] = event
            elif isinstance(event, WeightsPublished):
                self.directory.weights = gyre_pb2.WeightsRef(version=event.policy_version, location=event.location,
                                                             sha256=event.sha256)
        adopted, restarted = [], []
        for cell_id in self.config.cluster.cell_ids:
            hello, cell = self._hellos[cell_id], view.cluster.cells.get(cell_id)
            logged = registered.get(cell_id)
            if cell is not None and not cell.lost and logged is not None and logged.incarnation == hello.incarnation:
                info = self.directory.cells[cell_id]
                info.role, info.engine_version = cell.role, -1
                self._actuator(cell_id)
                adopted.append(cell_id)
            else:
                restarted.append(cell_id)
        self.controller.record(RunResumed(
            run_id=self.run_id, folded_seq=self.controller.folded_seq,
            adopted=",".join(n for n, h in how.items() if h == "adopted"),
            started=",".join(n for n, h in how.items() if h != "adopted")))
        for cell_id in restarted:
            logged, cell = registered.get(cell_id), view.cluster.cells.get(cell_id)
            if logged is not None and logged.incarnation and cell is not None and not cell.lost:
                info = self.directory.cells[cell_id]
                info.incarnation = logged.incarnation  # the one the log knows: recorded lost, then replaced
                self._cell_gone(cell_id, logged.incarnation, "restarted while the controller was down")
            self._registered_again(self._hellos[cell_id])
        self.commands.proxy("routing", routing=self.directory.routing())
        for cell_id in adopted:
            cell = view.cluster.cells[cell_id]
            if cell.switching_to is not None and cell.switching_to != cell.role and cell_id in decisions:
                self.controller.cells[cell_id].switch(decisions[cell_id])  # under way at the crash: again
            else:
                self.controller.cells[cell_id].update_weights("resume")  # its engine's version is unknown
        self.controller.fold_now()
        self._resubmit_rollouts(held)
        self.progress("resumed", {"adopted": adopted, "restarted": restarted, "held": len(held)})

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
            elif isinstance(event, WeightsPublished):
                with self.directory.lock:  # the file, for a cell to load (the core's Train answer adds Mooncake's copy)
                    if event.policy_version > self.directory.weights.version:
                        self.directory.weights = gyre_pb2.WeightsRef(
                            version=event.policy_version, location=event.location, sha256=event.sha256)
                for actuator in list(self.controller.cells.values()):  # cells serving rollouts load it now
                    actuator.update_weights()
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
        self._stopping = True
        self.commands.stopping.set()  # a command still retrying is abandoned now
        self.supervisor.stop_watching()
        for name in ["proxy", *self.config.cluster.cell_ids]:
            if not self.supervisor.alive(name):
                continue
            try:
                if name == "proxy":
                    self.hub.command_proxy(gyre_pb2.ProxyCommand(stop=gyre_pb2.Stop())).result(60)
                elif self.hub.connected(name):
                    self.hub.command_cell(name, gyre_pb2.CellCommand(stop=gyre_pb2.Stop())).result(60)
            except Exception:  # a process that cannot be told is terminated below
                continue
        self.supervisor.reap()

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


def _info(hello: gyre_pb2.CellHello, role: str) -> CellInfo:
    return CellInfo(hello.cell_id, hello.slots, hello.is_core, hello.engine_url, hello.trainer_endpoint, role=role,
                    incarnation=hello.incarnation)


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
