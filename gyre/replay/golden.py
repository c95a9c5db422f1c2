"""Shipped logs and their golden decision files: a policy change that alters decisions must say so.

``replay/logs/manifest.toml`` names each shipped log and how it was simulated; ``replay/golden/NAME.jsonl``
holds, one JSON object per line, every decision the current policy makes when replaying it. Tests replay
each log and fail when the decisions drift from the golden file (or from the log itself). To accept a
deliberate change, bump the policy's version and run ``python -m gyre.replay.golden --regenerate``.
"""

import argparse
import json
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.replay.exact import replay_decisions
from gyre.scheduler import get_policy
from gyre.sim.runner import policy_params, simulate
from gyre.sim.scenario import load_scenario

REPLAY_DIR = Path(__file__).resolve().parents[2] / "replay"
LOG_DIR = REPLAY_DIR / "logs"
GOLDEN_DIR = REPLAY_DIR / "golden"


@dataclass(frozen=True)
class ShippedLog:
    name: str
    scenario: str
    policy: str
    seed: int
    params: dict[str, Any] = field(default_factory=dict)
    version: str | None = None
    """The policy version that recorded it (default: the current one)."""

    @property
    def path(self) -> Path:
        return LOG_DIR / self.name

    @property
    def golden(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.jsonl"


def shipped_logs() -> list[ShippedLog]:
    manifest = tomllib.loads((LOG_DIR / "manifest.toml").read_text())
    return [ShippedLog(**entry) for entry in manifest["log"]]


def golden_decisions(log: str | Path) -> list[dict[str, Any]]:
    """The current policy's decisions on a log, as golden-file records."""
    report = replay_decisions(log)
    return [{"at_seq": seq, **decision} for seq, decision in report.replayed]


def read_golden(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_golden(path: Path, decisions: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(d, sort_keys=True) + "\n" for d in decisions))


def regenerate(log: ShippedLog) -> None:
    """Re-simulate a shipped log from its recipe and rewrite its golden file."""
    scenario = load_scenario(log.scenario)
    policy = get_policy(log.policy, log.version)
    if log.path.exists():
        shutil.rmtree(log.path)
    simulate(scenario, log.policy, seed=log.seed, log_dir=log.path,
             params=policy_params(scenario, policy, log.params), version=policy.version)
    (log.path / "LOCK").unlink(missing_ok=True)  # a writer's lock file: not part of the record
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    write_golden(log.golden, golden_decisions(log.path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regenerate", action="store_true", help="re-simulate shipped logs, rewrite golden files")
    parser.add_argument("--only", action="append", help="just this shipped log (repeatable)")
    args = parser.parse_args()
    for log in shipped_logs():
        if args.only and log.name not in args.only:
            continue
        if args.regenerate:
            regenerate(log)
            print(f"regenerated {log.path} and {log.golden}")
        else:
            drift = golden_decisions(log.path) != read_golden(log.golden)
            print(f"{log.name}: {'DRIFTED' if drift else 'ok'}")


if __name__ == "__main__":
    main()
