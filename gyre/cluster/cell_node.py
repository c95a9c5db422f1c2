"""One cell as a process (`gyre cell --controller ADDR --cell-id ID --config CONFIG`).

A cell hosts an engine (the CPU engine here, its SGLang-native HTTP API; an SGLang server on GPUs), a
Mooncake Transfer Engine endpoint, and a trainer replica: the core's (backend, optimizer, step coordinator,
the Trainer service satellites call) or, while it is lent to training, a satellite's. The controller sends
commands down its Cell stream, one at a time in order; each returns the measured seconds and bytes of its
parts, and every fact (a train step, a publish, a micro-step) goes up as an event.

Commands: ``pause`` / ``release`` the engine (leaving rollout), ``join_step`` (a satellite: pull the
current weights from the core over Mooncake, claim micro-steps of the running step), ``train`` (the core:
build the step's batch from the log prefix the controller names, train it with any satellites, publish),
``leave`` (drop the satellite replica), ``load_weights`` (pull a published version over Mooncake, or read
its file, into the engine), ``serve`` (resume generation), ``to_training`` / ``to_rollout`` (pause, release
and join_step / leave, load_weights and serve, each as one command: a role switch's side on the cell),
``sync`` (done once every earlier command is done and every event this process recorded is durable: a
restarted controller's barrier), ``stop``.

A core started again after a crash (the log already holds train steps) restores its trainer as `gyre train
--resume` does: the step it died in is aborted, the last checkpoint loaded and the steps after it retrained
from their logged batches (checksums must match). Commands wait until the process is ready.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.cluster.address import NodeAddress, resolve
from gyre.cluster.config import ClusterConfig
from gyre.cluster.errors import ClusterError
from gyre.cluster.log_client import RemoteLog
from gyre.cluster.proto import gyre_pb2
from gyre.cluster.proxy_node import LINK_CLOSE_S
from gyre.emulate import PacedBackend, Pacer
from gyre.run.build import torch_backend, trainer_settings

if TYPE_CHECKING:
    import pyarrow as pa

    from gyre.cluster.engine_host import EngineHost
    from gyre.scheduler import SchedulerView
    from gyre.state import RunState, TrainerState
    from gyre.trainer.core import LocalCoreTrainer, StepTraining
    from gyre.trainer.protocol import TrainerBackend

log = logging.getLogger(__name__)

EMULATION_REPORT_S = 5.0
"""How often an emulated cell records what its accelerator held (`EmulationReported`)."""


def trainer_backend(config: ClusterConfig) -> TrainerBackend:
    """The cell's trainer replica: the torch backend, or (``[cluster] trainer = "megatron"``) the same weights in
    Megatron-core's layout, whose optimizer needs CUDA."""
    if config.cluster.trainer == "torch":
        return torch_backend(config)
    from gyre.engine.local import LocalEngineConfig
    from gyre.engine.local.engine import load_model
    from gyre.trainer.megatron import MegatronBackend, MegatronBackendConfig, MegatronRuntime, require_cuda

    require_cuda("[cluster] trainer = 'megatron'")
    model, _ = load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))
    loss, optimizer = trainer_settings(config)
    return MegatronBackend.from_hf_model(model, MegatronBackendConfig(loss=loss, optimizer=optimizer, device="cuda"),
                                         runtime=MegatronRuntime("cuda"))


