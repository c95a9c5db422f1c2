"""The core cell's trainer replica: a step's batch from the log, GSPO micro-steps, optimizer step, durable publish.

Everything it learns comes from the log (the step's groups, scoped to the run) and everything it does is an
event through the coordinator (`train_step_started` ... `train_step_finished`, `weights_published`,
`checkpoint_saved`), so the controller's fold follows training exactly as replay will.

Resume (`restore`): load the last checkpoint, then retrain every step the log says finished after it, from
the same logged batches, without logging it again; each retrained version's weights must have the checksum
the log recorded (a step whose publish the crash cut off is published now). A step open at the crash is
aborted and trained again by the controller's plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.config import TrainConfig
from gyre.events.models import CheckpointSaved
from gyre.trainer import StepCoordinator, TorchBackend
from gyre.trainer.batch import TrainBatch
from gyre.trainer.claims import Claim
from gyre.trainer.errors import StepProtocolError, TrainerError
from gyre.trainer.protocol import MicroStepResult, StepResult
from gyre.trainer.replica import work
from gyre.trainer.weights import Published, WeightsError, WeightStore, file_sha256, fsync_tree
from gyre.trajectory import BatchBuilder, TrajectoryConfig
from gyre.trajectory.source import Follow, LiveLogSource

if TYPE_CHECKING:
    from gyre.emulate import Pacer
    from gyre.state.run import RunState, Weights
    from gyre.trainer.hub import TrainerHub


STEP_TIMEOUT_S = 600.0
"""How long a step whose whole batch is in may take to train."""
STREAM_TIMEOUT_S = 86_400.0
"""A streamed step also waits on its groups' rollouts: no bound of its own (a lost rollout is resubmitted by
the controller; a trainer closed meanwhile stops the wait)."""
FEED_POLL_S = 0.05
"""Longest wait for the log to grow before a streamed step checks for a stop."""


@dataclass
class StepTraining:
    """What training one step did (the figures the CLI shows; all of it is also in the log)."""

    step: int
    micro_steps: int = 0
    trained_tokens: int = 0
    forwarded_tokens: int = 0
    loss: float | None = None
    train_s: float = 0.0
    policy_version: int = 0
    excluded: dict[str, int] | None = None


class LocalCoreTrainer:
    def __init__(self, config: TrainConfig, *, cell_id: str, run_id: str, log_path: Path, backend: TorchBackend,
                 coordinator: StepCoordinator, weights: WeightStore, published: Published | None,
                 durable_seq: Callable[[], int], on_trained: Callable[[StepTraining], None] = lambda f: None,
                 rollout_s: Callable[[int], float | None] = lambda step: None, pacer: Pacer | None = None,
                 follow: Follow | None = None) -> None:
        """``pacer``: an emulated accelerator (`gyre.emulate`); a publish then takes its ``publish_s``.
        ``follow``: how the log is tailed when it is not on this host (`LiveLogSource`); None: its files."""
        self.config, self.cell_id, self.run_id, self.log_path = config, cell_id, run_id, log_path
        self.pacer = pacer
        self.backend, self.coordinator, self.weights = backend, coordinator, weights
        self._published = published
        self.on_trained = on_trained
        self.durable_seq = durable_seq
        self.rollout_s = rollout_s
        self.follow = follow
        """A step's rollout phase (first queued to last finished, folded from the log), for its metrics."""
        self._source: LiveLogSource | None = None
        self._source_lock = threading.Lock()
        self._warm_stop = threading.Event()
        """Set once a step needs the source (or on close): `prepare`'s thread then stops loading the log."""
        self._warmer: threading.Thread | None = None
        self._warm_error: Exception | None = None
        self.run_dir = weights.run_dir
        self._checkpointed: set[int] = set()
        self._publishing: Future[None] | None = None
        """The emulated push of the last version, recording its `weights_published` when over (`publish`)."""
        self.satellites: TrainerHub | None = None
        """Set by the core cell's Trainer service (``TrainerServer.attach``): each step then also waits for the
        satellites' gradients and publishes over Mooncake. None: a single replica, as ``gyre train``."""

    def join(self) -> None:
        self.backend.model.train()

    def published(self) -> Published | None:
        return self._published

    def _builder(self) -> BatchBuilder:
        section = self.config.trajectory
        return BatchBuilder(TrajectoryConfig(cap=section.cap, min_valid_per_group=section.min_valid_per_group,
                                             token_budget=section.token_budget, form=section.form,
                                             micro_steps_per_group=section.micro_steps_per_group,
                                             shuffle_rewards=section.shuffle_rewards,
                                             reward_threshold=section.reward_threshold))

    def prepare(self, poll_s: float = 1.0) -> None:
        """Follow the log from now on, and load what it writes until the first step: that step's batch then
        reads only the last moments of the log, not all of it (through the controller, on another host: 66
        emulated seconds of a terminal-bench-like step 0 went to it)."""
        if self._warmer is not None or self._warm_stop.is_set():
            return

        def warm() -> None:
            while not self._warm_stop.is_set():
                with self._source_lock:
                    if self._warm_stop.is_set():
                        return
                    try:
                        self._log().refresh_available(0.0)
                    except Exception as error:  # raised by the step that needs the source
                        self._warm_error = error
                        return
                self._warm_stop.wait(poll_s)

        self._warmer = threading.Thread(target=warm, name="gyre-batch-warm", daemon=True)
        self._warmer.start()

    def _stop_warming(self) -> None:
        self._warm_stop.set()
        with self._source_lock:  # a load in progress finishes first: the source is the step's alone after
            error, self._warm_error = self._warm_error, None
        if error is not None:
            raise TrainerError(f"following the log at {self.log_path} before the first step failed: {error}") \
                from error

    def _log(self) -> LiveLogSource:
        if self._source is None:
            self._source = LiveLogSource(self.log_path, run_id=self.run_id, follow=self.follow)
        return self._source

    def _build(self, builder: BatchBuilder, groups: list[str]) -> list[TrainBatch]:
        """Micro-batches of complete ``groups``, one group at a time in the given order (their completion
        order: a retrained step repeats it exactly); numbered on from the builder's last."""
        if not groups:
            return []
        loaded = {group.group_id: group for group in self._log().groups(group_ids=groups)}  # one query for all
        return [TrainBatch.from_micro_batch(mb) for group_id in groups if group_id in loaded
                for mb in builder.group_batches(loaded.pop(group_id))]

    def _batches(self, groups: tuple[str, ...]) -> tuple[BatchBuilder, list[TrainBatch], list[str]]:
        """The step's builder, the micro-batches of those of its groups the log (as written so far) completes,
        and the groups it does not complete yet."""
        builder, source = self._builder(), self._log()
        source.refresh(self.durable_seq())
        complete = source.completed(groups)
        return builder, self._build(builder, complete), [g for g in groups if g not in set(complete)]

    def train_step(self, step: int, groups: tuple[str, ...]) -> None:
        """Train the step on ``groups``. Groups the log does not complete yet (the controller streams a step
        on its first complete group: ``stream_micro_steps``) are awaited as the log grows: each one's
        micro-steps are offered the moment it completes, while the step trains those already offered. The
        plan is then fixed up front (groups times ``micro_steps_per_group``) and the optimizer step, once
        every micro-step is trained, divides by every execution of the step, as a whole batch would."""
        started = time.monotonic()
        host_started = self.pacer.clock() if self.pacer is not None else 0.0
        self._stop_warming()
        self.coordinator.sink.commit()  # every reward the fold has seen is on disk before the query
        builder, batches, waiting = self._batches(groups)
        if self.pacer is not None:  # an emulated accelerator (a `PacedBackend`): the query overlaps its time
            self.backend.host_work(self.pacer.clock() - host_started)  # type: ignore[attr-defined]
        per_group = self.config.trajectory.micro_steps_per_group
        if waiting and per_group is None:
            raise TrainerError(f"step {step} streams ({len(waiting)} of its groups are not complete yet) but "
                               "trajectory.micro_steps_per_group is not set: a streamed step's plan needs it")
        report = builder.report.to_dict()
        metrics = builder.report.step_metrics() if not waiting else {}
        metrics["batch_s"] = time.monotonic() - started
        planned = len(groups) * per_group if waiting and per_group is not None else len(batches)
        opened = self.coordinator.start_step(planned, groups=len(groups),
                                             trajectories=report.get("trajectories_kept", 0))
        if opened != step:
            raise RuntimeError(f"the trainer opened step {opened} for the batch of step {step}")
        figures = StepTraining(step, policy_version=self.coordinator.state.policy_version)
        if not planned:  # no group had enough scored executions: the step closes without an update
            version = self.coordinator.state.policy_version
            self.coordinator.close_step(StepResult(policy_version=version, grad_norm=0.0, normalizer=1.0),
                                        duration_s=time.monotonic() - started)
            figures.train_s = time.monotonic() - started
            figures.excluded = excluded(report)
            self.on_trained(figures)
            return
        self.backend.zero_grad()
        if self.satellites is not None:  # before mark_ready: a satellite's claim needs the step's batches
            self.satellites.open_step(step, [], self.backend)
        feed = _Feed(self, builder, batches, waiting)
        feed.offer(batches)
        timeout_s = STREAM_TIMEOUT_S if waiting else STEP_TIMEOUT_S
        try:
            feed.start()
            if self.satellites is None:
                work(self.backend, feed, self.cell_id, batches.__getitem__, timeout_s=timeout_s)
            else:  # also waits for every satellite's gradients (or its lease) and adds them to the core's
                self.satellites.run_step(self.backend, batches.__getitem__, coordinator=feed, timeout_s=timeout_s)
        finally:
            feed.stop()
        if waiting:  # the batch statistics of every group, now that all are in
            metrics = {**builder.report.step_metrics(), **metrics}
            report = builder.report.to_dict()
        metrics["rollout_s"] = self.rollout_s(step)  # a streamed step's rollouts end while it trains
        executions = {e for b in batches for e in b.execution_ids}
        self.await_publish()  # the last version is recorded (and checkpointed) before this step makes the next
        optimizer_started = time.monotonic()
        if executions:
            result = self.backend.optimizer_step(normalizer=float(len(executions)))
        else:  # every group was left out (its micro-steps empty): no update, as a step with no batch
            result = StepResult(policy_version=self.coordinator.state.policy_version, grad_norm=0.0, normalizer=1.0)
        metrics["optimizer_s"] = time.monotonic() - optimizer_started
        summary = self.coordinator.close_step(result, duration_s=time.monotonic() - started, metrics=metrics)
        if self.satellites is not None:
            self.satellites.close_step()
        if executions:
            self.publish(result.policy_version)
        figures.micro_steps = len(batches)
        figures.trained_tokens = sum(b.trained_tokens for b in batches)
        figures.forwarded_tokens = summary.tokens
        figures.loss = summary.stats.loss_sum / result.normalizer
        figures.train_s = time.monotonic() - started
        figures.excluded = excluded(report)
        self.on_trained(figures)

    def close(self) -> None:
        self.await_publish()
        self._warm_stop.set()
        if self._warmer is not None:
            self._warmer.join()
        if self._source is not None:
            self._source.close()
            self._source = None

    def publish(self, version: int) -> None:
        """Make ``version`` durable and pullable, then record `weights_published` (and the checkpoint due).

        On an emulated accelerator the push to the rollout engines (``publish_s``) is not the core's time:
        the engines pull the registered copy, so the core goes on to its next step meanwhile (as `gyre sim`
        models it: a publish holds the core's link, not its compute), and the event and the checkpoint come
        when the push is over, from a thread; the next optimizer step, publish or close waits for them, so
        versions and checkpoints stay in order. A publish that cost the core its ``publish_s`` made every
        live step at staleness >= 1 start ~30 emulated seconds after `gyre sim`'s. Without an emulated
        accelerator all of it happens here."""
        self.await_publish()
        started = time.perf_counter()
        named = dict(self.backend.named_tensors())
        stored = self.weights.save(version, named)
        if self.satellites is not None:  # the same bytes, registered for satellites' and engines' Mooncake pulls
            self.satellites.publish(version, named, location=stored.location, sha256=stored.sha256)
        self._published = Published(version, stored.location, stored.sha256)
        step = max(self.coordinator.state.steps)  # before the next step opens

        def record() -> None:
            if self.pacer is not None:  # recorded once the emulated push is over (on the core's link, shared
                self.pacer.transfer(started, self.pacer.emulation.accelerator.publish_s)  # with satellites' pulls)
            self.coordinator.publish(version, tensors=stored.tensors, nbytes=stored.bytes,
                                     location=stored.location, duration_s=stored.duration_s, sha256=stored.sha256)
            if (step + 1) % self.config.checkpoint.every_steps == 0:
                self.checkpoint(step, version)
            self.weights.prune(version, protected=self._checkpointed)

        if self.pacer is None:
            record()
            return
        publishing: Future[None] = Future()

        def push() -> None:
            try:
                record()
            except BaseException as error:  # raised where the publish is awaited
                publishing.set_exception(error)
            else:
                publishing.set_result(None)

        self._publishing = publishing
        threading.Thread(target=push, name=f"gyre-publish-v{version}", daemon=True).start()

    def await_publish(self) -> None:
        """Wait for the publish under way (if any) to be recorded; its failure is raised here."""
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            publishing.result()

    def checkpoint(self, step: int, version: int) -> None:
        """Optimizer and trainer state after ``step``, durable, then `checkpoint_saved` names it."""
        from gyre.trainer.torch_backend import OPTIMIZER_FILE

        assert self._published is not None
        location = f"checkpoints/step-{step:06d}"
        path = self.backend.save_checkpoint(self.run_dir / location)
        fsync_tree(path)
        sink = self.coordinator.sink
        sink.commit(sink.record(CheckpointSaved(
            step=step, policy_version=version, covers_seq=self.durable_seq(), location=location,
            weights=self._published.location, sha256=file_sha256(path / OPTIMIZER_FILE))))
        self._checkpointed.add(version)

    # -- resume ---------------------------------------------------------------------------------------------

    def restore(self, run: RunState, step_groups: Callable[[int], tuple[str, ...]], *, exact: bool = True,
                tolerance: float = 1e-3) -> int:
        """Bring the trainer to the state the log describes (``run``: its fold, `gyre.state.run.RunView`);
        returns the number of steps retrained.

        ``exact``: a retrained step must reproduce the published weights bit for bit (one replica trains in
        a fixed order). With ``exact=False`` (a cluster core whose steps satellites shared: their gradients
        were summed in another order) the retrained weights must match the published ones within
        ``tolerance`` (largest difference over the largest weight, per tensor); the published weights are
        then loaded, and the optimizer keeps its retrained state."""
        from gyre.trainer.torch_backend import OPTIMIZER_FILE

        published = run.published
        self._checkpointed = {c.policy_version for c in run.checkpoints}
        first = 0
        if run.checkpoints:
            last = run.checkpoints[-1]
            path = self.run_dir / last.location
            if not path.is_dir() or file_sha256(path / OPTIMIZER_FILE) != last.sha256:
                raise WeightsError(f"checkpoint {path} is missing or does not match the checksum in the log")
            self.backend.load_checkpoint(path)
            first = last.step + 1
        retrained = 0
        for step in sorted(s for s, facts in run.steps.items() if facts.trained and s >= first):
            logged_version = run.steps[step].produced_version
            if logged_version == self.backend.policy_version:
                continue  # the step had no update
            self._retrain(step, step_groups(step))
            retrained += 1
            version = self.backend.policy_version
            if version != logged_version:
                raise WeightsError(f"retraining step {step} gave policy version {version}, "
                                   f"the log recorded {logged_version}")
            if version not in published:
                self.publish(version)  # the crash came between the step and its publish
                self.await_publish()  # recorded before the next retrained step changes the weights
                continue
            record = published[version]
            scratch = self.weights.save(version, dict(self.backend.named_tensors()),
                                        location=f"weights/v{version:06d}.resume.safetensors")
            scratch_path = self.weights.path(scratch.location)
            if scratch.sha256 != record.sha256:
                scratch_path.unlink()
                if exact:
                    raise WeightsError(f"retraining step {step} did not reproduce the logged weights of version "
                                       f"{version} (checksum {scratch.sha256}, the log recorded {record.sha256})")
                self._adopt_published(step, version, record, tolerance)
                continue
            scratch_path.replace(self.weights.path(record.location))  # identical bytes: restores a lost file
        latest = run.latest
        if latest is not None and latest.version == self.backend.policy_version:
            self._published = Published(latest.version, latest.location, latest.sha256)
        return retrained

    def _adopt_published(self, step: int, version: int, record: Weights, tolerance: float) -> None:
        published = self.weights.load(record.location, record.sha256)
        for name, tensor in self.backend.named_tensors():
            reference = published[name].to(tensor.dtype)
            worst = float((tensor.detach() - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
            if worst > tolerance:
                raise WeightsError(f"retraining step {step} gave weights of version {version} that differ from the "
                                   f"published ones: {name} by {worst:.2e} of its largest weight (tolerance "
                                   f"{tolerance:g})")
        self.backend.load_weights(published, policy_version=version)

    def _retrain(self, step: int, groups: tuple[str, ...]) -> None:
        """Train a logged step again, in the order it was trained, logging nothing."""
        _, batches, waiting = self._batches(groups)
        if waiting:
            raise WeightsError(f"step {step} finished in the log, yet its groups {waiting} are not complete in it")
        executions = {e for b in batches for e in b.execution_ids}
        self.backend.zero_grad()
        for batch in batches:
            self.backend.forward_backward(batch)
        if executions:
            self.backend.optimizer_step(normalizer=float(len(executions)))


def excluded(report: dict) -> dict[str, int]:
    """The build report's exclusion and group counts that are not zero (the CLI shows them)."""
    return {k: v for k, v in report.items()
            if isinstance(v, int) and v and (k.startswith("excluded_") or k.startswith("groups_"))}


class _Feed:
    """The step's coordinator as its replicas see it while groups of the step are still rolling out.

    A thread follows the log; each group it completes is built (in completion order, numbered on) and its
    micro-steps offered to satellites, then marked ready. A failure there reaches the replicas at their
    next claim or wait, so the step fails instead of waiting for ever."""

    def __init__(self, core: LocalCoreTrainer, builder: BatchBuilder, batches: list[TrainBatch],
                 waiting: list[str]) -> None:
        self.core, self.coordinator, self.builder = core, core.coordinator, builder
        self.batches, self.waiting = batches, waiting
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def offer(self, batches: list[TrainBatch]) -> None:
        if not batches:
            return
        if self.core.satellites is not None:
            self.core.satellites.offer(batches)
        self.coordinator.mark_ready({b.index: b.tokens for b in batches},
                                    {b.index: b.execution_ids for b in batches})

    def start(self) -> None:
        if self.waiting:
            self._thread = threading.Thread(target=self._follow, name="gyre-step-feed", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        source = self.core._log()
        try:
            while self.waiting and not self._stop.is_set():
                source.refresh_available(FEED_POLL_S)
                done = source.completed(self.waiting)
                if not done:
                    continue
                built = self.core._build(self.builder, done)
                self.batches.extend(built)  # before they are claimable: a replica looks its batch up here
                self.waiting = [g for g in self.waiting if g not in set(done)]
                self.offer(built)
        except BaseException as error:  # handed to the replicas (`_check`), never swallowed
            self._error = error
            self.coordinator.notify()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _check(self) -> None:
        if self._error is not None:
            raise StepProtocolError(f"streaming the step's groups failed: {self._error}") from self._error

    # -- what a replica needs of the coordinator (`gyre.trainer.replica.Coordinator`) ------------------------

    def claim(self, cell_id: str) -> Claim:
        self._check()
        return self.coordinator.claim(cell_id)

    def finish(self, cell_id: str, step: int, micro_step: int, result: MicroStepResult) -> None:
        self.coordinator.finish(cell_id, step, micro_step, result)

    def wait_for_work(self, timeout_s: float) -> None:
        self._check()
        self.coordinator.wait_for_work(timeout_s)
