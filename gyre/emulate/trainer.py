"""A trainer replica on an emulated accelerator: each micro-step's forward-backward takes what its tokens cost
there (`Emulation.train_s`), and reports that as its duration; the optimizer step ``optimizer_s``; the real
computation is done first."""

from __future__ import annotations

import dataclasses
from typing import Any

from gyre.emulate.clock import Pacer


class PacedBackend:
    """Wraps a trainer backend (`gyre.trainer.protocol.TrainerBackend`); everything else passes through."""

    def __init__(self, backend: Any, pacer: Pacer) -> None:
        self.backend, self.pacer = backend, pacer
        self._host_s = 0.0

    def host_work(self, seconds: float) -> None:
        """``seconds`` of host work for the next micro-step (the step's batch, built from the log) overlap
        the accelerator's time, as a data loader's does: the next micro-step's hold counts them as its own.
        `gyre sim` charges a step its micro-steps, not its batch query, and real host time here would
        otherwise count ``time_scale`` times (4 s building a colocate step's whole batch was 65 emulated
        seconds at ``time_scale`` 15). What outlasts the hold is an overrun, reported as any other."""
        self._host_s += seconds

    def forward_backward(self, batch: Any, **options: Any) -> Any:
        started, self._host_s = self.pacer.clock() - self._host_s, 0.0
        result = self.backend.forward_backward(batch, **options)
        self.pacer.hold(started, self.pacer.emulation.train_s(batch.tokens))
        # the micro-step took the accelerator's time, not the CPU's: the policies weigh a lent cell's training
        # gain by the logged micro-step durations (0.07 s of real compute against 20 s held on
        # terminal-bench-like-scaled made elastic see no gain in lending a cell)
        return dataclasses.replace(result, duration_s=self.pacer.clock() - started)

    def optimizer_step(self, normalizer: float) -> Any:
        started = self.pacer.clock()
        result = self.backend.optimizer_step(normalizer)
        self.pacer.hold(started, self.pacer.emulation.accelerator.optimizer_s)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)