class CellNode:
    def __init__(self, config: ClusterConfig, cell_id: str, controller: str, secret: str,
                 address: NodeAddress | None = None) -> None:
        """``address``: where this process's servers bind and what it advertises (default: from ``[cluster]``,
        `gyre.cluster.address`)."""
        import torch

        from gyre.cluster.link import ControllerLink
        from gyre.cluster.spill import spill_path
        from gyre.engine.client import SyncHttpEngineClient
        from gyre.transfer import EndpointConfig, TransferEndpoint

        if cell_id not in config.cluster.cell_ids:
            raise ValueError(f"cell {cell_id!r} is not a cell of this run ({config.cluster.cell_ids})")
        torch.set_num_threads(config.cluster.cell_threads)  # this process is the cell: its threads are its own
        self.config, self.cell_id, self.secret = config, cell_id, secret
        self.is_core = cell_id == config.cluster.core
        self.run_dir = Path(config.run_dir)  # this host's own: spill, and (the core) weights and checkpoints
        self.controller = controller
        self.address = address or resolve(config.cluster.bind, config.cluster.advertise, controller=controller)
        self.stopped = threading.Event()
        self._closers: list = []
        self.endpoint = TransferEndpoint(EndpointConfig(hostname=self.address.advertise))
        self._closers.append(self.endpoint.close)
        self.engine = self._host_engine()
        self.engine_url = self.engine.url
        self._closers.append(self.engine.stop)
        self.engine_client = SyncHttpEngineClient(self.engine_url)
        self._closers.append(self.engine_client.close)
        emulation = config.emulation()
        self.pacer = Pacer(emulation) if emulation is not None else None
        """The emulated accelerator's clock for the cell's own work (training, switches; the engine has its
        own for decode and prefill): `gyre.emulate`."""
        self.trainer_service: Any = None
        trainer_endpoint = ""
        if self.is_core:
            from gyre.cluster.trainer_service import TrainerServer

            self.trainer_service = TrainerServer(secret=secret, host=self.address.bind, endpoint=self.endpoint,
                                                 lease_s=config.cluster.lease_s, advertise=self.address.advertise,
                                                 tls=config.cluster.tls, join_transfer=self._join_transfer())
            trainer_endpoint = self.trainer_service.start()
            self._closers.append(self.trainer_service.stop)
        producers = [f"cell:{cell_id}"] + (["trainer"] if self.is_core else [])
        self.hello = gyre_pb2.CellHello(cell_id=cell_id, slots=config.cluster.slots, is_core=self.is_core,
                                        engine_url=self.engine_url, trainer_endpoint=trainer_endpoint,
                                        transfer_session=self.endpoint.session_id,
                                        incarnation=uuid.uuid4().hex, producers=producers)
        self.link = ControllerLink(controller, secret=secret, hello=self.hello, handler=self.handle,
                                   spill_dir=spill_path(self.run_dir, cell_id), tls=config.cluster.tls)
        self._reporter: threading.Thread | None = None
        self.core: LocalCoreTrainer | None = None
        self.ready = threading.Event()
        self.satellite: Any = None
        self._upto = -1
        self._trained: StepTraining | None = None

    def _host_engine(self) -> EngineHost:
        from gyre.cluster.engine_host import LocalEngineHost, SglangEngineHost

        if self.config.cluster.engine == "local":
            return LocalEngineHost(self.config, self.endpoint, self.address)
        with socket.socket() as probe:  # a free port for the server this cell launches
            probe.bind((self.address.bind, 0))
            port = probe.getsockname()[1]
        log_path = self.run_dir / "processes" / f"{self.cell_id}.sglang.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return SglangEngineHost(self.config, address=self.address, port=port, log_path=log_path,
                                endpoint=self.endpoint)

    def start(self) -> None:
        welcome = self.link.start()
        self.run_id = welcome.run_id
        if self.is_core:
            self._build_core()
        if self.pacer is not None:
            self._reporter = threading.Thread(target=self._report_emulation, name="gyre-emulation-report",
                                              daemon=True)
            self._reporter.start()
        self.ready.set()

    def _backend(self) -> TrainerBackend:
        """A trainer replica (the core's or a satellite's), on the emulated accelerator where there is one."""
        backend = trainer_backend(self.config)
        return PacedBackend(backend, self.pacer) if self.pacer is not None else backend  # type: ignore[return-value]

    def _join_transfer(self) -> Callable[[], float] | None:
        """The core's side of a satellite's weight pull on an emulated accelerator whose link is shared: the
        pull takes ``satellite_join_s`` alone and shares the core's egress with the other pulls and publishes
        in flight, as `gyre sim` has it. The satellite then holds nothing itself (`_join`): a hold from its own
        start would count the link's sharing as the host's overrun."""
        pacer = self.pacer
        if pacer is None or pacer.link is None:
            return None
        return lambda: pacer.transfer(pacer.clock(), pacer.emulation.accelerator.satellite_join_s)

    def _hold(self, started: float, emulated_s: float) -> None:
        if self.pacer is not None:
            self.pacer.hold(started, emulated_s)

    def emulation_stats(self) -> dict[str, float]:
        """The engine's and the cell's own pacers together (empty: no emulated accelerator)."""
        if self.pacer is None:
            return {}
        parts = [self.pacer.snapshot()]
        engine_pacer = getattr(self.engine.local_engine, "pacer", None)
        if engine_pacer is not None:
            parts.append(engine_pacer.snapshot())
        return {key: sum(p[key] for p in parts) for key in ("holds", "emulated_s", "real_s", "waited_s",
                                                               "overrun_s", "overruns")}

    def _report_emulation(self) -> None:
        """Every `EMULATION_REPORT_S` (and when the cell stops), what its accelerator held so far, as an event."""
        from gyre.events.models import EmulationReported

        producer = self.link.producer(f"cell:{self.cell_id}")
        last = -1.0
        while True:
            stopping = self.stopped.wait(EMULATION_REPORT_S)
            stats = self.emulation_stats()
            if stats["holds"] != last:
                last = stats["holds"]
                producer.record(EmulationReported(cell_id=self.cell_id, incarnation=self.hello.incarnation,
                                                  holds=int(stats["holds"]), overruns=int(stats["overruns"]),
                                                  **{k: stats[k] for k in ("emulated_s", "real_s", "waited_s",
                                                                           "overrun_s")}))
            if stopping:
                return

    def _build_core(self) -> None:
        from gyre.cluster.faults import NOT_EVENTS, CrashingProducer, crash_points
        from gyre.trainer import StepCoordinator
        from gyre.trainer.core import LocalCoreTrainer
        from gyre.trainer.weights import WeightStore

        log_path = self.run_dir / "log"  # names the log in errors only: it is read through the controller
        producer: Any = self.link.producer("trainer")
        crash_at = crash_points(self.cell_id) - NOT_EVENTS
        if crash_at:  # fault injection (tests): die at a moment too short to hit from outside
            producer = CrashingProducer(producer, crash_at, self.run_dir, self.cell_id)
        restarted = producer.next_seq > 0  # the log holds a predecessor's trainer events
        self.log = RemoteLog(self.controller, secret=self.secret, tls=self.config.cluster.tls)
        self._closers.append(self.log.close)
        folded = self._fold() if restarted else None
        coordinator = StepCoordinator(producer, folded[0] if folded else None)
        self.backend = self._backend()
        self.weights = WeightStore(self.run_dir, keep=self.config.checkpoint.keep_weights)
        self.core = LocalCoreTrainer(self.config, cell_id=self.cell_id, run_id=self.run_id,
                                     log_path=log_path, backend=self.backend, coordinator=coordinator,
                                     weights=self.weights, published=None, on_trained=self._on_trained,
                                     durable_seq=lambda: self._upto, pacer=self.pacer,
                                     follow=lambda seq, poll_s, stop: self.log.follow(seq, poll_s, stop))
        if folded is not None:
            self._restore(coordinator, *folded[1:])
        # serves the core's trainer once the weights the next step trains from (initially v0) are published: a
        # satellite may join before the step opens
        hub = self.trainer_service.attach(coordinator, self.core)
        hub.yield_to_satellites = "yield" in crash_points(self.cell_id)  # fault injection (tests)
        self._closers.append(self.core.close)
        self.core.prepare()  # the first step's batch reads the log's last moments only

    def _fold(self) -> tuple[TrainerState, SchedulerView, RunState]:
        """The log, read once by a restarted core through the controller (it is on the controller's host): its
        coordinator's state (a copy of its own), the scheduler view (each step's groups in the order they
        completed) and the run view (checkpoints, publishes)."""
        from gyre.scheduler import SchedulerView
        from gyre.scheduler.view import WorkView
        from gyre.state import ClusterView, RunView, TrainerView
        from gyre.state.fold import fold_all_batches

        self.link.sink.commit(remote=True)  # what it spilled is in the log before the log is folded
        last = [-1]

        def batches() -> Iterator[pa.RecordBatch]:
            for batch in self.log.read(0):
                last[0] = batch.column("seq")[-1].as_py()
                yield batch

        trainer, cluster, work, run, ours = fold_all_batches(
            [TrainerView(), ClusterView(), WorkView(), RunView(), TrainerView()], batches())
        self._upto = last[0]
        return ours, SchedulerView(cluster, trainer, work), run

    def _restore(self, coordinator: Any, view: SchedulerView, run: RunState) -> None:
        from gyre.controller.plan import step_groups

        assert self.core is not None
        aborted = coordinator.abort_open_step(f"core {self.cell_id} restarted")
        retrained = self.core.restore(run, lambda s: step_groups(view, s), exact=False)  # satellites shared steps
        log.info("core %s restored: aborted step %s, retrained %d steps, policy v%d", self.cell_id, aborted,
                 retrained, self.backend.policy_version)

    def _on_trained(self, figures: StepTraining) -> None:
        self._trained = figures

    # -- commands -------------------------------------------------------------------------------------------

    def handle(self, command: gyre_pb2.CellCommand) -> Mapping[str, float] | gyre_pb2.CommandDone:
        body = command.WhichOneof("body")
        self.ready.wait()  # a restarted core restores its trainer before it takes a command
        started = time.perf_counter()
        if body == "sync":
            self.link.sink.commit(remote=True)
            return {"sync_s": time.perf_counter() - started}
        if body == "pause":
            return self._pause(command.pause.mode)
        if body == "release":
            return self._release()
        if body == "to_training":
            return self._to_training(command.to_training)
        if body == "serve":
            return self._serve()
        if body == "to_rollout":
            return self._to_rollout(command.to_rollout, command.command_id)
        if body == "load_weights":
            return self._load_weights(command.load_weights.weights)
        if body == "join_step":
            return self._join(command.join_step)
        if body == "leave":
            return self._leave(command.leave.reason)
        if body == "train":
            return self._train(command.train)
        if body == "stop":
            self.stopped.set()
            return {}
        raise ValueError(f"cell {self.cell_id} does not know command {body!r}")

    def _pause(self, mode: str) -> Mapping[str, float]:
        started = time.perf_counter()
        self.engine_client.pause(mode or "abort")
        return {"engine_pause_s": time.perf_counter() - started}

    def _release(self, switch_started: float | None = None) -> Mapping[str, float]:
        """SGLang frees GPU weights and KV; the CPU engine its KV cache. ``switch_started``: when the switch's
        first part began (`_to_training`): the emulated switch is held from there, its parts inside it."""
        started = time.perf_counter()
        self.engine_client.release_memory_occupation()
        self._hold(started if switch_started is None else switch_started,
                   self.pacer.emulation.accelerator.to_training_s if self.pacer else 0.0)
        return {"release_s": time.perf_counter() - started}

    def _to_training(self, to: gyre_pb2.ToTraining) -> Mapping[str, float]:
        """``pause``, ``release`` and (with ``join``) ``join_step`` in turn, as their own commands do them (each
        safe to do again); every step's figures. On an emulated accelerator the switch (``to_training_s``) is
        held from the pause on, as `gyre sim` times it from the decision: the pause's real work (aborting
        calls, replies) falls inside it instead of coming on top (live switches took 15.4 emulated s against
        a held 8.52)."""
        started = time.perf_counter()
        figures = {**self._pause(to.pause_mode), **self._release(started)}
        if to.HasField("join"):
            figures.update(self._join(to.join))
        return figures

    def _serve(self, switch_started: float | None = None) -> Mapping[str, float]:
        """Resume generation (and the engine's memory, back from training). ``switch_started``: as `_release`."""
        started = time.perf_counter()
        released = self.engine.local_engine is None or bool(self.engine.local_engine.released)
        if released:
            self.engine_client.resume_memory_occupation()
        self.engine_client.resume()
        if released:  # back from training: the accelerator's switch to rollout
            self._hold(started if switch_started is None else switch_started,
                       self.pacer.emulation.accelerator.to_rollout_s if self.pacer else 0.0)
        return {"engine_resume_s": time.perf_counter() - started}

    def _to_rollout(self, to: gyre_pb2.ToRollout, command_id: int = 0) -> Mapping[str, float]:
        """``leave``, ``load_weights`` and ``serve`` in turn, as their own commands do them (each safe to do
        again, so a retried ToRollout redoes none wrongly); every step's figures. With ``ask`` the weights to
        load are asked of the controller once the leave is over (a version published meanwhile is loaded now,
        not by a second pause after the return); ``weights_version`` then names the version the engine serves,
        unless the controller said it holds the latest already; when the hub put its answer into the command
        (``plan``, kept current down the stream) it is read here instead of asked. The emulated switch
        (``to_rollout_s``) is held from the leave on, its parts inside it (as `_to_training`)."""
        started = time.perf_counter()
        figures: dict[str, float] = {}
        if to.leave:
            figures.update(self._leave(to.reason))
        weights = to.weights if to.HasField("weights") else None
        if to.ask:
            answer = (self.link.planned(command_id, to.plan) if to.HasField("plan") and command_id else
                      self.link.ask_weights())
            if answer.error:
                raise ClusterError(f"cell {self.cell_id}: the controller did not say which weights to load: "
                                   f"{answer.error}")
            weights = answer.weights if answer.load and answer.weights.location else None  # v0: no file to load
            if answer.load:
                figures["weights_version"] = float(answer.weights.version)
        if weights is not None:
            figures.update(self._load_weights(weights))
        figures.update(self._serve(started))
        return figures

    def _load_weights(self, ref: gyre_pb2.WeightsRef) -> Mapping[str, float]:
        """Bring the engine to version ``ref.version`` (a Mooncake pull from the core where it offers the
        bytes, else the durable file; `gyre.cluster.engine_host`). The controller tracks which version each
        engine holds and sends this only when it differs."""
        return self.engine.load_weights(ref)

    def _join(self, join: gyre_pb2.JoinStep) -> Mapping[str, float]:
        if self.is_core:
            return {"trainer_join_s": 0.0}  # the core's replica is resident
        from gyre.cluster.satellite import SatelliteReplica

        started = time.perf_counter()
        if self.satellite is None:
            from gyre.cluster.faults import crash_once, crash_points

            on_claim = None
            if "claim" in crash_points(self.cell_id):  # fault injection (tests)
                def on_claim(step: int, micro_step: int) -> None:
                    crash_once(self.run_dir, self.cell_id, "claim")
            self.satellite = SatelliteReplica(cell_id=self.cell_id, backend=self._backend(),
                                              endpoint=self.endpoint, secret=self.secret, on_claim=on_claim,
                                              tls=self.config.cluster.tls)
        weights = join.weights if join.HasField("weights") and join.weights.manifest else None
        figures = dict(self.satellite.join(join.trainer_endpoint, weights) or {})
        if self.pacer is not None and self.pacer.link is None:  # a shared link: the core timed the pull (Join)
            self.pacer.hold(started, self.pacer.emulation.accelerator.satellite_join_s)
        figures["trainer_join_s"] = time.perf_counter() - started
        return figures

    def _leave(self, reason: str) -> Mapping[str, float]:
        from gyre.cluster.satellite import SatelliteError

        started = time.perf_counter()
        if self.satellite is not None:
            try:
                self.satellite.leave(reason or "returning to rollout")
            except SatelliteError as error:  # its work loop had stopped (the core died): the lease gave its work away
                log.warning("cell %s left training after its satellite had failed: %s", self.cell_id, error)
        return {"trainer_leave_s": time.perf_counter() - started}

    def _train(self, train: gyre_pb2.Train) -> gyre_pb2.CommandDone:
        if self.core is None:
            raise RuntimeError(f"cell {self.cell_id} is not the core: it cannot train a step")
        self._upto = train.upto_seq
        self._trained = None
        self.core.train_step(train.step, tuple(train.groups))
        figures = self._trained
        out: dict[str, float] = {}
        if figures is not None:
            out = {"micro_steps": float(figures.micro_steps), "trained_tokens": float(figures.trained_tokens),
                   "forwarded_tokens": float(figures.forwarded_tokens), "train_s": figures.train_s,
                   "policy_version": float(figures.policy_version)}
            if figures.loss is not None:
                out["loss"] = figures.loss
        return gyre_pb2.CommandDone(figures=out, detail=self.published_ref().SerializeToString())

    def published_ref(self) -> gyre_pb2.WeightsRef:
        """The latest published weights: the file, and the core's Mooncake-registered copy of the bytes."""
        assert self.core is not None
        published = self.core.published()
        if published is None:
            return gyre_pb2.WeightsRef(version=0)
        manifest = self.trainer_service.manifest(published.version)  # b"" once the version is no longer held
        return gyre_pb2.WeightsRef(version=published.version, location=published.location,
                                   sha256=published.sha256, peer_session=self.endpoint.session_id if manifest else "",
                                   manifest=manifest)

    def close(self) -> None:
        self.stopped.set()
        if self._reporter is not None:  # its last report goes up before the link closes
            self._reporter.join(LINK_CLOSE_S)
        try:
            self.link.close(timeout_s=LINK_CLOSE_S)
        finally:
            while self._closers:
                closer = self._closers.pop()
                try:
                    closer()
                except Exception:  # one component failing to stop must not keep the others running
                    log.exception("cell %s: stopping a component failed", self.cell_id)


def main(config_path: Path, controller: str, cell_id: str, bind: str | None = None,
         advertise: str | None = None) -> None:
    from gyre.cluster.auth import secret_from_env
    from gyre.cluster.node import serve_until_stopped

    config = ClusterConfig.load(config_path)
    address = resolve(bind or config.cluster.bind, advertise or config.cluster.advertise, controller=controller)
    node = CellNode(config, cell_id, controller, secret_from_env(), address)
    serve_until_stopped(node)
