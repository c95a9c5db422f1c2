"""Emulated accelerators (issue #26, deliverable 3): a cell keeps its real code paths — real token ids and
log-probs from the tiny model, the real proxy, log, trainer and transfers — and takes the time a configured
accelerator would (`Emulation`, `Pacer`)."""

from gyre.emulate.clock import Accelerator, Emulation, EmulationStats, Pacer
from gyre.emulate.trainer import PacedBackend

__all__ = ["Accelerator", "Emulation", "EmulationStats", "PacedBackend", "Pacer"]
