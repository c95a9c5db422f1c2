"""``[cluster] launcher = "ray"``: every cell and the proxy as a Ray actor that runs the same process.

A placement group holds one bundle per cell (``cpus_per_cell`` CPUs, ``gpus_per_cell`` GPUs) and one for the
proxy (``proxy_cpus``), placed by ``strategy`` (SPREAD: cells on different nodes where it can). Each actor
(`ProcessActor`, scheduled into its bundle) writes the run's config to its node's own disk with the node's
address as ``cluster.advertise`` (and as ``bind`` unless the config binds a wildcard), then runs the same
command line the local launcher runs (`gyre.cluster.run.process_argv`), the run secret in its environment;
the process dies with the actor (``PR_SET_PDEATHSIG``).

Supervision mirrors `gyre.cluster.supervisor`: a watcher waits on every actor's ``wait()``; a process that
exits is reported (``on_exit``: the controller declares the cell lost at once) and started again in the same
actor; an actor that dies (killed, or its node lost) is reported the same way and a new actor is made in
the same bundle (Ray reschedules a lost node's bundles where resources allow). A process that fails
``crash_limit`` times in a row without saying hello is given up (``on_give_up``).

Actors and the placement group are detached and named after the run (``<run_id>:<name>`` in
``[cluster.ray] namespace``), so `gyre run --resume` against the same Ray cluster (``[cluster.ray]
address``) adopts the actors still alive. With no address the controller starts a local Ray head, which
ends with it: adoption then needs an external head (`ray start --head`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.cluster.address import WILDCARDS
from gyre.cluster.auth import SECRET_ENV
from gyre.cluster.config import ClusterConfig
from gyre.cluster.supervisor import report_exit
from gyre.errors import ConfigError

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 300.0
"""How long the placement group may take to be placed (nodes joining, a lost node's bundles moving)."""


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor's process ends (Linux), so no cell outlives its actor."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ProcessActor:
    """One process of the run on a Ray node (the body of the remote class `gyre.cluster.ray_launcher` makes)."""

    def __init__(self, name: str, config_json: str, controller: str, secret: str, cwd: str) -> None:
        import ray

        from gyre.cluster.run import process_argv

        self.name = name
        self.node_ip = ray.util.get_node_ip_address()
        config = ClusterConfig.model_validate_json(config_json)
        bind = config.cluster.bind if config.cluster.bind in WILDCARDS else self.node_ip
        config = config.model_copy(update={"cluster": config.cluster.model_copy(
            update={"bind": bind, "advertise": self.node_ip, "launcher": "ray"})})
        self.dir = Path(tempfile.mkdtemp(prefix=f"gyre-{name}-"))  # this node's own disk
        config_file = self.dir / "config.json"
        config_file.write_text(config.model_dump_json())
        self.argv = process_argv(name, controller, str(config_file), python=sys.executable)
        self.env = {**os.environ, SECRET_ENV: secret}
        self.cwd = cwd if Path(cwd).is_dir() else str(self.dir)
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self._lock = threading.Lock()

    def start(self) -> int:
        """Start the process (again); returns its pid."""
        with self._lock:
            with open(self.dir / f"{self.name}.log", "ab") as out:
                self.process = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=out,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                preexec_fn=_die_with_parent)
            self.starts += 1
            return self.process.pid

    def where(self) -> tuple[str, int, int]:
        """(node address, pid, starts)."""
        return self.node_ip, self.process.pid if self.process else 0, self.starts

    def wait(self) -> int:
        """Until the current process exits; its status."""
        process = self.process
        return -1 if process is None else process.wait()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, AttributeError):
            self.process.send_signal(signum)  # type: ignore[union-attr]


@dataclass
class _Member:
    name: str
    bundle: int
    actor: Any = None
    waiting: Any = None  # the ObjectRef of the actor's wait()
    starts: int = 0
    crashes: int = 0
    gone: bool = False


