"""Scripted training steps on a core and satellites in separate processes, on one machine.

The core process owns the event log, the step coordinator and the optimizer; each satellite process holds
a full replica of the model. Per step: the core opens the step, marks micro-steps ready group by group (as
the trajectory processor would emit them), every replica claims and runs micro-steps, the satellites'
gradients are summed onto the core over a gloo group, the core applies the optimizer step, logs the new
policy version, broadcasts the weights and logs ``weights_published``. With no satellite the same code is
the single-replica reference, run in the calling process.
"""

import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from gyre.trainer.config import TorchBackendConfig
from gyre.trainer.errors import TrainerError

CORE_CELL = "core"


@dataclass(frozen=True, kw_only=True)
class ReplicaRun:
    """What to train: an HF checkpoint, the micro-batches of each step, and where the log and weights go.

    ``steps[k]`` lists step ``k``'s micro-batches (``gyre.trajectory.MicroBatch``); micro-step ``m`` of the
    step is ``steps[k][m]``, and micro-batches of one group become ready together, ``ready_interval_s``
    after the previous group's (0: all at once).
    """

    model_dir: Path
    log_dir: Path
    out_dir: Path
    steps: tuple[tuple[Any, ...], ...]
    backend: TorchBackendConfig = field(default_factory=TorchBackendConfig)
    ready_interval_s: float = 0.0
    threads: int = 1
    """torch threads of each spawned replica process."""
    timeout_s: float = 300.0

    def weights_path(self, cell_id: str) -> Path:
        return self.out_dir / f"{cell_id}.safetensors"


def satellite_cell(i: int) -> str:
    return f"satellite-{i + 1}"


