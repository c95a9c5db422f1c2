"""Kill -9 torture of a training run: SIGKILL at seeded points, resume, and check that nothing was lost.

Each attempt runs in a child forked from the (warm: everything imported) parent; a child is killed with
SIGKILL by itself the moment its controller folds the next event of a seeded kind — a model call, a
reward, a role switch, a micro-step claim or finish, a finished step, a publish, a checkpoint — wherever
the other threads are. The next child resumes the log. The last one runs to the end. Points are events of
the run's phases rather than seqs: a resume queues unscored executions again, so seq-based points kept
landing in the first step's rollouts. `check` then holds the run to its promises: every execution queued is
scored at most once (and every one is scored, excluded by its evaluator, or ended by its harness), train
steps and published versions are gapless, and exact replay finds no mismatch.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.config import TrainConfig
from gyre.log import LogReader

if TYPE_CHECKING:
    from gyre.train.inprocess import KillPoint


@dataclass
class CrashReport:
    kill_points: list[tuple[str, int]] = field(default_factory=list)
    """(kind, n): a child was killed on folding the log's n-th event of that kind."""
    resumes: int = 0
    problems: list[str] = field(default_factory=list)
    executions: int = 0
    rewards: int = 0
    versions: list[int] = field(default_factory=list)
    retrained: int = 0
    """Steps resumes retrained from their logged batches (their weights matched the logged checksums)."""

    @property
    def ok(self) -> bool:
        return not self.problems


def run_child(config: TrainConfig, resume: bool, kill_at: KillPoint | None, notes: Path) -> None:
    """The body of a forked child: run or resume, SIGKILL itself at ``kill_at``; never returns."""
    code = 0

    def progress(phase: str, figures: dict) -> None:
        if phase == "resumed":  # told to the parent through a file: the child may die any moment after
            with open(notes, "a") as f:
                f.write(f"{figures['retrained_steps']}\n")

    try:
        from gyre.train.inprocess import TrainingRun

        run = TrainingRun(config, progress, resume=resume, kill_at=kill_at)
        run.run()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        os._exit(code)


def warm(config: TrainConfig) -> None:
    """Import and build in the parent what every child needs (transformers imports lazily: ~10 s cold)."""
    import gyre.train.inprocess  # noqa: F401
    from gyre.engine.local import LocalEngineConfig
    from gyre.engine.local.engine import load_model

    load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))


def phases(config: TrainConfig) -> dict[str, int]:
    """Kinds to kill on, with how many the whole run logs at least (a resume adds more of some)."""
    executions = config.steps * config.rollout.groups_per_step * config.rollout.group_size
    return {"execution_started": executions, "model_call_started": executions, "model_call_finished": executions,
            "execution_finished": executions, "reward_recorded": executions,
            "role_switch_completed": 2 * config.steps - 1, "micro_step_claimed": config.steps,
            "micro_step_finished": config.steps, "train_step_finished": config.steps,
            "weights_published": config.steps, "checkpoint_saved": config.steps // config.checkpoint.every_steps}


FIRST_POINTS = ("reward_recorded", "micro_step_claimed", "weights_published")
"""Kinds of the first kill points: during rollout, mid-step, during publish (all reached within step 0)."""


def torture(config: TrainConfig, *, points: int, seed: int, children: int = 200) -> CrashReport:
    """Kill ``points`` children at seeded phase events, then let the last one finish.

    Each point is the next not-yet-logged occurrence of a kind drawn from `phases` (those the run still has
    to log, weighted by how many are left), so every child gets past what the log holds before it dies.
    """
    warm(config)
    rng = random.Random(seed)
    report = CrashReport()
    log = config.run_dir / "log"
    notes = config.run_dir.parent / f"{config.run_dir.name}.resumes"
    tour = list(FIRST_POINTS)
    for _ in range(children):
        logged = logged_kinds(log)
        kill_at = None
        if len(report.kill_points) < points:
            remaining = {k: total - logged.get(k, 0) for k, total in sorted(phases(config).items())
                         if logged.get(k, 0) < total}
            first_round = [k for k in tour if k in remaining and k not in {p[0] for p in report.kill_points}]
            unscored = phases(config)["reward_recorded"] - logged.get("reward_recorded", 0)
            if unscored and logged:  # a resume queues every unscored execution again: a kill during the resume
                remaining["execution_queued"] = unscored
            kind = None
            if first_round:  # a rollout, a mid-step and a publish point first, whatever the timing
                kind = first_round[0]
            elif remaining:  # then frequent kinds more often, so points spread over the whole run
                kind = rng.choices(list(remaining), weights=list(remaining.values()))[0]
            if kind is not None:
                kill_at = (kind, logged.get(kind, 0) + 1)
        resume = bool(logged)
        pid = os.fork()
        if pid == 0:
            run_child(config, resume=resume, kill_at=kill_at, notes=notes)
        _, status = os.waitpid(pid, 0)
        report.resumes += resume
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and kill_at is not None:
            report.kill_points.append(kill_at)
            continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            break
        report.problems.append(f"a child ended with status {status} (kill point {kill_at})")
        return report
    else:
        report.problems.append(f"the run did not finish within {children} children")
    if notes.exists():
        report.retrained = sum(int(line) for line in notes.read_text().split())
    check(config, report)
    return report


def logged_kinds(log: Path) -> dict[str, int]:
    """Events per kind the log holds (empty: no log yet)."""
    if not (log.is_dir() and any(log.glob("*.seg"))):
        return {}
    return dict(LogReader(log).duckdb().execute("SELECT kind, count(*) FROM events GROUP BY kind").fetchall())


def check(config: TrainConfig, report: CrashReport) -> None:
    """The run's promises: the config's executions queued, then `gyre.audit`'s rules (no event lost or
    doubled, every execution scored at most once and every trained one scored or excluded, no stray attempt,
    steps and versions gapless, the run completed) and exact replay."""
    from gyre.audit import audit

    log = config.run_dir / "log"
    con = LogReader(log).duckdb()
    expected = config.steps * config.rollout.groups_per_step * config.rollout.group_size
    (queued,) = con.execute("SELECT count(DISTINCT execution_id) FROM executions_queued").fetchone()
    report.executions = queued
    if queued != expected:
        report.problems.append(f"{queued} executions queued, the config asks for {expected}")
    audited = audit(log, expected_steps=config.steps, replay=True)
    report.rewards, report.versions = audited.rewards, audited.versions
    report.problems += audited.problems
