"""Simulated time: integer microseconds on an agenda of future actions.

Integer time makes every timestamp exact in the log (``ts`` has microsecond resolution) and makes ties
explicit: actions due at the same microsecond run in the order they were scheduled, then the policy decides
once for that instant. Simulated runs start at ``SIM_EPOCH`` so ``ts`` reads as elapsed time.
"""

import heapq
import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

SIM_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
US = 1_000_000


def to_us(seconds: float) -> int:
    return round(seconds * US)


def timestamp(us: int) -> datetime:
    return SIM_EPOCH + timedelta(microseconds=us)


class Agenda:
    """Future actions by due time; FIFO among equal times."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, due_us: int, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (due_us, next(self._order), action))

    def next_due(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_us: int) -> Callable[[], None] | None:
        if self._heap and self._heap[0][0] <= now_us:
            return heapq.heappop(self._heap)[2]
        return None

    def __len__(self) -> int:
        return len(self._heap)
