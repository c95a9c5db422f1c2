"""The trainer view: step, policy version, micro-step claims and completions, samples consumed."""

from dataclasses import dataclass, field

from gyre.state.fold import Projection, on


@dataclass
class StepState:
    step: int
    policy_version: int
    """Version the step trains from; the finished step publishes ``policy_version + 1`` (or as logged)."""
    planned_micro_steps: int
    claimed: dict[int, str] = field(default_factory=dict)
    """micro-step -> cell that claimed it (the latest claim wins)."""
    finished: set[int] = field(default_factory=set)
    closed: bool = False
    loss: float | None = None

    @property
    def pending(self) -> list[int]:
        """Micro-steps nobody has finished, in order (claimable or in progress)."""
        return [m for m in range(self.planned_micro_steps) if m not in self.finished]

    @property
    def unclaimed(self) -> list[int]:
        return [m for m in range(self.planned_micro_steps) if m not in self.claimed and m not in self.finished]


@dataclass
class TrainerState:
    policy_version: int = 0
    published_version: int | None = None
    steps: dict[int, StepState] = field(default_factory=dict)
    current_step: int | None = None
    consumed_samples: int = 0
    consumed_tokens: int = 0
    satellites: set[str] = field(default_factory=set)

    @property
    def current(self) -> StepState | None:
        return self.steps.get(self.current_step) if self.current_step is not None else None


class TrainerView(Projection[TrainerState]):
    name = "trainer"
    state_type = TrainerState

    @on("train_step_started", "step", "policy_version", "planned_micro_steps")
    def _started(self, s: TrainerState, step, policy_version, planned) -> None:
        s.steps[step] = StepState(step, policy_version, planned)
        s.current_step = step

    @on("micro_step_claimed", "step", "micro_step", "cell_id")
    def _claimed(self, s: TrainerState, step, micro_step, cell_id) -> None:
        if step in s.steps:
            s.steps[step].claimed[micro_step] = cell_id

    @on("micro_step_finished", "step", "micro_step")
    def _micro_finished(self, s: TrainerState, step, micro_step) -> None:
        if step in s.steps:
            s.steps[step].finished.add(micro_step)

    @on("micro_step_released", "step", "micro_step", "cell_id")
    def _released(self, s: TrainerState, step, micro_step, cell_id) -> None:
        current = s.steps.get(step)
        if current is None or current.closed:
            return
        if current.claimed.get(micro_step) == cell_id:  # only its holder's claim: a later claim stays
            del current.claimed[micro_step]
            current.finished.discard(micro_step)

    @on("train_step_finished", "step", "policy_version", "samples", "tokens", "loss")
    def _finished(self, s: TrainerState, step, policy_version, samples, tokens, loss) -> None:
        current = s.steps.get(step)
        if current is not None:
            current.closed, current.loss = True, loss
        s.policy_version = max(s.policy_version, policy_version)
        s.consumed_samples += samples
        s.consumed_tokens += tokens

    @on("train_step_aborted", "step")
    def _aborted(self, s: TrainerState, step) -> None:
        s.steps.pop(step, None)  # it produced nothing; the step is opened again under the same number
        if s.current_step == step:
            s.current_step = None

    @on("weights_published", "policy_version")
    def _published(self, s: TrainerState, policy_version) -> None:
        s.published_version = policy_version

    @on("satellite_joined", "cell_id")
    def _joined(self, s: TrainerState, cell_id) -> None:
        s.satellites.add(cell_id)

    @on("satellite_left", "cell_id")
    def _left(self, s: TrainerState, cell_id) -> None:
        s.satellites.discard(cell_id)
