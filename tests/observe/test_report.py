"""`gyre report`: the figures it computes from a log, and the page rendered in a real headless browser."""

import shutil
import subprocess
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path

import pytest
from run_log import CELLS, PER_STEP, write_run
from typer.testing import CliRunner

from gyre.cli import app
from gyre.events.models import RunStarted
from gyre.log import LogWriter
from gyre.report import report_data, write_report
from gyre.report.data import METRICS

STEPS = 4
PLOTS = 2 + len(METRICS) + 1 + 4  # rewards, metrics, tokens, cells and rollouts


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report")
    write_run(path / "log", steps=STEPS)
    return path


def test_figures_come_from_the_log(run_dir: Path) -> None:
    data = report_data(run_dir / "log")
    assert data["run"] | {"duration_s": None} == {"run_id": "r1", "name": "synthetic", "policy": "elastic",
                                                  "status": "completed", "duration_s": None, "steps": STEPS}
    assert data["steps"]["step"] == list(range(STEPS))
    assert data["steps"]["clip_fraction"] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert data["heldout"]["pass_rate"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert data["rewards"]["version"] == list(range(STEPS)) and data["rewards"]["count"] == [PER_STEP] * STEPS
    rollouts = data["rollouts"]
    assert rollouts["count"] == STEPS * PER_STEP and rollouts["cdf"][-1][1] == 1.0
    durations = [d for d, _ in rollouts["cdf"]]
    assert durations == sorted(durations) and rollouts["p50"] <= rollouts["p90"] <= rollouts["max"]
    assert [v for v, _, _ in rollouts["tail_share"]] == list(range(STEPS))
    assert all(0 <= share < 1 for _, share, _ in rollouts["tail_share"])
    assert max(v for _, v in data["watermark"]) == PER_STEP and data["watermark"][-1][1] == 0
    cells = {c["cell"]: c["segments"] for c in data["cells"]}
    assert set(cells) == set(CELLS)
    roles = [role for _, _, role in cells["cell2"]]
    assert roles[:4] == ["rollout", "switching", "training", "switching"]
    for segments in cells.values():  # contiguous, in time order
        assert all(a[1] == b[0] for a, b in pairwise(segments))
    switches = data["switches"]
    assert len(switches) == STEPS * 2 * len(CELLS)
    assert {s["direction"] for s in switches} == {"rollout→training", "training→rollout"}


def test_tail_share_is_the_wait_for_the_slowest_tenth(tmp_path: Path) -> None:
    """Ten rollouts queued at 0: nine end by 10 s, the last at 100 s, so 90 of the 100 s wait for one."""
    from datetime import UTC, datetime, timedelta

    from gyre.events.models import ExecutionFinished, ExecutionQueued

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    events = []
    for i in range(10):
        duration = 100.0 if i == 9 else 10.0
        events += [ExecutionQueued(execution_id=f"e{i}", task_id="t", group_id="g", ts=t0),
                   ExecutionFinished(execution_id=f"e{i}", status="completed", duration_s=duration,
                                     ts=t0 + timedelta(seconds=duration))]
    events.sort(key=lambda e: e.ts)
    with LogWriter(tmp_path / "log", run_id="t") as writer:
        writer.append(events)
        writer.commit()
    rollouts = report_data(tmp_path / "log")["rollouts"]
    assert rollouts["tail_share"] == [[0, pytest.approx(0.9), 10]]
    assert rollouts["slowest_share_of_time"] == pytest.approx(100 / 190)


class _Plots(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, dict[str, str | None]] = {}
        self.current: str | None = None
        self.series: dict[str, int] = {}
        self.ready = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body" and a.get("data-report-ready") == "true":
            self.ready = True
        if "data-plot" in a:
            self.current = a["data-plot"]
            self.plots[self.current or ""] = a
        elif self.current and tag in ("path", "rect") and a.get("class") in ("series", "segment", "bar"):
            self.series[self.current] = self.series.get(self.current, 0) + 1


def rendered(page: Path, tmp_path: Path) -> _Plots:
    """The page's DOM after its scripts ran, from Debian's chromium in headless mode (installed by make)."""
    browser = shutil.which("chromium")
    if browser is None:
        pytest.fail("chromium is not installed: `make browser` installs Debian's package (make test does)")
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=180, check=True,
    ).stdout
    parser = _Plots()
    parser.feed(dom)
    return parser


@pytest.mark.integration
def test_every_plot_renders_in_a_headless_browser(run_dir: Path, tmp_path: Path) -> None:
    page = write_report(run_dir)
    text = page.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    dom = rendered(page, tmp_path)
    assert dom.ready, "the report's script did not finish"
    assert len(dom.plots) == PLOTS
    states = {name: attrs.get("data-rendered") for name, attrs in dom.plots.items()}
    assert states == dict.fromkeys(dom.plots, "true"), {n: a.get("data-error") for n, a in dom.plots.items()}
    assert all(dom.series.get(name, 0) > 0 for name in dom.plots), dom.series


@pytest.mark.integration
def test_a_log_without_training_renders_empty_plots_not_errors(tmp_path: Path) -> None:
    with LogWriter(tmp_path / "log", run_id="r") as writer:
        writer.append(RunStarted(run_id="r", name="empty", policy="colocate", policy_version="x"))
        writer.commit()
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    dom = rendered(tmp_path / "report.html", tmp_path)
    assert dom.ready and len(dom.plots) == PLOTS
    assert {a.get("data-rendered") for a in dom.plots.values()} == {"empty"}


def test_report_names_a_missing_log(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "no log at" in result.output
