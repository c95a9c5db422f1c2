"""Audit a finished run's log: did every process's events reach it, and was every trained execution scored once?

A pure function of the run directory (the log, and leftover spill files beside it): `audit(log)` returns an
`AuditReport` whose ``problems`` name each violation (the producer and its missing numbers, the execution and
its attempt); it is what the chaos benchmark (`benchmarks/chaos_bench.py`) and `gyre log audit RUN_LOG`
(`gyre.audit.cli`) hold a run to after its processes were killed at random. The rules:

- **events lost** — every producer's ``producer_seq`` values are gapless from 0 and unique. A producer that
  restarts as a new process continues its numbering from what the log holds, so a gap is an event a process
  counted as recorded that the log never got, and a repeat is an event the writer took twice. Events left in
  ``<run_dir>/spill/`` at the end (never handed over) are lost too. The log's own seq chain and checksums
  are `LogReader.verify`'s.
- **rewards lost or doubled** — an outcome (``reward_recorded``, or ``evaluation_failed``: excluded, never a
  zero reward) belongs to the latest attempt queued before it. No outcome may precede its execution's first
  ``execution_queued``; no attempt has two outcomes; an execution has at most one ``reward_recorded``; the
  last attempt of every execution of a trained step has its outcome (or ended in ``harness_error``, which the
  trainer excludes). Attempts of an execution are queued 0, 1, 2, ... (a new attempt after a crash is fine);
  no model call names an attempt that was never queued.
- **training** — train steps finished gapless from 0, each once (and ``expected_steps`` of them when given);
  published weight versions gapless from 1, each once; the run finished ``completed`` (``require_finished``).
- **versions** — every model call with output reports the weights version its engine served it with (``engine_version``;
  ``require_versions``), that version is at least the one its execution's attempt was queued with (no call
  on stale weights), and a trained call lags the version that trains it (step ``s`` trains from version
  ``s``) by at most the run's ``scheduler.staleness`` — with partial rollouts by at most one more, counted
  as the simulator counts it: a group is trained by the step the scheduler's fold assigns it (a carried
  group by a later step than its batch's), and a call's version is the oldest that produced its tokens.

Counted, not judged: executions cut (partial rollouts: the same attempt queued again before its outcome, as
the simulator and the cluster's proxy record a cut), micro-steps redone (claims of a micro-step already
claimed, releases), steps aborted or started again, role switches, cells lost and registered again, commands
abandoned, controller restarts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, Field

from gyre.events.models import EVENT_TYPES
from gyre.log.reader import LogReader
from gyre.log.spill import SUFFIX, spilled_stamps
from gyre.replay.exact import replay_decisions

SPILL_DIR = "spill"
"""Where processes keep events they could not hand over yet: ``<run_dir>/spill/`` beside ``<run_dir>/log``."""

RESUME_KINDS = ("run_resumed",)
"""Kinds a resumed controller records (counted as controller restarts when the vocabulary has one)."""

MAX_NAMED = 20
"""Problems of one rule named one by one; past that, a count."""


class ProducerAudit(BaseModel):
    producer: str
    events: int
    last_seq: int = Field(description="highest producer_seq the log holds")
    missing: int = Field(0, description="producer_seq values below last_seq the log never got")
    repeated: int = Field(0, description="events the log holds more than once (same producer_seq)")


class AuditReport(BaseModel):
    log: str
    events: int = 0
    last_seq: int | None = None
    # -- events --
    producers: list[ProducerAudit] = Field(default_factory=list)
    events_lost: int = Field(0, description="producer_seq gaps plus events left in spill files")
    events_doubled: int = 0
    spill_files: int = Field(0, description="spill files left under <run_dir>/spill at the end")
    spill_events: int | None = Field(None, description="events in them, when gyre.log.spill can read them")
    quarantined: int = Field(0, description="torn tails earlier recoveries moved aside (never acknowledged)")
    # -- executions and rewards --
    executions: int = 0
    attempts: int = Field(0, description="execution_queued events (first attempts and re-queues)")
    requeued: int = Field(0, description="executions queued more than once (a crash, a lost cell)")
    completions: int = Field(0, description="executions whose last attempt finished 'completed'")
    rewards: int = 0
    evaluation_failures: int = 0
    harness_errors: int = 0
    rewards_lost: int = Field(0, description="last attempts of trained steps' executions with no outcome")
    rewards_doubled: int = Field(0, description="outcomes beyond the first of an attempt or an execution")
    rewards_unqueued: int = Field(0, description="outcomes before their execution was ever queued")
    # -- versions --
    calls_versioned: int = Field(0, description="model calls whose engine reported the version serving them")
    calls_unversioned: int = Field(0, description="model calls with output whose engine reported no version")
    calls_unserved: int = Field(0, description="model calls that ended with no output token (no version served them)")
    calls_stale: int = Field(0, description="calls served by weights older than their execution was queued with")
    calls_overlagged: int = Field(0, description="trained calls lagging their step's weights by over the staleness")
    max_version_lag: int | None = Field(None, description="the most a trained call lagged its step's weights")
    # -- training --
    steps_trained: int = 0
    versions: list[int] = Field(default_factory=list)
    micro_steps: int = Field(0, description="distinct (step, micro_step) claimed")
    micro_steps_claimed: int = 0
    micro_steps_released: int = 0
    micro_steps_redone: int = Field(0, description="claims of a micro-step already claimed before")
    executions_cut: int = Field(0, description="partial rollouts: an attempt queued again while it ran (cut, "
                                               "to continue where it is placed next)")
    steps_aborted: int = 0
    steps_restarted: int = Field(0, description="train_step_started for a step already started")
    # -- cluster --
    role_switches: int = 0
    cells_lost: int = 0
    cells_registered: int = 0
    cells_reregistered: int = Field(0, description="cell_registered for a cell already registered")
    commands_abandoned: int = Field(0, description="commands given up on after transient failures")
    controller_restarts: int | None = Field(
        None, description="resume events the log holds; None when the vocabulary has no resume kind")
    quiet_gaps: int = Field(0, description="pauses of at least quiet_gap_s with no event at all (each "
                                           "controller restart leaves one: it is the only writer)")
    run_status: str | None = None
    replay_mismatches: int | None = None
    problems: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit(log: str | Path, *, expected_steps: int | None = None, require_finished: bool = True,
          spill_dir: str | Path | None = None, quiet_gap_s: float = 3.0, replay: bool = False,
          require_versions: bool = True) -> AuditReport:
    """Audit the log at ``log`` (a run's ``<run_dir>/log``); spill files are looked for in ``spill_dir``
    (default ``<run_dir>/spill``). ``require_versions=False``: calls may lack the served version (logs of the
    simulator, or written before engines reported it); those that carry one are still checked."""
    log = Path(log)
    reader = LogReader(log)
    report = AuditReport(log=str(log))
    verified = reader.verify()
    report.events, report.last_seq, report.quarantined = verified.events, verified.last_seq, len(verified.quarantined)
    report.problems += [f"log: {p}" for p in verified.problems]
    if verified.tail_verdict is not None:
        report.problems.append(f"log: a {verified.tail_verdict} tail of {verified.torn_tail_bytes} bytes at byte "
                               f"{verified.tail_offset} of {verified.tail_segment}: {verified.tail_reason}")
    con = reader.duckdb()
    _producers(con, report)
    _spill(Path(spill_dir) if spill_dir is not None else log.parent / SPILL_DIR, report, con)
    _rewards(con, report)
    _training(con, report, expected_steps, require_finished)
    _versions(con, report, require_versions, log)
    _cluster(con, report, quiet_gap_s)
    if replay:
        result = replay_decisions(log)
        report.replay_mismatches = len(result.mismatches)
        if result.mismatches:
            report.problems.append(f"replay: {len(result.mismatches)} decisions differ from the recorded ones")
    return report


def _add(report: AuditReport, rule: str, problems: list[str]) -> None:
    report.problems += problems[:MAX_NAMED]
    if len(problems) > MAX_NAMED:
        report.problems.append(f"{rule}: {len(problems) - MAX_NAMED} more like these")


def _ranges(numbers: list[int]) -> str:
    spans, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            spans.append(str(start) if start == n else f"{start}..{n}")
            start = None
    return ", ".join(spans[:8]) + (f" (+{len(spans) - 8} more ranges)" if len(spans) > 8 else "")


# -- events lost --------------------------------------------------------------------------------------------


def _producers(con, report: AuditReport) -> None:
    (unnumbered,) = con.execute("SELECT count(*) FROM events WHERE producer IS NOT NULL AND producer_seq IS NULL"
                                ).fetchone()
    if unnumbered:
        report.problems.append(f"events: {unnumbered} events name a producer but carry no producer_seq")
    rows = con.execute("""
        SELECT producer, count(*), count(DISTINCT producer_seq), max(producer_seq) FROM events
        WHERE producer IS NOT NULL AND producer_seq IS NOT NULL GROUP BY producer ORDER BY producer""").fetchall()
    gaps = defaultdict(list)
    for producer, first, last in con.execute("""
            SELECT producer, coalesce(prev, -1) + 1, producer_seq - 1 FROM (
                SELECT producer, producer_seq, lag(producer_seq) OVER (PARTITION BY producer ORDER BY producer_seq)
                    AS prev FROM (SELECT DISTINCT producer, producer_seq FROM events
                                  WHERE producer IS NOT NULL AND producer_seq IS NOT NULL))
            WHERE producer_seq > coalesce(prev, -1) + 1 ORDER BY producer, producer_seq""").fetchall():
        gaps[producer].extend(range(first, last + 1))
    repeats = con.execute("""
        SELECT producer, producer_seq, list(kind ORDER BY seq), list(seq ORDER BY seq) FROM events
        WHERE producer IS NOT NULL AND producer_seq IS NOT NULL GROUP BY producer, producer_seq
        HAVING count(*) > 1 ORDER BY producer, producer_seq""").fetchall()
    problems = []
    for producer, events, distinct, last in rows:
        missing = gaps.get(producer, [])
        report.producers.append(ProducerAudit(producer=producer, events=events, last_seq=last,
                                              missing=len(missing), repeated=events - distinct))
        if missing:
            problems.append(f"events lost: producer {producer!r} has no events numbered {_ranges(missing)} "
                            f"(it numbered up to {last})")
        report.events_lost += len(missing)
        report.events_doubled += events - distinct
    for producer, number, kinds, seqs in repeats:
        problems.append(f"events doubled: producer {producer!r} event {number} ({kinds[0]}) is in the log "
                        f"{len(seqs)} times, at seq {', '.join(map(str, seqs))}")
    _add(report, "events", problems)


def _spill(directory: Path, report: AuditReport, con) -> None:
    """Spill segments left at the end: the events in them the log lacks were never handed over (lost); a
    damaged segment counts as one lost event, since its content cannot be told."""
    if not directory.is_dir():
        return
    files = sorted(directory.rglob(f"*{SUFFIX}"))
    report.spill_files = len(files)
    if not files:
        return
    held = set(con.execute("SELECT DISTINCT producer, producer_seq FROM events WHERE producer IS NOT NULL").fetchall())
    lost = counted = 0
    for path in files:
        try:
            stamps = spilled_stamps(path)
        except Exception:  # undecodable: its events cannot be matched
            lost += 1
            continue
        counted += len(stamps)
        lost += sum(1 for stamp in stamps if stamp not in held)
    report.spill_events = counted
    report.events_lost += lost
    if lost:
        report.problems.append(f"events lost: {lost} events in {len(files)} spill segment(s) under {directory} are "
                               f"not in the log (never handed over): {', '.join(p.name for p in files[:5])}")


# -- rewards ------------------------------------------------------------------------------------------------


def _rewards(con, report: AuditReport) -> None:
    """Walk each execution's queued / outcome / finished events in seq order (see the module doc)."""
    timeline: dict[str, list[tuple[int, str, object]]] = defaultdict(list)
    for seq, execution_id, attempt, step in con.execute(
            "SELECT seq, execution_id, attempt, step FROM executions_queued").fetchall():
        timeline[execution_id].append((seq, "queued", (attempt, step)))
    for seq, execution_id in con.execute("SELECT seq, execution_id FROM rewards").fetchall():
        timeline[execution_id].append((seq, "reward", None))
    for seq, execution_id in con.execute("SELECT seq, execution_id FROM evaluation_failures").fetchall():
        timeline[execution_id].append((seq, "evaluation_failed", None))
    for seq, execution_id, status in con.execute(
            "SELECT seq, execution_id, status FROM executions_finished").fetchall():
        timeline[execution_id].append((seq, "finished", status))
    trained = {step: seq for step, seq in con.execute("SELECT step, min(seq) FROM train_steps GROUP BY step")
               .fetchall()}
    problems: list[str] = []
    last_attempt: dict[str, int] = {}
    for execution_id in sorted(timeline):
        attempts: list[dict] = []
        for seq, what, data in sorted(timeline[execution_id], key=lambda item: item[0]):
            if what == "queued":
                attempt, step = data
                last = attempts[-1] if attempts else None
                if (last is not None and attempt == last["attempt"] and step == last["step"] and not last["outcomes"]
                        and last["status"] is None):
                    report.executions_cut += 1  # the same attempt queued again while it ran: a cut (partial rollouts)
                    continue
                expected = attempts[-1]["attempt"] + 1 if attempts else 0
                if attempt != expected:
                    problems.append(f"attempts: execution {execution_id} queued as attempt {attempt} at seq {seq}, "
                                    f"expected attempt {expected}")
                if attempts and step in trained and trained[step] < seq:
                    problems.append(f"attempts: execution {execution_id} queued again (attempt {attempt}, seq {seq})"
                                    f" after its step {step} was trained (seq {trained[step]})")
                attempts.append({"attempt": attempt, "step": step, "seq": seq, "outcomes": [], "status": None})
                report.attempts += 1
            elif what == "finished":
                if attempts:
                    attempts[-1]["status"] = data
            else:
                report.rewards += what == "reward"
                report.evaluation_failures += what == "evaluation_failed"
                if attempts:
                    attempts[-1]["outcomes"].append((seq, what))
                else:
                    report.rewards_unqueued += 1
                    problems.append(f"rewards unqueued: {what} for execution {execution_id} at seq {seq} precedes "
                                    f"any execution_queued of it")
        if not attempts:
            continue
        rewarded = []  # (attempt, seq) of the first reward of each attempt that has one
        for item in attempts:
            outcomes = item["outcomes"]
            for seq, what in outcomes[1:]:
                report.rewards_doubled += 1
                problems.append(f"rewards doubled: execution {execution_id} attempt {item['attempt']} has a second "
                                f"outcome ({what} at seq {seq}; the first: {outcomes[0][1]} at seq "
                                f"{outcomes[0][0]})")
            rewards = [seq for seq, what in outcomes if what == "reward"]
            if rewards:
                rewarded.append((item["attempt"], rewards[0]))
        for attempt, seq in rewarded[1:]:
            report.rewards_doubled += 1
            problems.append(f"rewards doubled: execution {execution_id} rewarded again for attempt {attempt} (seq "
                            f"{seq}) after attempt {rewarded[0][0]} was rewarded (seq {rewarded[0][1]})")
        report.executions += 1
        report.requeued += len(attempts) > 1
        last = attempts[-1]
        last_attempt[execution_id] = last["attempt"]
        report.completions += last["status"] == "completed"
        report.harness_errors += last["status"] == "harness_error"
        if last["step"] in trained and not last["outcomes"] and last["status"] != "harness_error":
            report.rewards_lost += 1
            problems.append(f"rewards lost: execution {execution_id} (step {last['step']}, trained) has no "
                            f"reward_recorded or evaluation_failed for its last attempt {last['attempt']} "
                            f"(queued at seq {last['seq']}, finished: {last['status'] or 'never'})")
    strays = [(e, a) for e, a in con.execute("SELECT execution_id, max(attempt) FROM model_calls GROUP BY 1")
              .fetchall() if e in last_attempt and a > last_attempt[e]]
    problems += [f"attempts: execution {e} has model calls of attempt {a}, never queued (last queued: "
                 f"{last_attempt[e]})" for e, a in strays]
    _add(report, "rewards", problems)


# -- training -----------------------------------------------------------------------------------------------


def gapless(values: list[int], start: int) -> bool:
    """``values`` (in log order) are start, start + 1, ... once each."""
    return values == list(range(start, start + len(values)))


def _training(con, report: AuditReport, expected_steps: int | None, require_finished: bool) -> None:
    steps = [s for (s,) in con.execute("SELECT step FROM train_steps ORDER BY seq").fetchall()]
    report.steps_trained = len(set(steps))
    if not gapless(steps, 0):
        report.problems.append(f"training: train steps finished {_short(steps)} (in log order), expected 0, 1, ... "
                               f"once each")
    if expected_steps is not None and len(set(steps)) != expected_steps:
        report.problems.append(f"training: {len(set(steps))} steps trained, the run asks for {expected_steps}")
    report.versions = [v for (v,) in con.execute("SELECT policy_version FROM weights_published ORDER BY seq")
                       .fetchall()]
    if not gapless(report.versions, 1):
        report.problems.append(f"training: published versions {_short(report.versions)} are not 1, 2, ... once each")
    claimed, distinct = con.execute(
        "SELECT count(*), count(DISTINCT (step, micro_step)) FROM micro_step_claims").fetchone()
    report.micro_steps_claimed, report.micro_steps = claimed, distinct
    report.micro_steps_redone = claimed - distinct
    (report.micro_steps_released,) = con.execute("SELECT count(*) FROM micro_steps_released").fetchone()
    (report.steps_aborted,) = con.execute("SELECT count(*) FROM train_steps_aborted").fetchone()
    (report.steps_restarted,) = con.execute(
        "SELECT count(*) - count(DISTINCT step) FROM train_steps_started").fetchone()
    row = con.execute("SELECT status FROM runs_finished ORDER BY seq DESC LIMIT 1").fetchone()
    report.run_status = row[0] if row else None
    if require_finished and report.run_status != "completed":
        report.problems.append(f"run: finished as {report.run_status or 'never (no run_finished)'}, not completed")


def _versions(con, report: AuditReport, require_versions: bool, log: Path) -> None:
    """Each call against its attempt's queued version and, when its step was trained, that step's weights."""
    columns = {c for (c,) in con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'model_calls'").fetchall()}
    if "engine_version" not in columns:  # no call in the log carries the field (a log older than it)
        report.calls_unversioned = con.execute("SELECT count(*) FROM model_calls").fetchone()[0]
        if require_versions and report.calls_unversioned:
            report.problems.append(f"versions: none of the {report.calls_unversioned} model calls reports the "
                                   f"version its engine served it with")
        return
    staleness, partial = _run_params(con)
    trained_by = _partial_steps(log) if partial else None
    trains_from = dict(con.execute(
        "SELECT step, arg_min(policy_version, seq) - 1 FROM train_steps GROUP BY step").fetchall())
    allowed = staleness + (1 if partial else 0)  # a carried group is due one step later, never more
    rows = con.execute("""
        WITH queued AS (SELECT execution_id, attempt, arg_min(policy_version, seq) AS queued_version,
                               any_value(step) AS step, any_value(group_id) AS group_id
                        FROM executions_queued GROUP BY ALL)
        SELECT c.execution_id, c.call_id, c.attempt, c.cell_id, c.engine_version, q.queued_version, q.step,
               q.group_id, len(c.output_ids) AS produced
        FROM model_calls c LEFT JOIN queued q USING (execution_id, attempt)
        ORDER BY c.seq""").fetchall()
    problems: list[str] = []
    for execution_id, call_id, attempt, cell_id, served, queued_version, batch, group, produced in rows:
        if served is None and not produced:
            report.calls_unserved += 1  # ended before any engine produced a token (aborted): no version served it
            continue
        if served is None:
            report.calls_unversioned += 1
            if require_versions:
                problems.append(f"versions: call {call_id} of execution {execution_id} (on {cell_id}) does not "
                                f"report the version its engine served it with")
            continue
        report.calls_versioned += 1
        if queued_version is not None and served < queued_version:
            report.calls_stale += 1
            problems.append(f"versions: call {call_id} of execution {execution_id} attempt {attempt} ran on "
                            f"{cell_id} with weights v{served}, older than the v{queued_version} it was queued with")
        step = batch if trained_by is None else trained_by.get(group)
        if step in trains_from:
            lag = trains_from[step] - served
            report.max_version_lag = lag if report.max_version_lag is None else max(report.max_version_lag, lag)
            if lag > allowed:
                report.calls_overlagged += 1
                problems.append(f"versions: call {call_id} of execution {execution_id} (v{served}) was trained at "
                                f"step {step} from v{trains_from[step]}: {lag} versions behind, over the run's "
                                f"staleness {staleness}" + (" + 1 (partial rollouts)" if partial else ""))
    _add(report, "versions", problems)


def _run_params(con) -> tuple[int, bool]:
    """The run's staleness (its config's, else its policy's) and whether its policy uses partial rollouts."""
    row = con.execute("SELECT json_extract(config, '$.scheduler.staleness'), policy_params FROM runs_started "
                      "ORDER BY seq LIMIT 1").fetchone()
    if row is None:
        return 0, False
    try:
        params = json.loads(row[1] or "{}")
    except json.JSONDecodeError:
        params = {}
    staleness = row[0] if row[0] is not None else params.get("staleness")
    return int(staleness or 0), bool(params.get("partial_rollouts"))


def _partial_steps(log: Path) -> dict[str, int]:
    """Partial rollouts: group -> the step that trained it, as the scheduler's fold assigns groups to steps
    (`WorkState.assigned`: the one rule the simulator, the controller and this audit read)."""
    from gyre.scheduler import SchedulerFold

    fold = SchedulerFold()
    for event in LogReader(log).events():
        fold.apply(event)
    return {group: step for step, groups in fold.view.work.assigned.items() for group in groups}


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 30 else f"{values[:30]}... ({len(values)} in all)"


# -- cluster ------------------------------------------------------------------------------------------------


def _cluster(con, report: AuditReport, quiet_gap_s: float) -> None:
    (report.role_switches,) = con.execute("SELECT count(*) FROM role_switches").fetchone()
    (report.cells_lost,) = con.execute("SELECT count(*) FROM cells_lost").fetchone()
    report.cells_registered, distinct = con.execute(
        "SELECT count(*), count(DISTINCT cell_id) FROM cells").fetchone()
    report.cells_reregistered = report.cells_registered - distinct
    (report.commands_abandoned,) = con.execute(
        "SELECT count(*) FROM events WHERE kind = 'command_abandoned'").fetchone()
    kinds = [kind for kind in RESUME_KINDS if kind in EVENT_TYPES]
    if kinds:
        (report.controller_restarts,) = con.execute(
            f"SELECT count(*) FROM events WHERE kind IN ({', '.join(repr(k) for k in kinds)})").fetchone()
    report.quiet_gaps = len(quiet_gaps(con, quiet_gap_s))


def quiet_gaps(con, seconds: float) -> list[tuple[int, datetime, datetime]]:
    """(seq after the pause, last ts before it, ts after it) for each pause of at least ``seconds``."""
    return con.execute(f"""
        SELECT seq, prev, ts FROM (SELECT seq, ts, lag(ts) OVER (ORDER BY seq) AS prev FROM events)
        WHERE prev IS NOT NULL AND epoch(ts) - epoch(prev) >= {float(seconds)} ORDER BY seq""").fetchall()
