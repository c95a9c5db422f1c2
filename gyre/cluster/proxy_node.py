"""The proxy process of a cluster run (`gyre proxy serve --controller ADDR`): proxy plus harness runner.

The harnesses live here, never in the controller, so they outlive a controller crash. The controller drives
this process through its Proxy stream:
- **Routing**: every cell's engine, its slots and whether it admits new executions (rollout cells do);
- **QueueExecutions**: executions with the tokens the controller minted; each is registered unplaced and
  submitted to the runner, whose gate places it, when its harness starts, on the admitting cell with the
  most free slots (`execution_started.cell_id`); done once every `execution_queued` is durable;
- **RedirectCell**: a cell leaves rollout: it admits nothing new, its in-flight calls continue exactly where
  the decision's redirect plan says, its other executions move to the cells that stay.
- **Sync**: done once every earlier command is done and every event recorded is durable; its detail lists
  the executions this process still runs (a restarted controller submits again only what no harness runs).

Two streams of one incarnation (`ProxyHello.lanes`): the events lane carries every event; the commands lane
carries the commands and their dones, so a routing's or a redirect's done does not wait behind the model-call
batches sent before it (issue 30: it waited for their packing, the wire and the hub's ingest). Events never take
the commands lane: the folds order a call's events by the one stream its producer is on (a `call_redirected`
before its call's `model_call_started` would be dropped; a cut's `execution_queued` must precede its
`execution_started` again). A command that records events (a queue, a cut, a stop) has its done go up once the
controller acknowledged them durable (`Durable(remote=True)`), so it still takes effect after them.

A proxy process that starts kills the harnesses a dead predecessor left behind (they work inside the run's
execution directories); the controller submits their executions again as new attempts.
Events (model calls, executions, rewards) go up as batches; a call's reply waits until its events are
durable: in the controller's log, or — while the controller is down — in this process's spill
(``<run_dir>/spill/proxy``), handed over exactly once when it is back (`gyre.cluster.spill`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.cluster.config import ClusterConfig
from gyre.cluster.proto import gyre_pb2
from gyre.harness.runner import Gate
from gyre.proxy.routing import Router
from gyre.run.build import rollout_tasks

if TYPE_CHECKING:
    from gyre.cluster.link import ControllerLink, Durable
    from gyre.harness.runner import HarnessRunner
    from gyre.harness.tasks import TaskSet
    from gyre.proxy import Proxy, ProxyServer

log = logging.getLogger(__name__)

PROXY_PRODUCERS = ("proxy", "harness")
HARNESS_API_HOST = "127.0.0.1"
LINK_CLOSE_S = 30.0
"""How long a stopping process waits for its last events to be acknowledged (the controller may be gone)."""


class PlacementGate(Gate):
    """Admits an execution once an admitting cell whose engine holds the execution's policy version (or a
    newer one) has a free slot, and places it there (`Router.place`) in the same step, so no other execution
    takes the slot in between. Waiting executions are placed in the order they were queued (`expect`), as the
    simulator places them, whichever harness thread wakes first: whoever re-checks places every waiter that
    fits, oldest first. A routing update (a cell loaded a version, joined or left rollout) or an execution
    leaving its cell wakes the waiters (`interrupt`).
    """

    def __init__(self, router: Router) -> None:
        super().__init__(is_open=True)
        self.router = router
        self._placed: dict[str, str] = {}
        self._order: dict[str, int] = {}
        """Queue position of each execution told of (`expect`) or waiting, until it is placed or gives up."""
        self._waiting: dict[str, int] = {}
        """Executions whose harness thread waits here, with the policy version each was queued with."""
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        """How many harness threads wait here to be placed."""
        with self._cond:
            return len(self._waiting)

    def expect(self, execution_ids: Iterable[str]) -> None:
        """The order executions were queued in (the controller's), which placement follows."""
        with self._cond:
            for execution_id in execution_ids:
                self._order.setdefault(execution_id, next(self._tickets))

    def enter(self, stop: Callable[[], bool], execution_id: str = "", version: int = 0) -> bool:
        with self._cond:
            self._order.setdefault(execution_id, next(self._tickets))
            self._waiting[execution_id] = version
            try:
                self._cond.wait_for(lambda: stop() or self._place_in_order(execution_id))
            finally:
                del self._waiting[execution_id]
            if execution_id not in self._placed:
                self._order.pop(execution_id, None)
                return False
            if stop():
                self.router.unpin(execution_id)
                del self._placed[execution_id]
                self._order.pop(execution_id, None)
                return False
            self._inside += 1
            return True

    def _place_in_order(self, execution_id: str) -> bool:
        """Place every waiting execution that fits, oldest first (under the lock); True once ``execution_id``
        is placed. Those placed on another's behalf are woken."""
        others = False
        for waiting in sorted(self._waiting, key=self._order.__getitem__):
            if waiting in self._placed:
                continue
            cell = self.router.place(waiting, self._waiting[waiting])
            if cell is not None:
                self._placed[waiting] = cell
                others |= waiting != execution_id
        if others:
            self._cond.notify_all()
        return execution_id in self._placed

    def place(self, execution_id: str) -> str | None:
        with self._cond:
            self._order.pop(execution_id, None)
            return self._placed.pop(execution_id)


@dataclass
class _Components:
    proxy: Proxy
    server: ProxyServer
    runner: HarnessRunner
    gate: PlacementGate
    tasks: TaskSet
    heldout_tasks: TaskSet


class ProxyNode:
    """Builds the proxy and the runner on the first routing update (it names the engines) and serves commands."""

    def __init__(self, config: ClusterConfig, controller: str, secret: str) -> None:
        from gyre.cluster.link import COMMANDS_LANE, ControllerLink
        from gyre.cluster.spill import spill_path

        self.config = config
        self.hello = gyre_pb2.ProxyHello(proxy_id="proxy", incarnation=uuid.uuid4().hex,
                                         producers=list(PROXY_PRODUCERS), lanes=[COMMANDS_LANE])
        self.link = ControllerLink(controller, secret=secret, hello=self.hello,
                                   spill_dir=spill_path(Path(config.run_dir), "proxy"), tls=config.cluster.tls)
        """The events lane: every event this process records goes up here (it takes no command)."""
        commands = gyre_pb2.ProxyHello(proxy_id=self.hello.proxy_id, incarnation=self.hello.incarnation,
                                       lanes=self.hello.lanes, lane=COMMANDS_LANE)
        self.commands = ControllerLink(controller, secret=secret, hello=commands, handler=self.handle,
                                       tls=config.cluster.tls)
        """The commands lane: commands down, their dones up, nothing recorded."""
        self.parts: _Components | None = None
        self.stopped = False
        self._held: set[str] = set()
        """Executions submitted to the runner and not ended (their harness, or its evaluation, still runs)."""
        self._specs: dict[str, gyre_pb2.ExecutionSpec] = {}
        """The executions whose harness still runs, as queued: a cut one is queued again with the same batch and
        attempt. One whose harness ended (scored or being scored) is not running: there is nothing to cut."""
        self._cutting = threading.Lock()
        """Orders a cut against executions' ends: an execution is cut before it finishes, or not at all."""
        self._urls: dict[str, str] = {}

    @property
    def links(self) -> tuple[ControllerLink, ...]:
        """Its streams: the process ends when either is refused for good (`gyre.cluster.node`)."""
        return self.link, self.commands

    def start(self) -> None:
        self.link.start()  # first: its Welcome numbers the producers a command's handler records through
        self.commands.start()

    def _after_events(self, answer: Mapping[str, float] | gyre_pb2.CommandDone) -> Durable:
        """``answer``'s done, up the commands lane once every event recorded so far (the command's among them)
        is in the controller's log: the events lane's acknowledgement says the hub recorded them before it
        reads the done, which no order between the two streams would."""
        from gyre.cluster.link import Durable

        return Durable(answer, self.link.sink.recorded, sink=self.link.sink, remote=True)

    # -- commands -------------------------------------------------------------------------------------------

    def handle(self, command: gyre_pb2.ProxyCommand) -> Mapping[str, float] | gyre_pb2.CommandDone | Durable:
        body = command.WhichOneof("body")
        if body == "routing":
            return self._route(command.routing)
        if body == "queue":
            return self._queue(command.queue)
        if body in ("redirect", "redirects"):  # each cell's, in order; several: its figures named by cell
            redirects = [command.redirect] if body == "redirect" else list(command.redirects.cells)
            figures = [(r.from_cell_id, self._redirect(r)) for r in redirects]
            answer = figures[0][1] if body == "redirect" else {
                f"{cell}/{name}": value for cell, one in figures for name, value in one.items()}
            # a cut recorded its executions' `execution_queued`: the done goes up once they are in the log
            return self._after_events(answer) if any(one["cut_executions"] for _, one in figures) else answer
        if body == "sync":
            self.link.sink.commit(remote=True)
            self.commands.wait_deferred()  # a queue's done waits for its events: it goes up before this one
            return gyre_pb2.CommandDone(detail=json.dumps(sorted(self._held)).encode())
        if body == "stop":
            self._stop_components()
            return self._after_events({})
        raise ValueError(f"the proxy does not know command {body!r}")

    def _build(self, routing: gyre_pb2.Routing) -> _Components:
        from gyre.harness.config import HarnessConfig
        from gyre.harness.runner import HarnessRunner
        from gyre.harness.tasks import TaskSet
        from gyre.proxy import Proxy, ProxyConfig, ProxyServer, SamplingOverrides
        from gyre.run.history import reap_orphans

        config = self.config
        killed = reap_orphans(Path(config.run_dir) / "executions")
        if killed:
            log.warning("killed %d harness process groups a previous proxy left running", killed)
        proxy = Proxy(ProxyConfig(engines={r.cell_id: r.engine_url for r in routing.cells},
                                  tokenizer=config.engine.model, max_tokens_cap=config.sampling.max_tokens,
                                  sampling=SamplingOverrides(temperature=config.sampling.temperature,
                                                             top_p=1.0, top_k=-1,
                                                             ignore_eos=config.sampling.ignore_eos)),
                      sink=self.link.producer("proxy"))
        # its only clients are the harnesses it runs on this host: the execution tokens they present never
        # cross the network, whatever [cluster] bind opens for the run's peers
        server = ProxyServer(proxy, host=HARNESS_API_HOST)
        url = server.start()
        harness = HarnessConfig.load(config.rollout.harness)
        slots = config.cluster.cells * config.cluster.slots
        # placement is the gate's (slots on admitting cells); a harness thread stays busy while its execution
        # is scored, after its slot was freed: one more thread per slot lets the next execution start meanwhile
        overrides = {"max_concurrency": 2 * slots}
        if config.rollout.timeout_s is not None:
            overrides["timeout_s"] = config.rollout.timeout_s
        harness = harness.model_copy(update=overrides)
        gate = PlacementGate(proxy.router)
        runner = HarnessRunner(harness, sink=self.link.producer("harness"), proxy_url=url,
                               root=Path(config.run_dir) / "executions", gate=gate, finishing=self._finishing)
        proxy.on_placed_again = runner.holds.release  # a cut execution's timeout runs again once it is placed
        tasks = rollout_tasks(config.rollout)[0]
        heldout = TaskSet.load(config.evaluation.tasks) if config.evaluation.tasks is not None else tasks
        return _Components(proxy, server, runner, gate, tasks, heldout)

    def _route(self, routing: gyre_pb2.Routing) -> Mapping[str, float]:
        if self.parts is None:
            self.parts = self._build(routing)
            self._urls = {r.cell_id: r.engine_url for r in routing.cells}
        router: Router = self.parts.proxy.router
        for route in routing.cells:
            if self._urls.get(route.cell_id) != route.engine_url:  # a new cell, or one restarted at a new address
                from gyre.proxy.transport import engine_link

                router.add_cell(route.cell_id, engine_link(route.engine_url,
                                                           timeout_s=self.parts.proxy.config.engine_timeout_s))
            self._urls[route.cell_id] = route.engine_url
            router.set_route(route.cell_id, route.slots, route.admitting, route.weights_version)
        self.parts.gate.interrupt()
        return {"admitting": float(sum(r.admitting for r in routing.cells))}

    def _queue(self, queue: gyre_pb2.QueueExecutions) -> Durable:
        from gyre.harness.runner import Execution
        from gyre.proxy.routing import UNPLACED

        parts = self._require()
        proxy, runner = parts.proxy, parts.runner
        parts.gate.expect(spec.execution_id for spec in queue.executions)
        for spec in queue.executions:
            self._held.add(spec.execution_id)
            self._specs[spec.execution_id] = spec
            proxy.register_execution(spec.execution_id, spec.token, cell_id=UNPLACED,
                                     policy_version=spec.policy_version, attempt=spec.attempt)
            step = None if spec.step < 0 else spec.step  # held-out: outside the steps
            tasks = parts.tasks if step is not None else parts.heldout_tasks
            future = runner.submit(Execution(spec.execution_id, tasks[spec.task_id],
                                             group_id=spec.group_id, token=spec.token,
                                             policy_version=spec.policy_version, attempt=spec.attempt,
                                             step=step))
            future.add_done_callback(lambda _, e=spec.execution_id: self._ended(e))
        # done once every execution_queued is durable; the routings and redirects behind it go on meanwhile
        return self._after_events({"queued": float(len(queue.executions))})

    @contextlib.contextmanager
    def _finishing(self, execution_id: str) -> Iterator[None]:
        """Around an execution's `execution_finished`: after it, a cut leaves the execution alone (a cut that
        re-queued an execution already finished, its evaluation still running, broke the attempt order:
        tests/cluster/test_cluster_partial.py on a loaded machine)."""
        with self._cutting:
            self._specs.pop(execution_id, None)
            yield
        self._release(execution_id)

    def _release(self, execution_id: str) -> None:
        """The harness ended: its token is revoked and its slot freed — while it is scored, as the simulator
        frees it (the evaluator makes no model call; holding the slot kept the next execution ~eval_s late)."""
        from gyre.proxy.errors import UnknownExecutionError

        parts = self.parts
        if parts is None:
            return
        with contextlib.suppress(UnknownExecutionError):  # released already
            parts.proxy.unregister_execution(execution_id)
        parts.gate.interrupt()  # its slot is free

    def _ended(self, execution_id: str) -> None:
        self._held.discard(execution_id)
        self._specs.pop(execution_id, None)
        self._release(execution_id)

    def _redirect(self, redirect: gyre_pb2.RedirectCell) -> Mapping[str, float]:
        parts = self._require()
        planned = {c.call_id: c.to_cell_id for c in redirect.calls}
        executions = {c.execution_id: c.to_cell_id for c in redirect.calls if c.execution_id}
        started = time.perf_counter()
        cut = self._cut(parts, redirect, set(executions)) if redirect.cut else 0
        calls, moved = parts.server.call(
            parts.proxy.redirect_plan(redirect.from_cell_id, planned, executions))
        return {"redirect_s": time.perf_counter() - started, "redirected_calls": float(calls),
                "moved_executions": float(len(moved)), "cut_executions": float(cut)}

    def _cut(self, parts: _Components, redirect: gyre_pb2.RedirectCell, kept: set[str]) -> int:
        """Partial rollouts: cut every execution on the leaving cell that the plan does not move, before the
        plan moves the rest (its `execution_queued` again, as the simulator records a cut: same batch and
        attempt, the latest published version). Returns how many were cut."""
        from gyre.events.models import ExecutionQueued

        on_cell = [e for e in parts.proxy.router.pinned_on(redirect.from_cell_id) if e not in kept]
        with self._cutting:  # no harness records its end until the cut is recorded
            queued = []
            for execution_id in on_cell:
                spec = self._specs.get(execution_id)
                if spec is None:  # its harness ended (it is being scored, or unregistered): nothing to cut
                    continue
                queued.append(ExecutionQueued(execution_id=execution_id, task_id=spec.task_id,
                                              group_id=spec.group_id, step=None if spec.step < 0 else spec.step,
                                              attempt=spec.attempt, policy_version=redirect.resume_version))
            if queued:
                for event in queued:  # its timeout does not run while it is cut (`HarnessRunner.holds`)
                    parts.runner.holds.hold(event.execution_id)
                parts.server.call(parts.proxy.cut(redirect.from_cell_id, queued, redirect.resume_version))
        return len(queued)

    def _require(self) -> _Components:
        if self.parts is None:
            raise RuntimeError("the proxy has had no routing update yet: it knows no engine")
        return self.parts

    def _stop_components(self) -> None:
        """Kill running harnesses (the run is over) and stop the HTTP server; their last events are sent."""
        if self.stopped:
            return
        self.stopped = True
        if self.parts is not None:
            self.parts.runner.close(kill_running=True)
            self.parts.server.stop()

    def close(self) -> None:
        """Stop the components, then flush the events lane (every event acknowledged durable, or a timeout) and
        close the commands lane after it (the hub counts the process gone once both have ended)."""
        self._stop_components()
        try:
            self.link.close(timeout_s=LINK_CLOSE_S)
        finally:
            self.commands.close(timeout_s=LINK_CLOSE_S)


def main(config_path: Path, controller: str) -> None:
    """`gyre proxy serve --controller ADDR --config CONFIG`: serve until the controller says stop."""
    from gyre.cluster.auth import secret_from_env
    from gyre.cluster.node import serve_until_stopped

    node = ProxyNode(ClusterConfig.load(config_path), controller, secret_from_env())
    serve_until_stopped(node)
