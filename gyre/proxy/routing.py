"""Which engine serves an execution, the calls in flight on each, and the hook for moving KV on redirect.

Each execution is pinned to one cell (its engine keeps the execution's prefix cache warm). Whoever schedules
sets the pins (`register_execution(cell_id=...)`, `redirect`); without a choice, an execution goes to the
cell with the fewest pinned executions.

In a cluster the controller also says which cells admit new executions and how many slots each has
(`set_route`); `place` then pins an execution, when its harness starts, to the admitting cell with the most
free slots, and `repin_plan` moves a leaving cell's executions where the policy's redirect plan says.

A cell whose engine the proxy finds lost (it refuses connections, its streams are cut) is marked *down*
(`mark_down`): it admits nothing and its executions move to the live admitting cells with the most free
slots, until the controller routes the cell again - a new engine for it (`add_cell`: a restarted cell, with
its new URL), or a route taking it out of rollout (`set_route(admitting=False)`), after which its next
admitting route re-adds it. A routing table that still lists it as admitting (sent before the controller
noticed the loss) does not. Whoever waits for a cell to come back `watch`es the router's changes. Without a
controller (no `set_route` ever: a fixed set of engines) nothing would route a cell again: when no live cell
is left, the marks are cleared (`revive`) so that the harness's retry tries the engines again.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gyre.engine.errors import EngineError
from gyre.proxy.errors import UnknownCellError
from gyre.proxy.transport import GenerateEngine

log = logging.getLogger(__name__)

UNPLACED = ""
"""The cell of an execution registered before it is placed (a cluster places it when its harness starts)."""


@dataclass(eq=False)
class Flight:
    """One engine request in progress (one attempt of a call)."""

    execution_id: str
    call_id: str
    cell_id: str
    rid: str
    redirect_to: str | None = None
    """Set by `redirect`: the request is being aborted and the call continues on this cell."""
    lost: EngineError | None = None
    """Set when the request failed because its engine could not be reached (refused, reset, stream cut)."""
    cut: bool = False
    """Set by `Proxy.cut` (partial rollouts): aborted; the call continues once its execution is placed again."""


class Router:
    """Cells and their engines, execution pins, and flights per cell. Used from the proxy's event loop."""

    def __init__(self, engines: Mapping[str, GenerateEngine]) -> None:
        if not engines:
            raise ValueError("the proxy needs at least one engine (cell)")
        self._engines: dict[str, GenerateEngine] = dict(engines)
        self._lock = threading.Lock()  # pins change from the runner's thread too (register_execution)
        self._pins: dict[str, str] = {}
        self._flights: dict[str, set[Flight]] = {cell: set() for cell in engines}
        self._slots: dict[str, int] = {}
        """Cells that admit new executions, with their slots (set by the controller's routing updates)."""
        self._versions: dict[str, int] = {}
        """The weights version each routed cell's engine holds (-1: unknown); a cell never given one is not
        checked (engines without a controller)."""
        self._need: dict[str, int] = {}
        """The version each placed execution was queued with: it runs only where the engine holds that or newer."""
        self._cut: set[str] = set()
        """Executions cut off a cell leaving rollout (partial rollouts), not yet placed again."""
        self._routed = False
        """Whether a controller ever routed (`set_route`); without one every live cell may take an execution."""
        self._down: set[str] = set()
        """Cells whose engine was lost (`mark_down`), until the controller routes them again."""
        self._retired: list[GenerateEngine] = []
        """Engines replaced by `add_cell` (closed with the router; a call may still be using one)."""
        self._watchers: dict[int, Callable[[], None]] = {}
        self._next_watcher = 0

    @property
    def cells(self) -> list[str]:
        return list(self._engines)

    def engine(self, cell_id: str) -> GenerateEngine:
        try:
            return self._engines[cell_id]
        except KeyError:
            raise UnknownCellError(f"no engine for cell {cell_id!r}; cells: {', '.join(self._engines)}") from None

    def add_cell(self, cell_id: str, engine: GenerateEngine) -> None:
        """Add a cell, or give a known cell a new engine (a restarted cell): that clears its down mark."""
        with self._lock:
            old = self._engines.get(cell_id)
            if old is not None and old is not engine:
                self._retired.append(old)
                self._down.discard(cell_id)
            self._engines[cell_id] = engine
            self._flights.setdefault(cell_id, set())
        self._changed()

    def set_route(self, cell_id: str, slots: int, admitting: bool, version: int | None = None) -> None:
        """Whether ``cell_id`` (whose engine must be known) admits new executions, its slots, and the weights
        version its engine holds (it admits only executions queued with that version or an older one).

        A down cell stays down on an admitting route (it may predate the loss); a route taking it out of
        rollout clears the mark, so that the controller's next admitting route re-adds it."""
        self.engine(cell_id)
        with self._lock:
            self._routed = True
            if version is not None:
                self._versions[cell_id] = version
            if admitting:
                self._slots[cell_id] = slots
            else:
                self._slots.pop(cell_id, None)
                self._down.discard(cell_id)
        self._changed()

    def admitting(self, version: int = 0) -> dict[str, int]:
        """Admitting cells (not down) whose engine holds ``version`` or newer, and their free slots (slots
        minus the executions pinned there)."""
        with self._lock:
            return self._free_locked(version)

    def holds(self, cell_id: str, version: int) -> bool:
        """Whether ``cell_id``'s engine holds ``version`` or newer (a cell never routed with a version: yes)."""
        return self._versions.get(cell_id, version) >= version

    def need(self, execution_id: str) -> int:
        """The version ``execution_id`` was placed with (0 when unknown)."""
        return self._need.get(execution_id, 0)

    def _free_locked(self, version: int = 0) -> dict[str, int]:
        load = {cell: 0 for cell in self._slots if cell not in self._down and self.holds(cell, version)}
        for cell in self._pins.values():
            if cell in load:
                load[cell] += 1
        return {cell: self._slots[cell] - load[cell] for cell in sorted(load)}

    def _live_free_locked(self, version: int = 0) -> dict[str, int]:
        """Where an execution leaving a lost cell may go, with free slots (possibly none: a survivor takes
        more than its slots rather than fail a harness). Never routed: every live cell, the least loaded
        first."""
        if self._routed:
            return self._free_locked(version)
        load = {cell: 0 for cell in sorted(self._engines) if cell not in self._down}
        for cell in self._pins.values():
            if cell in load:
                load[cell] += 1
        return {cell: -n for cell, n in load.items()}

    # -- lost engines ----------------------------------------------------------------------------------

    @property
    def routed(self) -> bool:
        """Whether a controller routes the cells (`set_route` was called): only then can a lost cell come
        back by a routing update."""
        return self._routed

    def revive(self) -> list[str]:
        """Clear every down mark (without a controller, when no live cell is left: the next call tries the
        engines again, which may have restarted); returns the cells that were down."""
        with self._lock:
            revived, self._down = sorted(self._down), set()
        self._changed()
        return revived

    def is_down(self, cell_id: str) -> bool:
        return cell_id in self._down

    def down(self) -> list[str]:
        with self._lock:
            return sorted(self._down)

    def mark_down(self, cell_id: str, engine: GenerateEngine | None = None) -> dict[str, str]:
        """``cell_id``'s engine is lost: the cell admits nothing and its executions move to the live cells
        with the most free slots (those finding none keep their pin and wait: `relocate`). ``engine``: the
        engine found lost; nothing happens when the cell has had a new one since. Returns the new pins."""
        with self._lock:
            if cell_id not in self._engines or (engine is not None and self._engines[cell_id] is not engine):
                return {}
            self._down.add(cell_id)
            moved: dict[str, str] = {}
            free = self._live_free_locked()
            for execution in sorted(e for e, cell in self._pins.items() if cell == cell_id):
                need = self._need.get(execution, 0)
                target = max((c for c in free if self.holds(c, need)), key=lambda c: free[c], default=None)
                if target is None:
                    continue
                moved[execution] = target
                free[target] -= 1
            self._pins.update(moved)
        self._changed()
        return moved

    def relocate(self, execution_id: str) -> str | None:
        """The cell ``execution_id`` runs on: its pin unless that cell is down, else (re-pinned) the live
        admitting cell with the most free slots (`place`'s rule, lowest id among equals, even when full);
        None when it has no pin or no live cell admits."""
        with self._lock:
            cell = self._pins.get(execution_id)
            if cell is None:
                return None
            if cell not in self._down:
                return cell
            free = self._live_free_locked(self._need.get(execution_id, 0))
            target = max(free, key=lambda c: free[c], default=None)
            if target is not None:
                self._pins[execution_id] = target
        if target is not None:
            self._changed()
        return target

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (from whichever thread changes it) after every change of routes, engines or
        pins; returns the function that stops watching."""
        with self._lock:
            key = self._next_watcher
            self._next_watcher += 1
            self._watchers[key] = callback
        return lambda: self._watchers.pop(key, None)

    def _changed(self) -> None:
        for callback in list(self._watchers.values()):
            try:
                callback()
            except Exception:  # a watcher must not break a routing update
                log.exception("router watcher failed")

    def place(self, execution_id: str, version: int = 0) -> str | None:
        """Pin ``execution_id`` (queued with policy ``version``) to the admitting cell with the most free
        slots among those whose engine holds that version or newer (lowest id among equals); None when no
        such cell has a free slot."""
        with self._lock:
            free = self._free_locked(version)
            best = max(free, key=lambda c: free[c], default=None)
            if best is None or free[best] <= 0:
                return None
            if execution_id not in self._cut and self._cut_fits_locked():
                return None  # cut executions are placed first (slime's buffer is consumed first)
            self._pins[execution_id] = best
            self._need[execution_id] = version
        self._changed()
        return best

    def repin_plan(self, from_cell: str, planned: Mapping[str, str]) -> dict[str, str]:
        """Move every execution pinned to ``from_cell``: to ``planned[execution]`` where the plan names it,
        else to the admitting cell (other than ``from_cell``) with the most free slots; with no such cell it
        stays (the policy leaves a cell only when it holds no running execution it could not move).
        Returns the new pins."""
        for cell in set(planned.values()):
            self.engine(cell)
        with self._lock:
            free = {c: n for c, n in self._free_locked().items() if c != from_cell}
            leaving = sorted(e for e, cell in self._pins.items() if cell == from_cell)
            moved = {e: planned[e] for e in leaving if e in planned}  # the plan first: it reserved these slots
            for target in moved.values():
                if target in free:
                    free[target] -= 1
            for execution in (e for e in leaving if e not in planned):
                need = self._need.get(execution, 0)
                target = max((c for c in free if self.holds(c, need)), key=lambda c: free[c], default=None)
                if target is None:  # every cell leaves: the policy saw no execution here (this one has ended,
                    continue        # its runner not yet done unregistering it); it keeps its pin
                moved[execution] = target
                free[target] -= 1
            self._pins.update(moved)
        self._changed()
        return moved

    def pin(self, execution_id: str, cell_id: str | None = None) -> str:
        """Pin an execution to `cell_id`, or to the cell with the fewest pinned executions."""
        with self._lock:
            if cell_id is None:
                load = {cell: 0 for cell in self._engines if cell not in self._down} or dict.fromkeys(self._engines, 0)
                for pinned in self._pins.values():
                    if pinned in load:
                        load[pinned] += 1
                cell_id = min(load, key=lambda c: load[c])
            self.engine(cell_id)
            self._pins[execution_id] = cell_id
        return cell_id

    def cut(self, execution_id: str, version: int) -> None:
        """Partial rollouts: ``execution_id`` releases its slot and waits to be placed again (`place_cut`) on
        a cell holding ``version`` or newer."""
        with self._lock:
            self._pins.pop(execution_id, None)
            self._need[execution_id] = version
            self._cut.add(execution_id)
        self._changed()

    def _cut_fits_locked(self) -> bool:
        """Some cut execution waiting to be placed again has a free slot now."""
        for execution_id in self._cut:
            free = self._free_locked(self._need.get(execution_id, 0))
            if any(n > 0 for n in free.values()):
                return True
        return False

    def is_cut(self, execution_id: str) -> bool:
        return execution_id in self._cut

    def place_cut(self, execution_id: str) -> str | None:
        """A cut execution placed again (`place`'s rule, at the version it was cut with), or None for now."""
        cell = self.place(execution_id, self._need.get(execution_id, 0))
        if cell is not None:
            with self._lock:
                self._cut.discard(execution_id)
        return cell

    def unpin(self, execution_id: str) -> None:
        with self._lock:
            self._pins.pop(execution_id, None)
            self._need.pop(execution_id, None)
            self._cut.discard(execution_id)
        self._changed()

    def cell_of(self, execution_id: str) -> str:
        try:
            return self._pins[execution_id]
        except KeyError:
            raise UnknownCellError(f"execution {execution_id!r} is not placed on any cell yet") from None

    def pinned_on(self, cell_id: str) -> list[str]:
        """The executions pinned to ``cell_id``, by id."""
        with self._lock:
            return sorted(e for e, cell in self._pins.items() if cell == cell_id)

    def pin_of(self, execution_id: str) -> str | None:
        return self._pins.get(execution_id)

    def repin(self, from_cell: str, to_cells: Sequence[str]) -> dict[str, str]:
        """Move every execution pinned to `from_cell` onto `to_cells`, spread evenly; returns the new pins."""
        for cell in to_cells:
            self.engine(cell)
        if not to_cells:
            raise ValueError("redirect needs at least one target cell")
        targets = itertools.cycle(to_cells)
        with self._lock:
            moved = {execution: next(targets) for execution, cell in self._pins.items() if cell == from_cell}
            self._pins.update(moved)
        self._changed()
        return moved

    def track(self, flight: Flight) -> None:
        self._flights.setdefault(flight.cell_id, set()).add(flight)

    def untrack(self, flight: Flight) -> None:
        self._flights.get(flight.cell_id, set()).discard(flight)

    def flights_on(self, cell_id: str) -> list[Flight]:
        return list(self._flights.get(cell_id, ()))

    async def aclose(self) -> None:
        for engine in [*self._engines.values(), *self._retired]:
            await engine.aclose()


@dataclass(frozen=True, slots=True)
class KvMove:
    """A redirected call's state: the ids whose KV the old engine holds and the new one will need."""

    execution_id: str
    call_id: str
    from_cell: str
    to_cell: str
    token_ids: Sequence[int]
    rid: str | None = None
    """The old engine's request id (a paused request's live KV can be exported under it)."""


@dataclass(frozen=True, slots=True)
class KvMoveResult:
    """What a move did: pages (`blocks`), tokens and bytes moved, transfer and whole-move seconds, the
    prompt tokens the new engine still computes, and why nothing moved when a mover refused."""

    blocks: int = 0
    bytes: int = 0
    tokens: int = 0
    transfer_seconds: float = 0.0
    seconds: float = 0.0
    tokens_recomputed: int = 0
    refused: str | None = None


class KvMover(Protocol):
    """Moves KV blocks between engines before a redirected call continues (`gyre.proxy.kv_mover`).

    Called after the old engine aborted the request and before the call is re-issued on the new one.
    """

    async def move(self, move: KvMove) -> KvMoveResult: ...


class RecomputeKv:
    """Moves nothing: the new engine recomputes the prefix (from its own prefix cache where it has one)."""

    async def move(self, move: KvMove) -> KvMoveResult:
        return KvMoveResult(tokens_recomputed=len(move.token_ids))
