"""One endpoint's egress shared by the transfers out of it: processor sharing, each transfer given as the time
it would take alone.

The core's link is what satellites pull weights over and what a publish pushes through (``share_core_link``):
seven satellites joining together each take seven times a lone pull, as a real NIC would give them. One rule,
two clocks: `FairShare` is the pure arithmetic, `gyre.sim.training` drives it with the simulator's agenda
(integer microseconds) and `SharedLink` with the wall clock of a live emulated cell (threads waiting on it).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable


class FairShare:
    """Transfers in flight, each with the time it still needs alone; every one progresses at ``1/n``.

    Time is whatever unit the caller uses, as long as it is the same for ``now`` and the amounts."""

    def __init__(self, now: float = 0.0) -> None:
        self.remaining: dict[Hashable, float] = {}
        self.t = now

    def advance(self, now: float) -> None:
        """Bring every transfer's remaining time to ``now``."""
        if self.remaining:
            share = (now - self.t) / len(self.remaining)
            for key in self.remaining:
                self.remaining[key] -= share
        self.t = now

    def add(self, key: Hashable, alone: float, now: float) -> None:
        self.advance(now)
        self.remaining[key] = alone

    def until_next(self) -> float | None:
        """Time until the first transfer in flight finishes if none is added meanwhile (None: none in flight)."""
        if not self.remaining:
            return None
        return min(self.remaining.values()) * len(self.remaining)

    def pop_finished(self, tolerance: float) -> list[Hashable]:
        """Remove and return (in the order they started) the transfers with at most ``tolerance`` left."""
        done = [key for key, left in self.remaining.items() if left <= tolerance]
        for key in done:
            del self.remaining[key]
        return done


class SharedLink:
    """`FairShare` on the wall clock, for threads: ``transfer`` blocks until the caller's transfer is through.

    A transfer that leaves wakes the others, whose share has grown; one that arrives wakes them too (their
    finish moved later). ``begin`` / ``wait`` split it where the caller must start several transfers at once
    (tests)."""

    TOLERANCE_S = 1e-4

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._share = FairShare(clock())
        self._changed = threading.Condition()
        self._ids = itertools.count()

    def begin(self, alone_s: float, started: float | None = None) -> tuple[int, float]:
        """Start a transfer of ``alone_s`` wall seconds alone; real work done for it since ``started`` counts
        as done. Returns a ticket for `wait`."""
        with self._changed:
            now = self.clock()
            key = next(self._ids)
            since = now if started is None else started
            self._share.add(key, max(0.0, alone_s - (now - since)), now)
            self._changed.notify_all()
            return key, since

    def wait(self, ticket: tuple[int, float]) -> float:
        """Block until the transfer is through; returns the wall seconds since it started."""
        key, since = ticket
        with self._changed:
            while True:
                self._share.advance(self.clock())
                if self._share.remaining[key] <= self.TOLERANCE_S:
                    del self._share.remaining[key]
                    self._changed.notify_all()
                    return self.clock() - since
                self._changed.wait(self._share.remaining[key] * len(self._share.remaining))

    def transfer(self, alone_s: float, started: float | None = None) -> float:
        return self.wait(self.begin(alone_s, started))

    @property
    def in_flight(self) -> int:
        with self._changed:
            return len(self._share.remaining)
