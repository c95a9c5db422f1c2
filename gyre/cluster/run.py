"""`gyre run CONFIG`: the cluster topology of the run host — every cell and the proxy its own process.

The run host (`gyre.run.host.RunHost`, the same one `gyre train` runs in one process) holds the run's one
log writer, folds it, runs the configured policy, the run's plan, held-out evaluation and the step
records. This adapter serves the Cell, Proxy and Admin services (`gyre.cluster.hub`). It starts the
processes — ``cells`` × `gyre cell` and one `gyre proxy serve --controller` (which runs the harnesses) —
hands them the run secret through their environment, waits until each has connected, records
`cell_registered` for each in cell order with the policy's initial roles; the host then drives the run, and
when it is over this adapter tells every process to stop. Executions are queued on the proxy process with
tokens the controller mints; a held-out one travels with ``step = -1`` (no step).

The controller also supervises (`gyre.cluster.supervisor`). A cell or the proxy that dies or stops answering
is declared lost at once: ``cell_lost`` is recorded, the proxy stops placing executions on the cell (its
in-flight calls move when its engine fails them), the process is started again, and its new incarnation is
registered (``cell_registered``) in the role the policy gives a new cell and brought up in it (weights
loaded, or a paused engine joining training; a restarted core restores its trainer from the last
checkpoint plus the log, and the step it died in is trained again). A loss or restart the hub reports while
the run starts or resumes is applied, in order, once it has. A restarted proxy lost its harnesses:
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
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

from gyre import auth
from gyre.cluster.actuator import Commands, RemoteCell, Transfers, execution_spec, wait_done
from gyre.cluster.address import resolve, split_host_port
from gyre.cluster.auth import SECRET_ENV, secret_from_env
from gyre.cluster.config import ClusterConfig
from gyre.cluster.failures import transient
from gyre.cluster.launcher import Launcher, ManualLauncher
from gyre.cluster.proto import gyre_pb2
from gyre.cluster.supervisor import Supervisor
from gyre.controller.actuator import OrderedActions
from gyre.errors import ConfigError, GyreError
from gyre.events.models import (
    CellLost,
    CellRegistered,
    Event,
    RoleSwitchCompleted,
    RunResumed,
    WeightsPublished,
)
from gyre.run.host import Progress, Queued, RunHost
from gyre.scheduler import CellSpec, SchedulerView

log = logging.getLogger(__name__)

SECRETS = "secrets.toml"
"""The run secret, in the run directory (0600): a resumed controller must hold the secret its processes use."""
ADDRESS = "controller.addr"
"""The hub's host:port, in the run directory: a resumed controller listens where the processes reconnect."""
HELDOUT_STEP = -1
"""``ExecutionSpec.step`` of an execution outside the steps (held-out): the proxy queues it with no step."""


