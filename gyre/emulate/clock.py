"""What an emulated accelerator charges, and the pacer that holds a process to it.

An emulated cell does its real work (a forward step of the tiny model, a train step, a weight pull) and then
waits until the time the configured accelerator would have taken has passed (`Pacer.hold`): each cell is its
own capacity, so an idle cell never speeds up a busy one, and a run's timings are the accelerator's, not
the host's. Two scales make that fit one machine:

- ``time_scale`` compresses time: an emulated second lasts ``1 / time_scale`` seconds of wall time;
- ``token_scale`` lets a few real tokens stand for many: a scenario call of 2,000 output tokens decodes
  ``2000 / token_scale`` real ones (the scenario harness asks for that many), a real prompt token stands for
  ``token_scale`` prompt tokens, and the emulated time always uses the scenario's counts — one real decode
  iteration is ``token_scale`` iterations of the accelerator, each at the emulated context.

The costs are the simulator's (`gyre.sim.scenario.DecodeSpec`, `CallTiming`, `TrainingSpec`, `SwitchSpec`), so
a live emulated run and `gyre sim` price the same work the same way; `gyre.sim.emulation.accelerator` builds
an `Accelerator` from a scenario. When the real work takes longer than its emulated time the pacer cannot
give the time back: it counts the overrun (`EmulationStats`), and a run whose overrun share exceeds its
tolerance says its figures are not valid.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat

from gyre.emulate.link import SharedLink


class Accelerator(BaseModel):
    """One cell's accelerator, in scenario units (seconds of the emulated cluster)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_ms: NonNegativeFloat = Field(description="a decode iteration's cost whatever the batch")
    per_request_ms: NonNegativeFloat = Field(description="per request decoding in the iteration")
    per_mtoken_ms: NonNegativeFloat = Field(description="per million tokens of context the decoding requests hold")
    prefill_s_per_mtoken: NonNegativeFloat = Field(description="prefilling a million new prompt tokens")
    train_s_per_mtoken: PositiveFloat = Field(description="forward-backward of a million tokens on one cell")
    optimizer_s: NonNegativeFloat = Field(description="the optimizer step (with its all-reduce) per train step")
    publish_s: NonNegativeFloat = Field(description="pushing a new version to the rollout engines")
    satellite_join_s: NonNegativeFloat = Field(description="a satellite pulling the core's weights")
    to_training_s: NonNegativeFloat = Field(description="a cell's switch rollout -> training (engine released)")
    to_rollout_s: NonNegativeFloat = Field(description="a cell's switch training -> rollout (engine resumed)")
    kv_bytes_per_token: NonNegativeInt = 0
    kv_gb_per_s: PositiveFloat = 50.0
    share_core_link: bool = Field(
        False, description="satellites' weight pulls and publishes share the core's egress (`gyre.emulate.link`)")

    def decode_iteration_s(self, requests: int, context_tokens: float) -> float:
        """One iteration that gives each of ``requests`` decoding requests a token (``t(n, C)``)."""
        if requests <= 0:
            return 0.0
        return (self.step_ms + requests * self.per_request_ms + context_tokens / 1e6 * self.per_mtoken_ms) / 1e3


class Emulation(BaseModel):
    """An accelerator and the two scales that fit it on this machine (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    accelerator: Accelerator
    time_scale: PositiveFloat = 1.0
    token_scale: PositiveFloat = 1.0
    source: str = Field("", description="where the accelerator's figures come from (a scenario's name)")

    def engine_step_s(self, decoding: int, context_tokens: int, prefill_tokens: int) -> float:
        """Emulated seconds of one real engine step: ``decoding`` requests got a token each, holding
        ``context_tokens`` real tokens of context among them, and ``prefill_tokens`` real prompt tokens were
        computed (the prefix cache's hits are free, as they are on SGLang)."""
        k, a = self.token_scale, self.accelerator
        prefill = prefill_tokens * k * a.prefill_s_per_mtoken / 1e6
        return k * a.decode_iteration_s(decoding, context_tokens * k) + prefill

    def train_s(self, tokens: int, cells: int = 1) -> float:
        """Emulated seconds of a train step's forward-backward of ``tokens`` real tokens on ``cells`` cells."""
        return tokens * self.token_scale * self.accelerator.train_s_per_mtoken / 1e6 / max(1, cells)

    def kv_move_s(self, tokens: int) -> float:
        """Moving the KV of ``tokens`` real tokens at the accelerator's KV bandwidth."""
        a = self.accelerator
        return tokens * self.token_scale * a.kv_bytes_per_token / (a.kv_gb_per_s * 1e9)

    def wall_s(self, emulated_s: float) -> float:
        return emulated_s / self.time_scale


@dataclass
class EmulationStats:
    """What a pacer held: ``emulated_s`` of accelerator time (scenario seconds) for ``real_s`` of wall time
    spent computing; ``overrun_s`` (wall) where the real work took longer than its emulated time."""

    holds: int = 0
    emulated_s: float = 0.0
    real_s: float = 0.0
    waited_s: float = 0.0
    overrun_s: float = 0.0
    overruns: int = 0

    @property
    def overrun_share(self) -> float:
        """Overrun over the wall time the held work should have taken (0: every hold in time)."""
        return self.overrun_s / max(1e-9, self.real_s + self.waited_s - self.overrun_s)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "overrun_share": self.overrun_share}


class Pacer:
    """Holds work to its emulated time: ``hold(started, emulated_s)`` after the work, from ``started`` (a
    ``clock()`` reading taken before it). Thread-safe; ``sleep`` and ``clock`` are injectable for tests."""

    def __init__(self, emulation: Emulation, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.emulation, self.sleep, self.clock = emulation, sleep, clock
        self.stats = EmulationStats()
        self._lock = threading.Lock()
        self.link = SharedLink(clock) if emulation.accelerator.share_core_link else None
        """The core's egress where the accelerator shares it (`transfer`); None: each transfer has its own."""

    def hold(self, started: float, emulated_s: float) -> float:
        """Wait out the rest of ``emulated_s`` (scaled to wall time); returns the wall seconds waited."""
        real = self.clock() - started
        wall = self.emulation.wall_s(emulated_s)
        wait = max(0.0, wall - real)
        self._count(emulated_s, real, wall, wait)
        if wait > 0:
            self.sleep(wait)
        return wait

    def transfer(self, started: float, emulated_s: float) -> float:
        """A transfer out of this cell's link (a satellite's weight pull, a publish) that takes ``emulated_s``
        alone: with a shared link it shares the link with the others in flight, as `gyre sim`'s core link
        does; without, it is a `hold`. Returns the wall seconds waited."""
        if self.link is None:
            return self.hold(started, emulated_s)
        real, wall = self.clock() - started, self.emulation.wall_s(emulated_s)
        took = self.link.transfer(wall, started)
        wait = max(0.0, took - real)
        self._count(took * self.emulation.time_scale, real, wall, wait)  # what the shared link made of it
        return wait

    def _count(self, emulated_s: float, real: float, wall: float, waited: float) -> None:
        """One hold in the stats: ``real`` wall seconds of work against ``wall`` alone, ``waited`` after it."""
        with self._lock:
            s = self.stats
            s.holds += 1
            s.emulated_s += emulated_s
            s.real_s += real
            s.waited_s += waited
            if real > wall:
                s.overrun_s += real - wall
                s.overruns += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return self.stats.to_dict()
