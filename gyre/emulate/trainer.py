"""A trainer replica on an emulated accelerator: each micro-step's forward-backward takes what its tokens cost
there (`Emulation.train_s`), the optimizer step ``optimizer_s``; the real computation is done first."""

from __future__ import annotations

from typing import Any

from gyre.emulate.clock import Pacer


class PacedBackend:
    """Wraps a trainer backend (`gyre.trainer.protocol.TrainerBackend`); everything else passes through."""

    def __init__(self, backend: Any, pacer: Pacer) -> None:
        self.backend, self.pacer = backend, pacer

    def forward_backward(self, batch: Any, **options: Any) -> Any:
        started = self.pacer.clock()
        result = self.backend.forward_backward(batch, **options)
        self.pacer.hold(started, self.pacer.emulation.train_s(batch.tokens))
        return result

    def optimizer_step(self, normalizer: float) -> Any:
        started = self.pacer.clock()
        result = self.backend.optimizer_step(normalizer)
        self.pacer.hold(started, self.pacer.emulation.accelerator.optimizer_s)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)
