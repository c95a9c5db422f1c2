"""Events to scalar metrics (pure): which events carry metrics, and under which tag each one is shown.

The x axis of every scalar is the policy version the measured rollouts were sampled from: a train step
``s`` samples from version ``s``, and the held-out evaluation logged with ``step = s`` ran version ``s``
before step ``s`` trained.
"""

from dataclasses import dataclass
from datetime import datetime

from gyre.events.models import ENVELOPE_FIELDS, Event, HeldOutEvaluated, TrainStepFinished

KINDS = (TrainStepFinished.kind, HeldOutEvaluated.kind)
"""Kinds that carry metrics; the exporters follow these (and ``run_finished``, to know when to stop)."""

_NOT_METRICS = frozenset({*ENVELOPE_FIELDS, "step", "policy_version", "group_prefix"})


@dataclass(frozen=True)
class Scalar:
    tag: str
    step: int
    value: float
    wall_time: float
    """Seconds since the epoch (the event's ``ts``)."""


def scalars(event: Event) -> list[Scalar]:
    """The scalars of one event (none for kinds that carry no metrics); missing (None) metrics are skipped."""
    if isinstance(event, TrainStepFinished):
        prefix = "train"
    elif isinstance(event, HeldOutEvaluated):
        prefix = "heldout"
    else:
        return []
    assert event.step is not None
    wall = event.ts.timestamp() if isinstance(event.ts, datetime) else 0.0
    out = []
    for name in event.payload_fields():
        value = getattr(event, name)
        if name in _NOT_METRICS or value is None or isinstance(value, bool | str):
            continue
        out.append(Scalar(f"{prefix}/{name}", event.step, float(value), wall))
    return out
