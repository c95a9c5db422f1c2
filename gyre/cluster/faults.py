"""Fault injection for tests and the chaos benchmark: a cell process SIGKILLs itself at a named moment.

Some moments are too short to hit from outside (a tiny model's train step lasts milliseconds), so a test
names them in the environment of `gyre run`, which every process it starts inherits:

    GYRE_CRASH_AT="cell0:micro_step_finished@6,cell2:claim"

- ``<cell>:<event kind>[@n]``: the cell kills itself once the n-th (default first) event of that kind it
  recorded is durable (the core's trainer records every step's events: ``train_step_started``,
  ``micro_step_finished`` of every replica, ...);
- ``<cell>:claim``: a satellite kills itself right after it claimed a micro-step, before the work;
- ``<cell>:yield``: not a crash: the core's replica claims a step's micro-steps only once every satellite
  joined at the step's start has claimed one (or left), so a test whose satellites must claim (to die at
  ``claim``) does not race a core that trains a tiny micro-step in milliseconds. A satellite that joins after
  the step started is not waited for: the test must see that one is joined first (the faults test does not
  stream its steps, so a step starts once its whole batch is done and every lent cell has joined).

Each point fires once per run: a marker ``<run_dir>/processes/<cell>.crashed-<point>`` is written first, so
the restarted process does not crash again. Unset, nothing here runs.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CRASH_ENV = "GYRE_CRASH_AT"
NOT_EVENTS = frozenset({"claim", "yield"})
"""Points that are not ``<event kind>[@n]`` (a `CrashingProducer` never watches for them)."""


def crash_points(cell_id: str, environ: dict[str, str] | None = None) -> set[str]:
    spec = (environ if environ is not None else os.environ).get(CRASH_ENV, "")
    points = set()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        cell, _, point = item.partition(":")
        if not point:
            raise ValueError(f"{CRASH_ENV}: {item!r} is not <cell>:<point>")
        if cell == cell_id:
            points.add(point)
    return points


def crash_once(run_dir: Path, cell_id: str, point: str) -> None:
    """SIGKILL this process unless the point already fired in this run."""
    marker = run_dir / "processes" / f"{cell_id}.crashed-{point}"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "x"):
            pass
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingProducer:
    """A producer that kills its process once it recorded (durably) the n-th event of a kind ``points`` name
    (``kind`` or ``kind@n``)."""

    def __init__(self, producer: Any, points: set[str], run_dir: Path, cell_id: str) -> None:
        self._producer, self._run_dir, self._cell_id = producer, run_dir, cell_id
        self._points: dict[str, tuple[int, str]] = {}
        for point in points:
            kind, _, nth = point.partition("@")
            self._points[kind] = (int(nth or 1), point)
        self._seen: dict[str, int] = {}

    def record(self, events: Any) -> int:
        position = self._producer.record(events)
        batch: Sequence[Any] = events if isinstance(events, list | tuple) else [events]
        for event in batch:
            if event.kind not in self._points:
                continue
            self._seen[event.kind] = self._seen.get(event.kind, 0) + 1
            nth, point = self._points[event.kind]
            if self._seen[event.kind] == nth:
                self._producer.commit(position)
                crash_once(self._run_dir, self._cell_id, point.replace("@", "-"))
        return position

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)
