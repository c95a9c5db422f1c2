"""The chaos benchmark, short: three seeds of a tiny 3-cell run, each with seeded kills and bursts (the 10-seed
x 30-kill table is `python -m benchmarks.chaos_bench --seeds 1-10 --kills 30 --bursts 0.3`, in
docs/benchmarks.md). Every run must complete every step with nothing lost or doubled and replay exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import chaos_bench as cb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = Path(__file__).parent / "tiny.toml"


def test_three_seeds_of_kills_and_bursts_lose_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cb.main(["--seeds", "1-3", "--kills", "2", "--steps", "3", "--bursts", "0.5", "--min-wait-s", "0.5",
                    "--max-wait-s", "1.5", "--max-events", "8", "--config", str(TINY), "--keep", str(tmp_path),
                    "--timeout-s", "600", "--stall-s", "240", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    total = out["total"]
    failed = {r["seed"]: r["problems"] for r in out["runs"] if not r["passed"]}
    assert code == 0 and out["passed"], failed
    assert total["runs_completed"] == 3 and total["kills"] == 6  # every kill the schedule drew was made
    assert all(r["steps_trained"] == 3 for r in out["runs"])
    assert (total["events_lost"], total["events_doubled"], total["rewards_lost"], total["rewards_doubled"],
            total["replay_mismatches"]) == (0, 0, 0, 0, 0)
