"""Busy-time accounting per cell, for utilization and idle GPU-hours (cross-checked against the log)."""

from dataclasses import dataclass, field


@dataclass
class Stats:
    cell_ids: list[str]
    slots: dict[str, int] = field(default_factory=dict)
    busy_us: dict[str, float] = field(default_factory=dict)
    switches: int = 0
    redirects: int = 0

    def __post_init__(self) -> None:
        self.busy_us = dict.fromkeys(self.cell_ids, 0.0)

    def rollout_busy(self, cell: str, us: int) -> None:
        """An execution held one of the cell's slots for ``us``: a 1/slots share of the cell."""
        self.busy_us[cell] += us / self.slots[cell]

    def training_busy(self, cell: str, us: int) -> None:
        self.busy_us[cell] += us