class Cluster:
    """The hub and the processes of one cluster run (see the module docstring)."""

    tick_s = 0.5

    def __init__(self) -> None:
        self._closers: list[Callable[[], None]] = []
        self._hellos: dict[str, gyre_pb2.CellHello] = {}
        self._hello_starts: dict[str, int] = {}
        self._started = threading.Event()
        """Set once the cells are registered (or reattached): membership changes the hub reported before
        wait until then, in order, and are applied against what the start recorded."""
        self._proxy_incarnation = self._proxy_at_start = ""
        self._stopping = False
        self.lost_cells = 0
        self.supervisor: Launcher | None = None

    def open(self, host: RunHost) -> None:
        """The run secret and the hub (not listening yet: a resumed run folds its log first)."""
        from gyre.cluster.hub import Hub

        self.host = host
        self.config: ClusterConfig = host.config  # type: ignore[assignment]
        self.controller = host.controller
        self.progress = host.progress
        self.run_dir = host.run_dir
        cluster = self.config.cluster
        self.node = resolve(cluster.bind, cluster.advertise)  # where the hub listens, and the address it gives
        secrets = auth.TokenFile(self.run_dir / SECRETS)
        port = cluster.port
        # A resumed run with no address written was stopped before it listened: it started no process, and none
        # holds its secret or dials its port, so it starts them as a new run would (chaos kills at any point).
        if host.resumed and (self.run_dir / ADDRESS).exists():
            self.secret, port = self._resumable(secrets)
        elif cluster.launcher == "manual":  # the processes started by hand hold it already
            self.secret = secret_from_env()
            secrets.write({"run": self.secret})
        else:
            self.secret = auth.mint(auth.RUN_PREFIX)
            secrets.write({"run": self.secret})
        self.hub = Hub(host.sink, run_id=host.run_id, secret=self.secret, host=self.node.bind, port=port,
                       heartbeat_s=cluster.heartbeat_period_s, dead_after_s=cluster.dead_after_s, status=self.status,
                       advertise=self.node.advertise, log_path=host.log_path, tls=cluster.tls)
        self.hub.on_cell_hello = self._on_cell_hello
        self.hub.on_cell_lost = self._on_cell_lost
        self.hub.on_proxy_hello = self._on_proxy_hello
        self.hub.on_proxy_lost = self._on_proxy_lost
        self.hub.on_weights_ask = self._weights_ask
        self.live = host.live
        self.transfers = Transfers(host.live)
        # a ToRollout's plan (`ToRollout.plan`) follows what a weights ask would answer: the log's latest, the copy
        self.transfers.on_offer = self.hub.weights_changed
        host.live.watch_weights(self.hub.weights_changed)
        self.commands = Commands(self.hub, host.live, host.sink.producer("commands"))
        self.controller.observe(self._observe, kinds=(WeightsPublished.kind, RoleSwitchCompleted.kind))
        self.membership_sink = host.sink.producer("membership")
        self._open_membership()

    def _open_membership(self) -> None:
        """The membership thread: what the hub reports (hellos, losses) applied one at a time, in order —
        those reported while the run starts once it has started, against what the start recorded (a core
        killed then and never recorded lost would be paused again and again)."""
        self._membership = OrderedActions("membership", self.controller.fail,
                                          tolerate=lambda error: self._stopping)  # the run ends meanwhile
        self._membership.put(self._started.wait)
        self._closers.append(self._membership.close)
        self._closers.append(self._started.set)  # closed before it started: the gate opens, the queue is dropped

    def start(self, host: RunHost) -> None:
        """Listen, start (or adopt) the processes, then register the cells, or reattach to them."""
        if host.resumed and host.state.finished == "completed":
            raise ConfigError(f"--resume: run {host.run_id} in {self.run_dir} has completed; nothing to resume")
        self.address = self.hub.start()
        self._closers.append(self.hub.stop)
        address_file = self.run_dir / ADDRESS
        address_file.with_suffix(".tmp").write_text(self.address + "\n")
        os.replace(address_file.with_suffix(".tmp"), address_file)
        (self.run_dir / "processes").mkdir(exist_ok=True)
        (self.run_dir / "processes" / "controller.pid").write_text(f"{os.getpid()}\n")
        how = self._spawn(adopt=host.resumed)
        if host.resumed:
            self._reattach(how)
        else:
            self._register()
        self._started.set()

    def _resumable(self, secrets: auth.TokenFile) -> tuple[str, int]:
        """The secret and port of the run to resume (its processes dial the same address again)."""
        secret = secrets.read().get("run")
        if secret is None:
            raise ConfigError(f"--resume: {secrets.path} holds no run secret (a cluster run writes it when it starts)")
        try:
            return secret, split_host_port((self.run_dir / ADDRESS).read_text().strip())[1]
        except (OSError, GyreError) as error:
            raise ConfigError(f"--resume: cannot read the controller's address from {self.run_dir / ADDRESS}: "
                              f"{error}") from error

    # -- processes -------------------------------------------------------------------------------------------

    def _spawn(self, adopt: bool) -> dict[str, str]:
        """Start every cell and the proxy through the configured launcher (or adopt those still running); the
        secret travels in the environment, never on argv."""
        cluster = self.config.cluster
        names = [*cluster.cell_ids, "proxy"]
        logs = self.run_dir / "processes"
        if cluster.launcher == "manual":
            self.supervisor = ManualLauncher(
                names, lambda name: self.hub.proxy_connected() if name == "proxy" else self.hub.connected(name))
        elif cluster.launcher == "ray":
            from gyre.cluster.ray_launcher import RayLauncher

            self.supervisor = RayLauncher(self.config, run_id=self.host.run_id, controller=self.address,
                                          secret=self.secret, on_exit=self._on_exit, on_give_up=self._on_give_up)
        else:
            config_file = self.run_dir / "cluster-config.json"
            if not adopt or not config_file.exists():  # (a predecessor killed before it spawned wrote none)
                config_file.write_text(self.config.model_dump_json(indent=2))
            commands = {name: process_argv(name, self.address, str(config_file)) for name in names}

            def identity(name: str) -> list[str]:
                return [str(config_file), name] if name != "proxy" else [str(config_file), "proxy", "serve"]

            self.supervisor = Supervisor(logs, commands, {**os.environ, SECRET_ENV: self.secret}, identity=identity,
                                         on_exit=self._on_exit, on_give_up=self._on_give_up)
        how = self.supervisor.start(adopt=adopt)
        self._closers.append(self.supervisor.reap)
        self.progress("spawned", {"processes": sorted(names), "logs": str(logs), "how": how,
                                  "launcher": cluster.launcher, "controller": self.address})
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
        self._membership.put(lambda: self._registered_again(hello))

    def _on_cell_lost(self, cell_id: str, reason: str) -> None:
        hello = self._hellos.get(cell_id)
        if hello is None:
            return
        if self.supervisor.starts(cell_id) == self._hello_starts.get(cell_id):
            self.supervisor.kill(cell_id)  # the lost incarnation still runs (it hung): it is started again
        self._membership.put(lambda: self._cell_gone(cell_id, hello.incarnation, reason))

    def _on_proxy_hello(self, hello: gyre_pb2.ProxyHello) -> None:
        self._hello_starts["proxy"] = self.supervisor.starts("proxy")
        self.supervisor.said_hello("proxy")
        self._proxy_incarnation = hello.incarnation
        self._membership.put(lambda: self._proxy_back(hello.incarnation))

    def _on_proxy_lost(self, proxy_id: str) -> None:
        if self.supervisor.starts("proxy") == self._hello_starts.get("proxy"):
            self.supervisor.kill("proxy")

    # -- membership (the membership thread: one change at a time, in the order the hub reported them) --------

    def _cell_gone(self, cell_id: str, incarnation: str, reason: str) -> None:
        info = self.live.cell(cell_id)
        if info is None or (info.incarnation or "") != incarnation or info.lost:
            return
        self.lost_cells += 1
        # the log says it is lost (and, a core, that its Mooncake copies died with it: the files remain)
        self.membership_sink.commit(self.membership_sink.record(CellLost(cell_id=cell_id, reason=reason)))
        if info.is_core:
            self.controller.forget_training()
        actuator = self.controller.cells.get(cell_id)
        if actuator is not None:
            actuator.close(wait=False)
        self._route()
        self.progress("lost", {"cell": cell_id, "reason": reason})

    def _registered_again(self, hello: gyre_pb2.CellHello) -> None:
        """A restarted cell: registered in the role the policy gives a new cell, then brought up in it. A
        hello already registered (by the start) or overtaken by a newer incarnation's is passed over."""
        cell_id = hello.cell_id
        known = self.live.cell(cell_id)
        latest = self._hellos.get(cell_id)
        if latest is not None and latest.incarnation != hello.incarnation:
            return  # that process is gone already: the newer hello that follows registers its successor
        if known is not None and not known.lost and known.incarnation == hello.incarnation:
            return
        if known is not None and not known.lost and known.incarnation != hello.incarnation:
            self._cell_gone(cell_id, known.incarnation or "", f"replaced by incarnation {hello.incarnation}")
        role = self._initial_role(cell_id)

        def rejoin() -> None:  # the satellites' old Trainer service died with the core
            for other, _ in self.live.routes():
                if other.cell_id != cell_id and other.settled_in("training"):
                    self.controller.cells[other.cell_id].rejoin()

        # The new actuator, with the bring-up first in its queue, before the registration is in the log: the
        # policy may decide for the cell as soon as it folds it, and that decision must follow the bring-up
        # (which itself starts once the registration is recorded).
        self._actuator(cell_id).bring_up(role, hello.incarnation, then=rejoin if hello.is_core else None)
        self.membership_sink.commit(self.membership_sink.record(_registered(hello, role)))
        self.progress("registered", {"cell": cell_id, "role": role})

    def _initial_role(self, cell_id: str) -> str:
        cells = [CellSpec(c.cell_id, is_core=c.is_core, slots=c.slots) for c, _ in self.live.routes()]
        return self.host.policy.initial_roles(cells, self.host.params)[cell_id]

    def _actuator(self, cell_id: str) -> RemoteCell:
        actuator = RemoteCell(cell_id, commands=self.commands, transfers=self.transfers,
                              sink=self.host.sink.producer(f"actuator:{cell_id}"), fail=self.controller.fail,
                              upto=lambda: self.controller.folded_seq, cut=self.host.params.partial_rollouts)
        actuator.on_lost_train = self.controller.forget_training
        self.controller.cells[cell_id] = actuator
        self._closers.append(actuator.close)
        return actuator

    def _route(self) -> None:
        self.commands.route()

    def _weights_ask(self, cell_id: str, incarnation: str) -> tuple[bool, gyre_pb2.WeightsRef]:
        """A returning cell, its leave over, asks which weights to load (`RemoteCell.load_plan`)."""
        actuator = self.controller.cells.get(cell_id)
        if not isinstance(actuator, RemoteCell):
            raise RuntimeError(f"cell {cell_id} (incarnation {incarnation}) has no actuator")
        return actuator.load_plan()

    def _proxy_back(self, incarnation: str) -> None:
        """A restarted proxy: it gets the routing, and (on the controller's thread) the executions it lost
        (not the proxy the start already gave both)."""
        if incarnation == self._proxy_at_start:
            return
        self._route()
        self.controller.submit(self._resubmit_rollouts)

    def _resubmit_rollouts(self, held: list[str] | None = None) -> None:
        """Queue again what no harness runs any more (on the controller's thread, or before its loop)."""
        if held is None:
            done = self.commands.proxy("sync", sync=gyre_pb2.Sync())
            if done is None:
                return  # lost again: its next incarnation's hello comes back here
            held = json.loads(done.detail or b"[]")
            self.controller.fold_now()
        self.host.resubmit(held)

    # -- starting and resuming ---------------------------------------------------------------------------------

    def _wait_connected(self) -> None:
        cluster = self.config.cluster
        try:
            self.hub.wait_for(cluster.cell_ids, proxy=True, timeout_s=cluster.start_timeout_s)
        except TimeoutError as error:
            raise ConfigError(f"the cluster did not come up: {error} (the processes' output is in "
                              f"{self.run_dir / 'processes'})") from error
        self._proxy_at_start = self._proxy_incarnation  # the start routes to (and syncs with) this one

    def _register(self) -> None:
        """Wait for every process, then record the cells with the policy's initial roles and set them so."""
        cluster = self.config.cluster
        self._wait_connected()
        hellos = [self._hellos[c] for c in cluster.cell_ids]
        cores = [h.cell_id for h in hellos if h.is_core]
        if cores != [cluster.core]:
            raise ConfigError(f"cells {cores} say they are the core; the config names {cluster.core}")
        specs = [CellSpec(h.cell_id, is_core=h.is_core, slots=h.slots) for h in hellos]
        roles = self.host.policy.initial_roles(specs, self.host.params)
        self.controller.record([_registered(h, roles[h.cell_id]) for h in hellos])
        for h in hellos:
            actuator = self._actuator(h.cell_id)
            if roles[h.cell_id] == "training":  # paused and released; a satellite also joins the core's trainer
                actuator.bring_up("training", h.incarnation)
        self._route()

    def _synced(self, cell_id: str, future: Future[gyre_pb2.CommandDone], attempts: int = 5) -> None:
        """A cell's Sync on resume, done. A cell lost meanwhile (an adopted process that exits when refused, or
        is killed) is started again by its supervisor: the sync goes to its next incarnation, which the
        reconciliation below then registers as restarted."""
        for attempt in range(attempts):
            try:
                wait_done(future, f"sync on cell {cell_id}")
                return
            except Exception as error:
                if not transient(error) or attempt == attempts - 1:
                    raise
                log.warning("resume: cell %s was lost before its sync was done (%s); syncing its next incarnation",
                            cell_id, error)
            try:
                self.hub.wait_for([cell_id], proxy=False, timeout_s=self.config.cluster.start_timeout_s)
            except TimeoutError as error:
                raise ConfigError(f"resume: cell {cell_id} was lost and did not come back: {error}") from error
            future = self.hub.command_cell(cell_id, gyre_pb2.CellCommand(sync=gyre_pb2.Sync()))

    def _reattach(self, how: dict[str, str]) -> None:
        """A resumed controller: wait for every process, let each finish what it was doing (Sync), fold, and
        reconcile the processes with the log (see the module docstring)."""
        self._wait_connected()
        futures = {c: self.hub.command_cell(c, gyre_pb2.CellCommand(sync=gyre_pb2.Sync()))
                   for c in self.config.cluster.cell_ids}
        proxy = self.hub.command_proxy(gyre_pb2.ProxyCommand(sync=gyre_pb2.Sync()))
        for cell_id, future in futures.items():
            self._synced(cell_id, future)
        held = json.loads(wait_done(proxy, "sync on the proxy").detail or b"[]")
        self.controller.fold_now()
        view = self.controller.view
        if not view.cluster.cells:  # chaos (#34): its predecessor was killed before it registered the cells
            self.controller.record(RunResumed(
                run_id=self.host.run_id, folded_seq=self.controller.folded_seq,
                adopted=",".join(n for n, h in how.items() if h == "adopted"),
                started=",".join(n for n, h in how.items() if h != "adopted")))
            self._register()  # as a start does (one cell at a time, the first found no roles to join: KeyError)
            return
        run = self.host.state  # folded with the log: the registrations, decisions and weights it holds
        adopted, restarted = [], []
        for cell_id in self.config.cluster.cell_ids:
            hello, cell = self._hellos[cell_id], view.cluster.cells.get(cell_id)
            if cell is not None and not cell.lost and cell.incarnation == hello.incarnation:
                self._actuator(cell_id)
                adopted.append(cell_id)
            else:
                restarted.append(cell_id)
        self.controller.record(RunResumed(
            run_id=self.host.run_id, folded_seq=self.controller.folded_seq,
            adopted=",".join(n for n, h in how.items() if h == "adopted"),
            started=",".join(n for n, h in how.items() if h != "adopted")))
        for cell_id in restarted:
            cell = view.cluster.cells.get(cell_id)
            if cell is not None and cell.incarnation and not cell.lost:  # the one the log knows: lost, then replaced
                self._cell_gone(cell_id, cell.incarnation, "restarted while the controller was down")
            self._registered_again(self._hellos[cell_id])
        self._route()
        for cell_id in adopted:
            cell = view.cluster.cells[cell_id]
            decision = run.decision(cell_id)
            if cell.switching_to is not None and cell.switching_to != cell.role and decision is not None:
                self.controller.cells[cell_id].switch(decision)  # under way at the crash: again
            else:
                self.controller.cells[cell_id].update_weights("resume")  # its engine's version is unknown
        self.controller.fold_now()
        self._resubmit_rollouts(held)
        self.progress("resumed", {"adopted": adopted, "restarted": restarted, "held": len(held)})

    # -- executions and progress -----------------------------------------------------------------------

    def queue(self, executions: list[Queued]) -> None:
        """Queue on the proxy process, each with a token the controller mints (`gyre.cluster.proxy_node`)."""
        if not executions:
            return
        specs = [execution_spec(e.execution_id, e.group_id, e.task_id, HELDOUT_STEP if e.step is None else e.step,
                                e.policy_version, e.attempt) for e in executions]
        self.commands.proxy(f"queue {len(specs)} executions", queue=gyre_pb2.QueueExecutions(executions=specs))

    def _observe(self, seq: int, event: Event) -> None:
        if isinstance(event, WeightsPublished):
            for actuator in list(self.controller.cells.values()):  # cells serving rollouts load it now
                actuator.update_weights()
        elif isinstance(event, RoleSwitchCompleted):
            self.progress("switch", {"cell": event.cell_id, "to": event.to_role, "seconds": event.duration_s})

    def tick(self, view: SchedulerView) -> None:
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
        return gyre_pb2.StatusReply(run_id=self.host.run_id, folded_seq=self.controller.folded_seq,
                                    watermark=view.watermark, policy_version=view.trainer.policy_version,
                                    steps_trained=len(view.work.trained), cells=cells, policy=self.host.policy.version)

    # -- shutdown ---------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every connected process to stop (the proxy first: its harnesses end), then wait for them."""
        self._stopping = True
        if self.supervisor is None:
            return
        self.commands.stopping.set()  # a command still retrying is abandoned now
        self.supervisor.stop_watching()
        untold: list[str] = []
        for name in ["proxy", *self.config.cluster.cell_ids]:
            if not self.supervisor.alive(name):
                continue
            try:
                if name == "proxy":
                    self.hub.command_proxy(gyre_pb2.ProxyCommand(stop=gyre_pb2.Stop())).result(60)
                elif self.hub.connected(name):
                    self.hub.command_cell(name, gyre_pb2.CellCommand(stop=gyre_pb2.Stop())).result(60)
                else:
                    untold.append(name)
            except Exception:  # a process that cannot be told is terminated below
                untold.append(name)
        for name in untold:  # nothing else ends it before the reap's timeout (30 s: a Ray run that lost a node
            self.supervisor.terminate(name)  # waited that long for its restarted cell, which was never stopped)
        self.supervisor.reap()

    def close(self) -> None:
        """Stop everything this run started. Idempotent."""
        while self._closers:
            self._closers.pop()()


def process_argv(name: str, controller: str, config: str, python: str = sys.executable) -> list[str]:
    """The command line of one process of a run: ``gyre cell`` for a cell, ``gyre proxy serve`` for the proxy
    (the same for every launcher)."""
    gyre = [python, "-m", "gyre"]
    if name == "proxy":
        return [*gyre, "proxy", "serve", "--controller", controller, "--config", config]
    return [*gyre, "cell", "--controller", controller, "--cell-id", name, "--config", config]


def _registered(hello: gyre_pb2.CellHello, role: str) -> CellRegistered:
    """A cell's registration: everything the control plane needs to know of it, in the log."""
    return CellRegistered(cell_id=hello.cell_id, role=role, is_core=hello.is_core, slots=hello.slots,
                          address=hello.engine_url, incarnation=hello.incarnation,
                          trainer_endpoint=hello.trainer_endpoint or None)


def ClusterRun(config: ClusterConfig, progress: Progress | None = None, *, resume: bool = False) -> RunHost:
    """A `gyre run` run: the run host over the cluster topology."""
    return RunHost(config, Cluster(), progress, resume=resume)


__all__ = ["ADDRESS", "SECRETS", "Cluster", "ClusterRun", "process_argv"]
