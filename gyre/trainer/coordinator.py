"""The core's step coordinator: the one writer of training events, deciding claims on the projection.

Every training fact is an event appended here — step started, micro-step claimed and finished (with the
cell that did it), step finished (with the new policy version), weights published, satellite joined or
left — and the same event is folded into a ``TrainerView`` state right away, so the state the claims are
decided on is exactly the fold of the log (a restart replays the log to the same state). Thread-safe:
the core's own replica and the threads serving satellites call it concurrently.
"""

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.events.models import (
    Event,
    MicroStepClaimed,
    MicroStepFinished,
    MicroStepReleased,
    SatelliteJoined,
    SatelliteLeft,
    TrainStepAborted,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.sink import EventSink
from gyre.state import TrainerState, TrainerView, replay
from gyre.trainer.claims import Claim, decide, held_by, open_step
from gyre.trainer.errors import StepProtocolError
from gyre.trainer.loss import LossStats
from gyre.trainer.protocol import MicroStepResult, StepResult


@dataclass(frozen=True)
class StepSummary:
    """What the finished micro-steps of a step added up to (from their results, in memory)."""

    step: int
    stats: LossStats
    tokens: int
    samples: int
    padded_tokens: int = 0
    forward_backward_s: float = 0.0
    """Sum of the micro-steps' durations (replicas in parallel add up: compute time, not wall time)."""

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss was taken over."""
        return self.stats.tokens


class StepCoordinator:
    """Arbiter of micro-step claims for one trainer (the core cell owns it, with the log writer)."""

    def __init__(self, sink: EventSink, state: TrainerState | None = None) -> None:
        """Events go to ``sink``; ``state`` is the trainer projection of the log so far (None: a new log)."""
        self.sink = sink
        self.view = TrainerView()
        self.state = state if state is not None else self.view.initial()
        self._lock = threading.Condition()
        self._ready: dict[int, int] = {}
        self._results: dict[int, MicroStepResult] = {}
        """The open step's finished micro-steps' results: a released one is dropped, so nothing counts twice."""
        self._executions: set[str] = set()

    @classmethod
    def resume(cls, sink: EventSink, log_path: str | Path) -> "StepCoordinator":
        """A coordinator whose state is the fold of the log at ``log_path`` (a restart replays the log)."""
        sink.commit()
        state, _ = replay(TrainerView(), log_path)
        return cls(sink, state)

    # -- steps -------------------------------------------------------------------------------------------

    def start_step(self, planned_micro_steps: int, *, groups: int = 0, trajectories: int = 0) -> int:
        """Open the next step at the current policy version; its micro-steps are claimable once ready."""
        with self._lock:
            if open_step(self.state) is not None:
                raise StepProtocolError(f"step {self.state.current_step} is still open")
            step = max(self.state.steps, default=-1) + 1
            self._ready, self._results, self._executions = {}, {}, set()
            self._append(
                TrainStepStarted(
                    step=step,
                    policy_version=self.state.policy_version,
                    planned_micro_steps=planned_micro_steps,
                    groups=groups,
                    trajectories=trajectories,
                ),
                commit=True,
            )
            return step

    def abort_open_step(self, reason: str) -> int | None:
        """Close a step its trainer died in (a resume): it produced nothing and will be opened again."""
        with self._lock:
            step = open_step(self.state)
            if step is None:
                return None
            self._append(TrainStepAborted(step=step.step, reason=reason), commit=True)
            self._lock.notify_all()
            return step.step

    def mark_ready(self, tokens: Mapping[int, int], executions: Mapping[int, tuple[str, ...]] | None = None) -> None:
        """Micro-steps whose data now exists (micro-step -> tokens); wakes replicas waiting for work."""
        with self._lock:
            step = open_step(self.state)
            if step is None:
                raise StepProtocolError("mark_ready with no open step")
            for m, n in tokens.items():
                if not 0 <= m < step.planned_micro_steps:
                    raise StepProtocolError(f"micro-step {m} is outside step {step.step}'s plan")
                self._ready[m] = n
            for ids in (executions or {}).values():
                self._executions.update(ids)
            self._lock.notify_all()

    def claim(self, cell_id: str) -> Claim:
        with self._lock:
            decision = decide(self.state, self._ready)
            if decision.status != "claimed":
                return decision
            assert decision.step is not None and decision.micro_step is not None
            tokens = self._ready[decision.micro_step]
            self._append(
                MicroStepClaimed(step=decision.step, cell_id=cell_id, micro_step=decision.micro_step, tokens=tokens),
                commit=True,
            )
            return Claim("claimed", decision.step, decision.micro_step, tokens)

    def notify(self) -> None:
        """Wake everyone waiting on the coordinator (something outside it changed: gradients landed)."""
        with self._lock:
            self._lock.notify_all()

    def wait_for_work(self, timeout_s: float) -> None:
        """Block until something changes (a micro-step ready, a step opened or closed) or the timeout."""
        with self._lock:
            self._lock.wait(timeout_s)

    def finish(self, cell_id: str, step: int, micro_step: int, result: MicroStepResult) -> None:
        with self._lock:
            current = self.state.steps.get(step)
            if current is None or current.closed:
                raise StepProtocolError(f"{cell_id} finished micro-step {micro_step} of step {step}, which is not open")
            if current.claimed.get(micro_step) != cell_id:
                owner = current.claimed.get(micro_step)
                raise StepProtocolError(f"{cell_id} finished micro-step {micro_step} of step {step}, owned by {owner}")
            if micro_step in current.finished:
                raise StepProtocolError(f"micro-step {micro_step} of step {step} finished twice")
            self._append(
                MicroStepFinished(
                    step=step,
                    cell_id=cell_id,
                    micro_step=micro_step,
                    tokens=result.tokens,
                    loss=result.loss,
                    duration_s=result.duration_s,
                    tokens_trained=result.trained_tokens,
                ),
                commit=True,
            )
            self._results[micro_step] = result
            self._lock.notify_all()

    def release(self, cell_id: str, micro_steps: Iterable[int], reason: str) -> list[int]:
        """Take back ``cell_id``'s micro-steps of the open step (claimed or finished, gradients not landed):
        one ``micro_step_released`` each, their results dropped; they are claimable again. Returns those
        released (a micro-step the cell no longer holds is skipped)."""
        with self._lock:
            step = open_step(self.state)
            if step is None:
                return []
            released = []
            for m in sorted(set(micro_steps)):
                if step.claimed.get(m) != cell_id:
                    continue
                self._append(MicroStepReleased(step=step.step, cell_id=cell_id, micro_step=m, reason=reason),
                             commit=False)
                self._results.pop(m, None)
                released.append(m)
            if released:
                self.sink.commit()
                self._lock.notify_all()
            return released

    def held_by(self, cell_id: str) -> list[int]:
        """Micro-steps of the open step that ``cell_id`` claimed or finished (what releasing it would free)."""
        with self._lock:
            return held_by(self.state, cell_id)

    def all_finished(self) -> bool:
        with self._lock:
            step = open_step(self.state)
            return step is not None and not step.pending

    def wait_all_finished(self, timeout_s: float) -> None:
        with self._lock:
            if not self._lock.wait_for(self._finished_locked, timeout_s):
                raise StepProtocolError(f"step {self.state.current_step} did not finish within {timeout_s} s")

    def _finished_locked(self) -> bool:
        step = open_step(self.state)
        return step is not None and not step.pending

    def close_step(
        self, result: StepResult, *, duration_s: float = 0.0, metrics: Mapping[str, Any] | None = None
    ) -> StepSummary:
        """Log the applied optimizer step (the version it produced) and close the step.

        The event carries the loss statistics and token counts of the finished micro-steps; ``metrics`` adds
        what only the caller knows (batch statistics, phase times: fields of ``TrainStepFinished``).
        """
        with self._lock:
            step = open_step(self.state)
            if step is None or step.pending:
                raise StepProtocolError("close_step before every planned micro-step finished")
            results = [self._results[m] for m in sorted(self._results)]
            stats = sum((r.stats for r in results), LossStats())
            summary = StepSummary(step.step, stats, sum(r.tokens for r in results), len(self._executions),
                                  sum(r.padded_tokens for r in results), sum(r.duration_s for r in results))
            self._append(
                TrainStepFinished(
                    step=step.step,
                    policy_version=result.policy_version,
                    micro_steps=step.planned_micro_steps,
                    samples=summary.samples,
                    tokens=summary.tokens,
                    loss=stats.loss_sum / result.normalizer,
                    grad_norm=result.grad_norm,
                    duration_s=duration_s,
                    **step_metrics(summary),
                    **(metrics or {}),
                ),
                commit=True,
            )
            self._lock.notify_all()
            return summary

    def publish(
        self, policy_version: int, *, tensors: int, nbytes: int, location: str, duration_s: float = 0.0,
        sha256: str = "",
    ) -> None:
        event = WeightsPublished(
            policy_version=policy_version, tensors=tensors, bytes=nbytes, location=location, duration_s=duration_s,
            sha256=sha256,
        )
        with self._lock:
            self._append(event, commit=True)
            self._lock.notify_all()

    # -- membership --------------------------------------------------------------------------------------

    def join(self, cell_id: str, *, transfer_s: float = 0.0) -> None:
        with self._lock:
            step = self.state.current_step if self.state.current_step is not None else 0
            version = self.state.policy_version
            self._append(
                SatelliteJoined(cell_id=cell_id, step=step, policy_version=version, transfer_s=transfer_s), commit=True
            )
            self._lock.notify_all()

    def leave(self, cell_id: str, reason: str = "") -> None:
        with self._lock:
            self._append(SatelliteLeft(cell_id=cell_id, step=self.state.current_step, reason=reason), commit=True)
            self._lock.notify_all()

    def _append(self, event: Event, *, commit: bool) -> None:
        position = self.sink.record(event)
        if commit:
            self.sink.commit(position)
        self.view.apply(self.state, event)


def step_metrics(summary: StepSummary) -> dict[str, Any]:
    """The ``TrainStepFinished`` metrics that the micro-steps' results determine."""
    stats = summary.stats
    measured = stats.tokens > 0
    return {
        "tokens_trained": summary.trained_tokens,
        "tokens_padded": summary.padded_tokens,
        "tokens_per_s": summary.tokens / summary.forward_backward_s if summary.forward_backward_s > 0 else None,
        "forward_backward_s": summary.forward_backward_s,
        "clip_fraction": stats.clip_fraction if measured else None,
        "tis_truncated_fraction": stats.truncated_fraction if measured else None,
        "log_ratio_mean": stats.mean_abs_token_log_ratio if measured else None,
        "log_ratio_max": stats.max_abs_token_log_ratio if measured else None,
        "kl": stats.kl if measured else None,
        "entropy": stats.entropy if measured else None,
    }