def run_replicas(run: ReplicaRun, satellites: int = 1) -> None:
    """Run every step with the core and ``satellites`` satellite processes; raises if any of them fails."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [run.out_dir / "store", *run.out_dir.glob("*.error")]:  # left by an earlier run here
        stale.unlink(missing_ok=True)
    if satellites == 0:
        core_main(run, [])
        return
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    channels = [(ctx.Queue(), ctx.Queue()) for _ in range(satellites)]
    processes = [ctx.Process(target=_guarded, args=(core_main, CORE_CELL, run, channels), name=CORE_CELL)]
    for i, (requests, replies) in enumerate(channels):
        cell = satellite_cell(i)
        args = (satellite_main, cell, run, requests, replies, i + 1, satellites + 1)
        processes.append(ctx.Process(target=_guarded, args=args, name=cell))
    for p in processes:
        p.start()
    deadline = time.monotonic() + run.timeout_s
    try:  # one failure stops the rest at once: the others would wait on it until the deadline
        while time.monotonic() < deadline:
            # One list, checked before waiting: a process that ends between two is_alive() calls would
            # otherwise leave wait() an empty list, and it would sleep until the deadline.
            alive = [p.sentinel for p in processes if p.is_alive()]
            if not alive:
                break
            wait(alive, timeout=max(0.0, deadline - time.monotonic()))
            if any(p.exitcode not in (None, 0) for p in processes):
                break
    finally:
        hung = [p for p in processes if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
    errors = [(run.out_dir / f"{p.name}.error") for p in processes]
    messages = [_summary(e.stem, e.read_text()) for e in errors if e.exists()]
    if messages or hung or any(p.exitcode != 0 for p in processes):
        codes = [p.exitcode for p in processes]
        detail = "\n".join(messages) or f"exit codes {codes}, timed out: {[p.name for p in hung]}"
        raise TrainerError(f"replica run failed:\n{detail}")


def core_main(run: ReplicaRun, channels: Sequence[tuple[Any, Any]]) -> None:
    """The core: log writer, coordinator, optimizer; serves one channel per satellite."""
    from safetensors.torch import save_file

    from gyre.log import LogWriter
    from gyre.sink import LogSink
    from gyre.trainer.batch import TrainBatch
    from gyre.trainer.collective import ReplicaGroup
    from gyre.trainer.coordinator import StepCoordinator
    from gyre.trainer.replica import StepGate, serve, work
    from gyre.trainer.torch_backend import TorchBackend

    group = ReplicaGroup(0, len(channels) + 1, run.out_dir / "store") if channels else None
    backend = TorchBackend.from_pretrained(run.model_dir, run.backend)
    with LogSink(LogWriter(run.log_dir)) as sink:
        coordinator = StepCoordinator.resume(sink, run.log_dir)
        gate = StepGate()
        servers = [serve(coordinator, gate, requests, replies) for requests, replies in channels]
        _wait_for_satellites(coordinator, len(channels), run.timeout_s)
        for micro_batches in run.steps:
            started = time.perf_counter()
            batches = [TrainBatch.from_micro_batch(mb, index=m) for m, mb in enumerate(micro_batches)]
            groups = list(dict.fromkeys(g for mb in micro_batches for g in mb.group_ids))
            step = coordinator.start_step(len(batches), groups=len(groups))
            gate.open(step)
            feeder = _feed(coordinator, micro_batches, batches, groups, run.ready_interval_s)
            work(backend, coordinator, CORE_CELL, batches.__getitem__, timeout_s=run.timeout_s)
            coordinator.wait_all_finished(run.timeout_s)
            feeder.join()
            if group is not None:
                group.reduce_to_core(backend.gradient_buffers())
            result = backend.optimizer_step(normalizer=sum(b.weight for b in batches))
            coordinator.close_step(result, duration_s=time.perf_counter() - started)
            published = time.perf_counter()
            tensors = [t for _, t in backend.named_tensors()]
            if group is not None:
                group.broadcast_from_core(tensors)
            coordinator.publish(
                result.policy_version,
                tensors=len(tensors),
                nbytes=sum(t.numel() * t.element_size() for t in tensors),
                location=f"gloo broadcast to {len(channels)} satellite(s)" if channels else "core memory",
                duration_s=time.perf_counter() - published,
            )
        gate.stop()
        for server in servers:
            server.join(run.timeout_s)
    save_file({n: t.contiguous() for n, t in backend.named_tensors()}, str(run.weights_path(CORE_CELL)))
    if group is not None:
        group.close()


def satellite_main(run: ReplicaRun, requests: Any, replies: Any, rank: int, world_size: int) -> None:
    """A satellite: joins, claims micro-steps of each step the core opens, sends its gradients, takes the
    published weights."""
    from safetensors.torch import save_file

    from gyre.trainer.batch import TrainBatch
    from gyre.trainer.collective import ReplicaGroup
    from gyre.trainer.replica import RemoteCoordinator, work
    from gyre.trainer.torch_backend import TorchBackend

    cell = satellite_cell(rank - 1)
    group = ReplicaGroup(rank, world_size, run.out_dir / "store")
    backend = TorchBackend.from_pretrained(run.model_dir, run.backend)
    remote = RemoteCoordinator(requests, replies, timeout_s=run.timeout_s)
    remote.join(cell)
    last, seen = -1, 0
    while (step := remote.await_step(last)) is not None:
        micro_batches = run.steps[seen]
        batches = [TrainBatch.from_micro_batch(mb, index=m) for m, mb in enumerate(micro_batches)]
        work(backend, remote, cell, batches.__getitem__, timeout_s=run.timeout_s)
        group.reduce_to_core(backend.gradient_buffers())
        backend.zero_grad()
        names, current = zip(*backend.named_tensors(), strict=True)
        received = group.broadcast_from_core(list(current))
        backend.load_weights(dict(zip(names, received, strict=True)), policy_version=backend.policy_version + 1)
        last, seen = step, seen + 1
    remote.leave(cell, "run finished")
    requests.put(None)
    save_file({n: t.contiguous() for n, t in backend.named_tensors()}, str(run.weights_path(cell)))
    group.close()


def _guarded(target: Any, cell: str, run: ReplicaRun, *args: Any) -> None:
    """Process entry point: a failure leaves its traceback next to the weights and a non-zero exit code."""
    import torch

    torch.set_num_threads(run.threads)  # replicas share the machine's cores
    try:
        target(run, *args)
    except BaseException:
        (run.out_dir / f"{cell}.error").write_text(traceback.format_exc())
        raise


def _summary(cell: str, trace: str) -> str:
    """The exception line first (what went wrong), then the traceback (where)."""
    lines = trace.strip().splitlines()
    return f"{cell}: {lines[-1] if lines else 'failed'}\n{trace}"


def _wait_for_satellites(coordinator: Any, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(coordinator.state.satellites) < count:
        if time.monotonic() > deadline:
            raise TrainerError(f"{count} satellite(s) did not join within {timeout_s} s")
        coordinator.wait_for_work(0.05)


def _feed(
    coordinator: Any, micro_batches: Sequence[Any], batches: Sequence[Any], groups: list[str], interval_s: float
) -> Any:
    """Mark micro-steps ready group by group on a thread, as completed groups' micro-batches would arrive."""
    import threading

    def feed() -> None:
        for k, group_id in enumerate(groups):
            if k and interval_s:
                time.sleep(interval_s)
            members = [m for m, mb in enumerate(micro_batches) if mb.group_ids and mb.group_ids[-1] == group_id]
            coordinator.mark_ready(
                {m: batches[m].tokens for m in members}, {m: batches[m].execution_ids for m in members}
            )

    thread = threading.Thread(target=feed, name="gyre-trainer-feed", daemon=True)
    thread.start()
    return thread
