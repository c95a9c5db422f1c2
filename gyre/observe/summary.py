"""The end-of-run table of `gyre train`, read from the log, with as many columns as the terminal fits.

Columns come in order of importance; the table keeps the longest prefix of them whose widths fit, so a
narrow terminal loses the least useful figures rather than wrapping every cell. The loss itself is left
out: on-policy GSPO's loss is ~0 by construction and says nothing about learning.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

Row = dict[str, Any]


def _num(key: str, spec: str) -> Callable[[Row], str]:
    def render(row: Row) -> str:
        value = row.get(key)
        return "–" if value is None else format(value, spec)

    return render


def _reward(row: Row) -> str:
    mean, std = row.get("reward_mean"), row.get("reward_std")
    if mean is None:
        return "–"
    return f"{mean:.3f}" if std is None else f"{mean:.3f}±{std:.2f}"


def _tokens(row: Row) -> str:
    forwarded, trained = row.get("tokens"), row.get("tokens_trained")
    return "–" if forwarded is None else f"{forwarded}/{'–' if trained is None else trained}"


def _heldout(row: Row) -> str:
    rate = row.get("heldout_pass_rate")
    return "–" if rate is None else f"{rate:.0%}"


@dataclass(frozen=True)
class Column:
    header: str
    render: Callable[[Row], str]


COLUMNS: tuple[Column, ...] = (
    Column("step", _num("step", "d")),
    Column("reward", _reward),
    Column("held-out", _heldout),
    Column("clip", _num("clip_fraction", ".3f")),
    Column("KL", _num("kl", ".2e")),
    Column("|Δlogp| max", _num("log_ratio_max", ".3f")),
    Column("entropy", _num("entropy", ".2f")),
    Column("resp len", _num("response_tokens_mean", ".0f")),
    Column("tokens fwd/trained", _tokens),
    Column("tok/s", _num("tokens_per_s", ".0f")),
    Column("rollout s", _num("rollout_s", ".1f")),
    Column("train s", _num("duration_s", ".1f")),
    Column("TIS", _num("tis_truncated_fraction", ".3f")),
    Column("adv std", _num("advantage_std", ".2f")),
    Column("grad norm", _num("grad_norm", ".3f")),
)

PADDING = 3
"""Per-column cost of a rich table with borders: one padding space each side and one rule."""


def fit(columns: Sequence[Column], rows: Sequence[Row], width: int) -> list[Column]:
    """The longest prefix of ``columns`` whose rendered widths fit in ``width`` characters (at least one)."""
    kept: list[Column] = []
    used = 1
    for column in columns:
        cells = [column.header, *(column.render(r) for r in rows)]
        need = max(len(c) for c in cells) + PADDING
        if kept and used + need > width:
            break
        kept.append(column)
        used += need
    return kept


def step_rows(log: str | Path) -> list[Row]:
    """One row per train step: its ``train_steps`` columns plus the held-out pass rate measured before it."""
    from gyre.report.data import report_data

    data = report_data(log)
    steps, heldout = data["steps"], data["heldout"]
    rows = [dict(zip(steps, values, strict=True)) for values in zip(*steps.values(), strict=True)] if steps else []
    rates = dict(zip(heldout.get("step", []), heldout.get("pass_rate", []), strict=True))
    for row in rows:
        row["heldout_pass_rate"] = rates.get(row["step"])
    return rows


def summary_table(rows: Sequence[Row], width: int, title: str = "") -> Table:
    table = Table(title=title)
    columns = fit(COLUMNS, rows, width)
    for column in columns:
        table.add_column(column.header, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(c.render(row) for c in columns))
    return table
