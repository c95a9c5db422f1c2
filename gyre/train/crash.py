"""Kill -9 torture of a training run: SIGKILL at seeded points, resume, and check that nothing was lost.

Each attempt runs in a child forked from the (warm: everything imported) parent; a child is killed with
SIGKILL by itself the moment its controller folds the chosen seq — wherever the other threads are (a
harness running, a micro-step, a publish, a checkpoint, the resume itself). The next child resumes the
log. The last one runs to the end. `check` then holds the run to its promises: every execution queued is
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

from gyre.log import LogReader
from gyre.train.config import TrainConfig


@dataclass
class CrashReport:
    kill_points: list[int] = field(default_factory=list)
    """Seqs at which a child was killed."""
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


def _child(config: TrainConfig, resume: bool, kill_at: int | None, notes: Path) -> None:
    """The body of a forked child: run or resume, SIGKILL itself at ``kill_at``; never returns."""
    code = 0

    def progress(phase: str, figures: dict) -> None:
        if phase == "resumed":  # told to the parent through a file: the child may die any moment after
            with open(notes, "a") as f:
                f.write(f"{figures['retrained_steps']}\n")

    try:
        from gyre.train.loop import TrainingRun

        run = TrainingRun(config, progress, resume=resume, kill_at=kill_at)
        run.run()
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        os._exit(code)


def warm(config: TrainConfig) -> None:
    """Import and build in the parent what every child needs (transformers imports lazily: ~10 s cold)."""
    import gyre.train.loop  # noqa: F401
    from gyre.engine.local import LocalEngineConfig
    from gyre.engine.local.engine import load_model

    load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))


def last_seq(log: Path) -> int:
    return LogReader(log).last_seq() if log.is_dir() and any(log.glob("*.seg")) else -1


def torture(config: TrainConfig, *, points: int, seed: int, max_gap: int = 12, children: int = 100) -> CrashReport:
    """Kill ``points`` children at seeded seqs, then let the last one finish.

    Points rise by 1..``max_gap`` from the previous point (or the log's end, if further): events past the
    last commit die with their process and their seqs are handed out again, so points taken from the log's
    end alone could keep killing the same early stretch of the run.
    """
    warm(config)
    rng = random.Random(seed)
    report = CrashReport()
    log = config.run_dir / "log"
    notes = config.run_dir.parent / f"{config.run_dir.name}.resumes"
    point = -1
    for _ in range(children):
        end = last_seq(log)
        kill_at = None
        if len(report.kill_points) < points:
            kill_at = point = max(point, end) + rng.randint(1, max_gap)
        pid = os.fork()
        if pid == 0:
            _child(config, resume=end >= 0, kill_at=kill_at, notes=notes)
        _, status = os.waitpid(pid, 0)
        report.resumes += end >= 0
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            report.kill_points.append(kill_at if kill_at is not None else -1)
            continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            if kill_at is not None:  # the run ended before reaching the point: count it as the last
                pass
            break
        report.problems.append(f"a child ended with status {status} (kill point {kill_at})")
        return report
    else:
        report.problems.append(f"the run did not finish within {children} children")
    if notes.exists():
        report.retrained = sum(int(line) for line in notes.read_text().split())
    check(config, report)
    return report


def check(config: TrainConfig, report: CrashReport) -> None:
    from gyre.replay.exact import replay_decisions

    log = config.run_dir / "log"
    con = LogReader(log).duckdb()
    expected = config.steps * config.rollout.groups_per_step * config.rollout.group_size
    (queued,) = con.execute("SELECT count(DISTINCT execution_id) FROM executions_queued").fetchone()
    report.executions = queued
    if queued != expected:
        report.problems.append(f"{queued} executions queued, the config asks for {expected}")
    doubled = con.execute("SELECT execution_id, count(*) FROM rewards GROUP BY 1 HAVING count(*) > 1").fetchall()
    if doubled:
        report.problems.append(f"rewarded more than once: {doubled[:3]}")
    (report.rewards,) = con.execute("SELECT count(*) FROM rewards").fetchone()
    lost = con.execute("""
        SELECT q.execution_id FROM (SELECT DISTINCT execution_id FROM executions_queued) q
        WHERE q.execution_id NOT IN (SELECT execution_id FROM rewards)
          AND q.execution_id NOT IN (SELECT execution_id FROM evaluation_failures)
          AND q.execution_id NOT IN (SELECT execution_id FROM executions_finished WHERE status = 'harness_error')
    """).fetchall()
    if lost:
        report.problems.append(f"executions never scored nor excluded: {lost[:3]}")
    (strays,) = con.execute("""
        SELECT count(*) FROM model_calls c
        JOIN (SELECT execution_id, max(attempt) AS last FROM executions_queued GROUP BY 1) q USING (execution_id)
        WHERE c.attempt > q.last""").fetchone()
    if strays:
        report.problems.append(f"{strays} model calls name an attempt that was never queued")
    versions = [v for (v,) in con.execute("SELECT policy_version FROM weights_published ORDER BY seq").fetchall()]
    report.versions = versions
    if versions != list(range(1, len(versions) + 1)):
        report.problems.append(f"published versions are not gapless and single: {versions}")
    steps = [s for (s,) in con.execute("SELECT step FROM train_steps ORDER BY seq").fetchall()]
    if steps != list(range(config.steps)):
        report.problems.append(f"train steps finished: {steps}, expected 0..{config.steps - 1} once each")
    (status,) = con.execute("SELECT status FROM runs_finished ORDER BY seq DESC LIMIT 1").fetchone() or (None,)
    if status != "completed":
        report.problems.append(f"the run finished as {status}")
    replay = replay_decisions(log)
    if replay.mismatches:
        report.problems.append(f"replay found {len(replay.mismatches)} mismatches")
