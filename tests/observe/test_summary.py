"""The end-of-run table: metrics read back from the log, as many columns as the terminal fits."""

import io

import pytest
from rich.console import Console
from run_log import write_run

from gyre.observe.summary import COLUMNS, fit, step_rows, summary_table


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    log = tmp_path_factory.mktemp("summary") / "log"
    write_run(log, steps=3)
    return step_rows(log)


def render(rows: list[dict], width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(summary_table(rows, console.width, title="run"))
    return console.export_text().splitlines()


def test_rows_hold_the_step_metrics_and_the_heldout_pass_rate_before_each_step(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["heldout_pass_rate"] for r in rows] == [0.0, 0.25, 0.5]
    assert rows[1]["clip_fraction"] == pytest.approx(0.1) and rows[2]["kl"] == pytest.approx(3e-3)


@pytest.mark.parametrize("width", [40, 80, 120, 250])
def test_the_table_fits_the_terminal_and_keeps_the_most_important_columns(rows: list[dict], width: int) -> None:
    lines = render(rows, width)
    assert max(len(line) for line in lines) <= width
    kept = fit(COLUMNS, rows, width)
    assert kept == list(COLUMNS[: len(kept)])  # a prefix: the least important go first
    header = next(line for line in lines if "step" in line)
    assert all(c.header in header for c in kept)
    if width >= 80:
        assert {"reward", "held-out", "clip", "KL"} <= {c.header for c in kept}
    if width >= 250:
        assert kept == list(COLUMNS)


def test_missing_metrics_show_as_a_dash() -> None:
    (line,) = [line for line in render([{"step": 0}], 200) if line.strip().startswith("│ 0") or "0 │" in line]
    assert "–" in line
