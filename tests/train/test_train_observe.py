"""`gyre train` end to end with observability on: held-out evaluations, metrics on every train step, the
summary table within the terminal's width, exporters following the log, and the report written."""

from pathlib import Path

from typer.testing import CliRunner

from gyre.cli import app
from gyre.log import LogReader

CONFIG = """
name = "observe"
run_dir = "{run_dir}"
seed = 5
steps = 1

[rollout]
task_ids = ["hello"]
groups_per_step = 1
group_size = 3
max_concurrency = 3
timeout_s = 60

[sampling]
max_tokens = 16

[trainer]
lr = 1e-3
eps_low = 0.2
eps_high = 0.28

[evaluation]
every = 1
task_ids = ["sum"]
samples = 2

[observe]
exporters = ["tensorboard", "wandb"]
"""


def test_train_logs_metrics_evaluates_held_out_exports_and_reports(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "observe.toml"
    config.write_text(CONFIG.format(run_dir=run_dir))
    result = CliRunner().invoke(app, ["train", str(config)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    first = next(i for i, line in enumerate(lines) if "observe: completed" in line)
    table = "\n".join(lines[first : next(i for i, line in enumerate(lines) if line.startswith("log: "))])
    for header in ("step", "reward", "held-out", "clip", "KL"):
        assert header in table
    assert "loss" not in table  # ~0 by construction on-policy: not a figure to show
    assert "held-out after 0 steps: pass rate" in result.output
    assert "held-out after 1 steps: pass rate" in result.output

    con = LogReader(run_dir / "log").duckdb()
    heldout = con.execute("select step, policy_version, executions, scored, pass_rate from heldout_evaluations "
                          "order by seq").fetchall()
    assert [(s, v, n) for s, v, n, _, _ in heldout] == [(0, 0, 2), (1, 1, 2)]  # before step 0, and the final policy
    step = con.execute("select * from train_steps").fetchone()
    columns = [d[0] for d in con.description]
    metrics = dict(zip(columns, step, strict=True))
    for name in ("tokens_trained", "tokens_padded", "tokens_per_s", "clip_fraction", "tis_truncated_fraction",
                 "log_ratio_mean", "log_ratio_max", "kl", "entropy", "response_tokens_mean", "reward_mean",
                 "reward_std", "advantage_std", "rollout_s", "batch_s", "forward_backward_s", "optimizer_s"):
        assert metrics[name] is not None, name
    assert metrics["samples"] == 3  # the group's executions only: held-out ones are never trained on
    assert 0 < metrics["tokens_trained"] <= metrics["tokens"] <= metrics["tokens_padded"]
    assert metrics["entropy"] > 0 and metrics["kl"] >= 0

    assert (run_dir / "report.html").stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
