"""`gyre train`: the in-process topology of the run host — one cell, every component in this process.

The run host (`gyre.run.host.RunHost`) does what every run does; this adapter builds the parts: the CPU
engine behind its HTTP server, the proxy, the harness runner behind the cell's gate, the torch trainer
with its step coordinator, and the in-process cell (`gyre.controller.LocalCell`) that switches between
serving and training. All are producers on the host's sink: the controller stays the one log writer.

With one cell, elastic and colocate both train when a step's data is ready and serve otherwise.

Resume (`gyre train CONFIG --resume`): the host checks the config and folds the log; here a train step
open at the crash is aborted, the trainer loads the last checkpoint and retrains the steps after it from
their logged batches (checksums must match), the cell is brought to the role the log says (a pending switch
is performed again) with the latest published weights in its engine, harnesses the crash orphaned are
killed, and the host queues again every execution no reward scored (`RunHost.resubmit`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from gyre.events.models import CellRegistered, Event
from gyre.run.build import engine_config, torch_backend
from gyre.run.history import reap_orphans, set_aside
from gyre.run.host import Progress, Queued, RunHost
from gyre.scheduler import CellSpec, SchedulerView

if TYPE_CHECKING:
    from gyre.config import TrainConfig

CELL = "cell0"
KillPoint = tuple[str, int] | tuple[str, int, str]
"""Where `InProcess` kills its process: (event kind, n) or (event kind, n, execution id prefix)."""


class InProcess:
    """One cell in this process (see the module docstring)."""

    tick_s = 0.5

    def __init__(self, kill_at: KillPoint | None = None) -> None:
        """``kill_at = (kind, n)``: SIGKILL this process once the controller folds the log's ``n``-th event of
        that kind (counted from the log's start, resumed events included; `gyre.train.crash`); ``(kind, n,
        prefix)`` counts only the events of executions whose id starts with ``prefix``."""
        self.kill_at = kill_at
        self._closers: list[Callable[[], None]] = []
        self._futures: list[Future] = []

    def open(self, host: RunHost) -> None:
        self.host = host
        if self.kill_at is not None:
            host.controller.observe(_killer(*self.kill_at))

    def start(self, host: RunHost) -> None:
        from gyre.controller import LocalCell
        from gyre.engine.client import SyncHttpEngineClient
        from gyre.engine.local import LocalEngine, LocalEngineServer
        from gyre.engine.protocol import INITIAL_WEIGHT_VERSION
        from gyre.harness.config import HarnessConfig
        from gyre.harness.runner import Gate, HarnessRunner
        from gyre.proxy import Proxy, ProxyConfig, ProxyServer, SamplingOverrides
        from gyre.state import TrainerView
        from gyre.state.fold import copy_state
        from gyre.trainer import StepCoordinator
        from gyre.trainer.core import LocalCoreTrainer
        from gyre.trainer.weights import WeightStore

        config, controller, sink = host.config, host.controller, host.sink
        harness = HarnessConfig.load(config.rollout.harness)
        overrides = {k: v for k, v in (("max_concurrency", config.rollout.max_concurrency),
                                       ("timeout_s", config.rollout.timeout_s)) if v is not None}
        harness = harness.model_copy(update=overrides)
        self.weights = WeightStore(host.run_dir, keep=config.checkpoint.keep_weights)
        spec = CellSpec(CELL, is_core=True, slots=harness.max_concurrency)
        if host.resumed:
            role = controller.view.cluster.cells[CELL].role
        else:
            role = host.policy.initial_roles([spec], host.params)[CELL]
            controller.record(CellRegistered(cell_id=CELL, role=role, is_core=True, slots=spec.slots))

        engine = LocalEngine(engine_config(config))
        self.engine_server = LocalEngineServer(engine)
        engine_url = self.engine_server.start()
        engine.set_weight_version(INITIAL_WEIGHT_VERSION)  # calls report the version they ran on
        self._closers.append(self.engine_server.stop)
        self.engine = SyncHttpEngineClient(engine_url)

        # the checkpoint's own tokenizer and chat template (refused with a clear error if unusable)
        proxy = Proxy(ProxyConfig(engines={CELL: engine_url}, tokenizer=config.engine.model,
                                  max_tokens_cap=config.sampling.max_tokens,
                                  sampling=SamplingOverrides(temperature=config.sampling.temperature,
                                                             top_p=1.0, top_k=-1,
                                                             ignore_eos=config.sampling.ignore_eos)),
                      sink=sink.producer("proxy"))
        self.proxy = ProxyServer(proxy)
        proxy_url = self.proxy.start()
        self._closers.append(self.proxy.stop)

        self.gate = Gate(is_open=role == "rollout")
        self.runner = HarnessRunner(harness, sink=sink.producer("harness"), proxy_url=proxy_url,
                                    root=host.run_dir / "executions", gate=self.gate)

        trainer_sink = sink.producer("trainer")
        # a resumed run's coordinator starts from the host's fold (its own copy): the log is read once
        self.coordinator = StepCoordinator(trainer_sink, copy_state(TrainerView(), controller.view.trainer)
                                           if host.resumed else None)
        self.trainer = LocalCoreTrainer(config, cell_id=CELL, run_id=host.run_id, log_path=host.log_path,
                                        backend=torch_backend(config), coordinator=self.coordinator,
                                        weights=self.weights, published=None,
                                        durable_seq=lambda: sink.writer.durable_seq, rollout_s=host.rollout_s)
        self._closers.append(self.trainer.close)
        engine_version = self._restore() if host.resumed else 0
        self.cell = LocalCell(CELL, engine=self.engine, admission=self.gate, trainer=self.trainer,
                              weights=self.weights, sink=sink.producer(f"cell:{CELL}"), fail=controller.fail,
                              redirect=self.proxy.redirect, engine_version=engine_version)
        self._closers.append(self.cell.close)
        # Closed first: killing the harnesses ends a drain the cell may be waiting on.
        self._closers.append(lambda: self.runner.close(kill_running=True))
        controller.cells[CELL] = self.cell
        if host.resumed:
            self._resume_cell()
            reap_orphans(self.runner.root)
            host.resubmit()

    # -- executions -------------------------------------------------------------------------------------------

    def queue(self, executions: list[Queued]) -> None:
        from gyre.harness.runner import Execution
        from gyre.harness.workspace import ExecutionDirs

        host = self.host
        for e in executions:
            if host.resumed:
                set_aside(ExecutionDirs.for_execution(self.runner.root, e.execution_id, e.attempt).root)
            registration = self.proxy.register_execution(e.execution_id, cell_id=CELL,
                                                         policy_version=e.policy_version, attempt=e.attempt)
            tasks = host.tasks if e.step is not None else host.heldout_tasks
            future = self.runner.submit(Execution(e.execution_id, tasks[e.task_id], group_id=e.group_id,
                                                  token=registration.token, policy_version=e.policy_version,
                                                  attempt=e.attempt, cell_id=CELL, step=e.step))
            future.add_done_callback(lambda _, eid=e.execution_id: self.proxy.proxy.unregister_execution(eid))
            self._futures.append(future)

    def tick(self, view: SchedulerView) -> None:
        waiting = [s for s in sorted(view.work.steps) if s >= 0 and s not in view.work.trained]
        if waiting:
            work = view.work.steps[waiting[0]]
            self.host.progress("rolling", {"step": waiting[0], "queued": self.runner.queued,
                                           "running": self.runner.running,
                                           "done": work.executions - sum(work.group_sizes.values()),
                                           "version": view.trainer.policy_version})

    # -- resume -----------------------------------------------------------------------------------------------

    def _restore(self) -> int:
        """The trainer back to the logged state; returns the weight version now in the engine."""
        from gyre.controller.plan import step_groups

        aborted = self.coordinator.abort_open_step("the trainer restarted (resume)")
        view = self.host.controller.view
        retrained = self.trainer.restore(self.host.state, lambda s: step_groups(view, s))
        self.host.progress("resumed", {"aborted_step": aborted, "retrained_steps": retrained,
                                       "version": self.coordinator.state.policy_version})
        published = self.trainer.published()
        if published is None:
            return 0
        path = self.weights.verify(published.location, published.sha256)
        self.engine.update_weights_from_disk(str(path), version=str(published.version))
        return published.version

    def _resume_cell(self) -> None:
        cell = self.host.controller.view.cluster.cells[CELL]
        if cell.switching_to is not None and cell.switching_to != cell.role:  # perform the pending decision again
            decision = self.host.state.decision(CELL)
            assert decision is not None, "the log has a switch under way but no decision for it"
            self.cell.switch(decision)
        elif cell.role == "training":
            self.engine.pause("abort")

    # -- shutdown ---------------------------------------------------------------------------------------------

    def stop(self) -> None:
        while self._closers:
            self._closers.pop()()

    def close(self) -> None:
        self.stop()


def _killer(kind: str, nth: int, prefix: str = "") -> Callable[[int, Event], None]:
    seen = 0

    def observe(seq: int, event: Event) -> None:
        nonlocal seen
        if event.kind == kind and (event.execution_id or "").startswith(prefix):
            seen += 1
            if seen >= nth:
                os.kill(os.getpid(), signal.SIGKILL)

    return observe


def TrainingRun(config: TrainConfig, progress: Progress | None = None, *, resume: bool = False,
                kill_at: KillPoint | None = None) -> RunHost:
    """A `gyre train` run: the run host over the in-process topology."""
    return RunHost(config, InProcess(kill_at), progress, resume=resume)


__all__ = ["CELL", "InProcess", "TrainingRun"]
