"""The core and a satellite of the satellite tests: a real StepCoordinator + log, TorchBackend, Trainer service
and Mooncake endpoints; the satellite runs in a spawned process (`satellite_main`), so one process start per
test. Steps are driven by hand (`Core.open`, `Core.work_one`, `Core.finish`: the calls
`LocalCoreTrainer.train_step` makes), so a test can order the core's work against the satellite's claims
through events."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "trainer") not in sys.path:  # the trainer tests' random trees
    sys.path.insert(0, str(TESTS / "trainer"))

CORE = "core"
LR = 1e-3


def backend_config() -> Any:
    from gyre.trainer import GSPOConfig, OptimizerConfig, TorchBackendConfig

    return TorchBackendConfig(optimizer=OptimizerConfig(lr=LR),
                              loss=GSPOConfig(eps_low=0.5, eps_high=0.5, tis_cap=None))


def make_batches(groups: int = 3) -> list[Any]:
    from trainer_trees import micro_batches, random_group

    from gyre.trainer import TrainBatch

    made = [random_group(seed, executions=3, calls=10, group_id=f"g{seed}") for seed in range(groups)]
    return [TrainBatch.from_micro_batch(mb, m) for m, mb in enumerate(micro_batches(made, "packed", token_budget=120))]


def reference_weights(model_dir: Path, batches: Sequence[Any]) -> dict[str, Any]:
    """One TorchBackend doing every micro-step of the step, in order: what the core must end with."""
    from gyre.trainer import TorchBackend

    backend = TorchBackend.from_pretrained(model_dir, backend_config())
    backend.zero_grad()
    for b in batches:
        backend.forward_backward(b)
    backend.optimizer_step(normalizer=float(len({e for b in batches for e in b.execution_ids})))
    return {n: t.clone() for n, t in backend.named_tensors()}


@dataclass
class Core:
    """The core cell's trainer, without the cell: log, coordinator, backend, endpoint, Trainer service."""

    log_dir: Path
    sink: Any
    coordinator: Any
    backend: Any
    endpoint: Any
    server: Any
    hub: Any
    secret: str

    @classmethod
    def start(cls, root: Path, model_dir: Path, *, lease_s: float,
              join_transfer: Callable[[], float] | None = None) -> Core:
        from gyre import auth
        from gyre.cluster.trainer_service import TrainerServer
        from gyre.log import LogWriter
        from gyre.sink import LogSink
        from gyre.trainer import StepCoordinator, TorchBackend
        from gyre.transfer import TransferEndpoint

        log_dir = root / "log"
        sink = LogSink(LogWriter(log_dir))
        coordinator = StepCoordinator(sink)
        backend = TorchBackend.from_pretrained(model_dir, backend_config())
        endpoint = TransferEndpoint()
        secret = auth.mint(auth.RUN_PREFIX)
        server = TrainerServer(secret=secret, endpoint=endpoint, lease_s=lease_s, join_transfer=join_transfer)
        server.start()
        hub = server.attach(coordinator, None, backend=backend, core_cell=CORE)
        return cls(log_dir, sink, coordinator, backend, endpoint, server, hub, secret)

    def open(self, batches: Sequence[Any]) -> int:
        step = self.coordinator.start_step(len(batches), groups=1)
        self.backend.zero_grad()
        self.hub.open_step(step, batches, self.backend)
        self.coordinator.mark_ready({i: b.tokens for i, b in enumerate(batches)},
                                    {i: b.execution_ids for i, b in enumerate(batches)})
        return step

    def finish(self, batches: Sequence[Any], timeout_s: float = 300.0) -> float:
        """The rest of the step as ``LocalCoreTrainer.train_step``: work, wait for satellites, optimizer, publish."""
        started = time.perf_counter()
        self.hub.run_step(self.backend, list(batches).__getitem__, timeout_s=timeout_s)
        result = self.backend.optimizer_step(normalizer=float(len({e for b in batches for e in b.execution_ids})))
        self.coordinator.close_step(result)
        self.hub.close_step()
        self.hub.publish(result.policy_version, list(self.backend.named_tensors()))
        return time.perf_counter() - started

    def work_one(self, batches: Sequence[Any]) -> int:
        """The core claims and does exactly one micro-step (a test's way to advance the step by hand)."""
        claim = self.coordinator.claim(CORE)
        assert claim.status == "claimed", claim
        result = self.backend.forward_backward(batches[claim.micro_step])
        self.coordinator.finish(CORE, claim.step, claim.micro_step, result)
        return claim.micro_step

    def events(self, kind: str | None = None) -> list[Any]:
        from gyre.log import LogReader

        self.sink.commit()
        return [e for e in LogReader(self.log_dir).events() if kind is None or e.kind == kind]

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout_s: float = 240.0) -> None:
        """Wait for an event-defined condition (a generous bound only against a hang; nothing is timed)."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            self.coordinator.wait_for_work(0.1)

    def close(self) -> None:
        self.server.stop()
        self.endpoint.close()
        self.sink.close()


def satellite_main(address: str, secret: str, model_dir: str, cell_id: str, block_after_claims: int,
                   conn: Any) -> None:
    """A satellite process: join, work until told to leave (``conn`` gets "leave"); with
    ``block_after_claims`` > 0 it blocks forever after that many claims (the test then kills it)."""
    import threading

    import torch

    from gyre.cluster.satellite import SatelliteReplica
    from gyre.trainer import TorchBackend
    from gyre.transfer import TransferEndpoint

    torch.set_num_threads(1)
    claims = 0

    def on_claim(step: int, micro_step: int) -> None:
        nonlocal claims
        claims += 1
        conn.send(("claimed", step, micro_step))
        if block_after_claims and claims >= block_after_claims:
            threading.Event().wait()  # until SIGKILL

    backend = TorchBackend.from_pretrained(model_dir, backend_config())
    replica = SatelliteReplica(cell_id=cell_id, backend=backend, endpoint=TransferEndpoint(), secret=secret,
                               on_claim=on_claim)
    figures = replica.join(address)
    conn.send(("joined", dict(figures)))
    message = conn.recv()
    assert message == "leave", message
    replica.leave("test over")
    conn.send(("left", replica.micro_steps, [(p.bytes, p.seconds) for p in replica.pulls]))


def spawn_satellite(core: Core, model_dir: Path, cell_id: str = "sat-1",
                    block_after_claims: int = 0) -> tuple[Any, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=satellite_main, args=(core.server.address, core.secret, str(model_dir), cell_id,
                                                    block_after_claims, child), name=cell_id)
    proc.start()
    return proc, parent