class RayLauncher:
    """The cells and the proxy as Ray actors (see the module docstring); the `Launcher` interface."""

    def __init__(self, config: ClusterConfig, *, run_id: str, controller: str, secret: str,
                 on_exit: Callable[[str, str], None], on_give_up: Callable[[str, str], None],
                 crash_limit: int = 3, poll_s: float = 0.2) -> None:
        try:
            import ray
        except ImportError as error:  # pragma: no cover - a dependency; this names the fix
            raise ConfigError(f"cluster.launcher = 'ray' needs the ray package (pip install ray): {error}") from error
        self.ray = ray
        self.config, self.run_id, self.controller, self.secret = config, run_id, controller, secret
        self.on_exit, self.on_give_up = on_exit, on_give_up
        self.crash_limit, self.poll_s = crash_limit, poll_s
        section = config.cluster.ray
        self.namespace = section.namespace
        names = [*config.cluster.cell_ids, "proxy"]
        self._members = {name: _Member(name, i) for i, name in enumerate(names)}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gyre-ray-launcher", daemon=True)
        self._owns_ray = False
        self._reaped = False
        self.restarts = 0

    # -- starting -------------------------------------------------------------------------------------------

    def _connect(self) -> None:
        section = self.config.cluster.ray
        if self.ray.is_initialized():
            return
        if section.address:
            self.ray.init(address=section.address, namespace=self.namespace, log_to_driver=False)
            return
        cells = self.config.cluster.cells
        self.ray.init(num_cpus=max(1, int(cells * section.cpus_per_cell + section.proxy_cpus + 0.999)),
                      num_gpus=cells * section.gpus_per_cell, namespace=self.namespace, include_dashboard=False,
                      log_to_driver=False)
        self._owns_ray = True

    def _placement_group(self) -> Any:
        from ray.util.placement_group import get_placement_group, placement_group

        name = f"{self.run_id}:placement"
        with contextlib.suppress(ValueError):
            return get_placement_group(name)  # a resumed controller: the run's group is still there
        section = self.config.cluster.ray
        cell = {"CPU": section.cpus_per_cell, **({"GPU": section.gpus_per_cell} if section.gpus_per_cell else {})}
        bundles = [dict(cell) for _ in self.config.cluster.cell_ids] + [{"CPU": section.proxy_cpus}]
        return placement_group(bundles, strategy=section.strategy, name=name, lifetime="detached")

    def start(self, adopt: bool) -> dict[str, str]:
        self._connect()
        self.group = self._placement_group()
        if not self.ray.get(self.group.ready(), timeout=READY_TIMEOUT_S):
            raise ConfigError(f"the Ray placement group of {len(self._members)} bundles was not placed within "
                              f"{READY_TIMEOUT_S:.0f} s: does the cluster have the resources [cluster.ray] asks for?")
        how: dict[str, str] = {}
        for member in self._members.values():
            actor = self._existing(member) if adopt else None
            if actor is not None:
                member.actor, how[member.name] = actor, "adopted"
                member.waiting = actor.wait.remote()
            else:
                self._new_actor(member)
                how[member.name] = "started"
        self._thread.start()
        return how

    def _actor_name(self, member: _Member) -> str:
        return f"{self.run_id}:{member.name}"

    def _existing(self, member: _Member) -> Any:
        """The run's actor for ``member`` if it is alive and its process runs; else None."""
        try:
            actor = self.ray.get_actor(self._actor_name(member), namespace=self.namespace)
            return actor if self.ray.get(actor.alive.remote(), timeout=30) else None
        except (ValueError, self.ray.exceptions.RayError):
            return None

    def _new_actor(self, member: _Member) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        old = member.actor
        if old is not None:
            with contextlib.suppress(Exception):  # already dead, most likely: its name must be free
                self.ray.kill(old, no_restart=True)
        section = self.config.cluster.ray
        is_cell = member.name != "proxy"
        placed = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=member.bundle)
        remote = self.ray.remote(ProcessActor).options(
            name=self._actor_name(member), namespace=self.namespace, lifetime="detached", max_concurrency=4,
            num_cpus=section.cpus_per_cell if is_cell else section.proxy_cpus,
            num_gpus=section.gpus_per_cell if is_cell else 0,
            scheduling_strategy=placed)
        member.actor = remote.remote(member.name, self.config.model_dump_json(), self.controller, self.secret,
                                     os.getcwd())
        self.ray.get(member.actor.start.remote(), timeout=READY_TIMEOUT_S)
        member.waiting = member.actor.wait.remote()
        member.starts += 1
        member.gone = False

    def _restart(self, member: _Member, actor_died: bool) -> None:
        if actor_died:
            self._new_actor(member)
            return
        self.ray.get(member.actor.start.remote(), timeout=60)
        member.waiting = member.actor.wait.remote()
        member.starts += 1
        member.gone = False

    # -- watching -------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                refs = {m.waiting: m for m in self._members.values() if not m.gone and m.waiting is not None}
            if not refs:
                self._stopping.wait(self.poll_s)
                continue
            ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=self.poll_s)
            for ref in ready:
                self._ended(refs[ref], ref)

    def _ended(self, member: _Member, ref: Any) -> None:
        actor_died = False
        try:
            reason = f"its process exited with status {self.ray.get(ref)}"
        except self.ray.exceptions.RayError as error:  # the actor, or the node under it, is gone
            actor_died = True
            reason = f"its Ray actor died ({type(error).__name__})"
        with self._lock:
            if self._stopping.is_set():
                member.gone = True
                return
            member.gone = True
            member.crashes += 1
            give_up = member.crashes > self.crash_limit
        if report_exit(member.name, reason, give_up, self.on_exit, self.on_give_up,
                       f"{member.crashes} times without connecting"):
            return
        try:
            with self._lock:
                if not self._stopping.is_set():
                    self._restart(member, actor_died)
                    self.restarts += 1
        except self.ray.exceptions.RayError as error:  # the actor died between the exit and the restart
            log.warning("%s: restarting failed (%s); a new actor", member.name, error)
            with self._lock:
                if not self._stopping.is_set():
                    self._new_actor(member)

    # -- the Launcher interface -------------------------------------------------------------------------------

    def starts(self, name: str) -> int:
        return self._members[name].starts

    def said_hello(self, name: str) -> None:
        with self._lock:
            if name in self._members:
                self._members[name].crashes = 0

    def kill(self, name: str) -> None:
        self._signal(name, signal.SIGKILL)

    def terminate(self, name: str) -> None:
        self._signal(name, signal.SIGTERM)

    def _signal(self, name: str, signum: int) -> None:
        member = self._members.get(name)
        if member is not None and member.actor is not None and not member.gone:
            member.actor.signal.remote(signum)

    def actor(self, name: str) -> Any:
        """The actor running ``name`` now (tests kill it to lose a node's worth of process)."""
        return self._members[name].actor

    def stop_watching(self) -> None:
        self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10)

    def alive(self, name: str) -> bool:
        member = self._members[name]
        if member.gone or member.actor is None:
            return False
        try:
            return bool(self.ray.get(member.actor.alive.remote(), timeout=10))
        except self.ray.exceptions.RayError:
            return False

    def reap(self, timeout_s: float = 30.0) -> None:
        """Wait for the processes to exit (they were told to stop), terminate what is left, then end the actors
        and the placement group (and the local Ray head this launcher started)."""
        self.stop_watching()
        if self._reaped or not self.ray.is_initialized():
            return
        self._reaped = True
        members = [m for m in self._members.values() if m.actor is not None]
        pending = [m.waiting for m in members if m.waiting is not None]
        deadline = time.monotonic() + timeout_s
        for signum in (None, signal.SIGTERM, signal.SIGKILL):
            if signum is not None:
                for member in members:
                    member.actor.signal.remote(signum)
            _, pending = self.ray.wait(pending, num_returns=len(pending),
                                       timeout=max(0.1, deadline - time.monotonic())) if pending else ([], [])
            if not pending:
                break
            deadline = time.monotonic() + 10
        for member in members:
            with contextlib.suppress(Exception):
                self.ray.kill(member.actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(self.group)
        if self._owns_ray:
            self.ray.shutdown()
