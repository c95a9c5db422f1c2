"""Exact replay: re-derive every scheduling decision of a recorded run and report where they differ.

Two kinds of decision points, named by ``run_started.decision_points``:

- ``explicit`` (live runs, `gyre.controller`): each decision carries ``decided_at_seq``, the last seq of the
  log prefix its policy saw. Replay folds the log in ``seq`` order and, at each recorded point, before
  folding anything after it, re-runs the policy on exactly that prefix; the decisions recorded with that
  point must be exactly those it returns.
- ``instant`` (the simulator, see ``gyre.sim.engine``): a policy decides once per instant, on the events of
  that instant that precede its decisions, and its decisions are the ``role_switch_requested`` events of
  that instant; every instant is a decision point, including those that decided nothing.

Either way the policy is the recorded one (name, version and parameters from ``run_started``).
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from gyre.errors import GyreError
from gyre.events.models import Event, RoleSwitchRequested, RunStarted
from gyre.log import LogReader
from gyre.scheduler import DECISION_KINDS, VERSIONS, Policy, PolicyParams, SchedulerFold, get_policy

COMPARED_ENVELOPE = ("cell_id",)


class ReplayError(GyreError):
    """A log cannot be replayed (no ``run_started``, an unknown policy, bad parameters)."""


@dataclass(frozen=True)
class Mismatch:
    seq: int
    """Seq of the first event after the decision point (the first recorded decision, if any)."""
    ts: datetime
    recorded: list[dict[str, Any]]
    replayed: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts.isoformat(), "recorded": self.recorded, "replayed": self.replayed}


@dataclass
class ReplayReport:
    log: str
    run_id: str
    policy: str
    recorded_version: str
    current_version: str
    params: dict[str, Any]
    decision_points: int = 0
    decisions: int = 0
    """Decisions recorded in the log."""
    replayed_decisions: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    replayed: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """Every decision the current policy made, with the seq of its decision point (for golden files)."""

    def to_dict(self, examples: int = 5) -> dict[str, Any]:
        return {
            "log": self.log, "run_id": self.run_id, "policy": self.policy,
            "policy_version": self.recorded_version, "current_policy_version": self.current_version,
            "version_matches": self.recorded_version == self.current_version, "params": self.params,
            "decision_points": self.decision_points, "decisions": self.decisions,
            "replayed_decisions": self.replayed_decisions, "mismatches": len(self.mismatches),
            "mismatch_examples": [m.to_dict() for m in self.mismatches[:examples]],
        }


def decision_record(event: RoleSwitchRequested) -> dict[str, Any]:
    """What a decision says, without where and when the log put it (seq, ts, run id)."""
    out = {name: getattr(event, name) for name in COMPARED_ENVELOPE}
    out.update(event.model_dump(include=set(event.payload_fields()) - {"decided_at_seq"}))
    return out


def recorded_policy(start: RunStarted, policy: str | None = None, params: dict[str, Any] | None = None,
                    version: str | None = None) -> tuple[Policy, PolicyParams]:
    """The recorded policy and parameters; ``version``: another shipped version of it, given the recorded
    parameters it takes (what that version would have decided on the same log prefixes)."""
    try:
        chosen = get_policy(policy) if policy else get_policy(start.policy, version or _shipped(start))
    except GyreError as error:
        raise ReplayError(f"cannot replay run {start.run_id}: {error}") from error
    if params is not None:
        return chosen, chosen.params(params)
    if version is None:
        return chosen, chosen.params(start.policy_params)
    recorded = json.loads(start.policy_params or "{}")
    return chosen, chosen.params({k: v for k, v in recorded.items() if k in chosen.params_type.model_fields})


def _shipped(start: RunStarted) -> str | None:
    """The recorded policy version when it is still shipped (else the current one, to report the drift)."""
    return start.policy_version if start.policy_version in VERSIONS else None


def replay_decisions(log_path: str | Path, params: dict[str, Any] | None = None,
                     version: str | None = None) -> ReplayReport:
    """Replay the recorded policy (optionally with other ``params``, or as another shipped ``version`` of it,
    to see what would change)."""
    events = _events(log_path)
    start = next(events, None)
    if not isinstance(start, RunStarted):
        raise ReplayError(f"log {log_path} does not begin with run_started, so its policy is unknown")
    policy, policy_params = recorded_policy(start, params=params, version=version)
    report = ReplayReport(log=str(log_path), run_id=start.run_id, policy=policy.name,
                          recorded_version=start.policy_version, current_version=policy.version,
                          params=policy_params.model_dump())
    if start.decision_points == "explicit":
        _replay_explicit(log_path, start, policy, policy_params, report)
        return report
    fold = SchedulerFold()
    for instant in _instants(events, first=start):
        report.decision_points += 1
        cut = next((i for i, e in enumerate(instant) if e.kind in DECISION_KINDS), len(instant))
        for event in instant[:cut]:
            fold.apply(event)
        recorded = [decision_record(e) for e in instant[cut:] if isinstance(e, RoleSwitchRequested)]
        replayed = [decision_record(d) for d in policy.decide(fold.view, policy_params)]
        point_seq = instant[cut].seq if cut < len(instant) else instant[-1].seq
        report.decisions += len(recorded)
        report.replayed_decisions += len(replayed)
        report.replayed.extend((point_seq, d) for d in replayed)
        if recorded != replayed:
            report.mismatches.append(Mismatch(point_seq, instant[0].ts, recorded, replayed))
        for event in instant[cut:]:
            fold.apply(event)
    return report


def _replay_explicit(log_path: str | Path, start: RunStarted, policy: Policy, params: PolicyParams,
                     report: ReplayReport) -> None:
    recorded: dict[int, list[RoleSwitchRequested]] = {}
    for event in LogReader(log_path).events(kinds=sorted(DECISION_KINDS)):
        assert isinstance(event, RoleSwitchRequested)
        if event.decided_at_seq is None or event.seq is None or event.decided_at_seq >= event.seq:
            raise ReplayError(f"decision at seq {event.seq} of {log_path} does not name an earlier log prefix "
                              f"(decided_at_seq {event.decided_at_seq}) although run_started says the run "
                              f"records explicit decision points")
        recorded.setdefault(event.decided_at_seq, []).append(event)
    points = sorted(recorded)
    fold = SchedulerFold()
    fold.apply(start)
    folded = start.seq if start.seq is not None else 0
    next_point = 0

    def decide_at(point: int) -> None:
        replayed = [decision_record(d) for d in policy.decide(fold.view, params)]
        said = [decision_record(e) for e in recorded[point]]
        report.decision_points += 1
        report.decisions += len(said)
        report.replayed_decisions += len(replayed)
        report.replayed.extend((point, d) for d in replayed)
        if said != replayed:
            first = recorded[point][0]
            assert first.seq is not None and first.ts is not None
            report.mismatches.append(Mismatch(first.seq, first.ts, said, replayed))

    for event in LogReader(log_path).events(from_seq=folded + 1):
        assert event.seq is not None
        while next_point < len(points) and points[next_point] < event.seq:
            decide_at(points[next_point])  # the fold holds exactly the prefix ending at that point
            next_point += 1
        fold.apply(event)
        folded = event.seq
    while next_point < len(points):
        if points[next_point] > folded:
            raise ReplayError(f"a decision names prefix {points[next_point]}, past the end of {log_path}")
        decide_at(points[next_point])
        next_point += 1


def _events(log_path: str | Path) -> Iterator[Event]:
    yield from LogReader(log_path).events()


def _instants(events: Iterator[Event], first: Event) -> Iterator[list[Event]]:
    """Consecutive events sharing a ``ts``, starting with ``first``."""
    instant = [first]
    for event in events:
        if event.ts != instant[0].ts:
            yield instant
            instant = [event]
        else:
            instant.append(event)
    yield instant
