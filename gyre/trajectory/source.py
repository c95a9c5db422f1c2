"""Reading groups from the log with DuckDB: a small outcome query, then one streamed scan of the calls.

The outcome query (one row per execution) says which groups are complete and how many calls each
execution has. The calls are then streamed once in storage order (which is seq order); each batch's rows
are copied out per execution as compact fragments (the one copy of every token) and the batch is let go.
A group is handed on the moment the last call of its last member has arrived, and its memory is released
once the builder is done with it. Calls of executions that will not be trained (evaluation errors,
pending groups) are never kept.
"""

import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from gyre.events.models import EVENT_TYPES
from gyre.log import LogReader
from gyre.trajectory.calls import CALL_COLUMNS, CallFragment, ExecutionCalls
from gyre.trajectory.errors import TrajectoryError
from gyre.trajectory.groups import Group, Member
from gyre.trajectory.rewards import ExecutionOutcome

OUTCOMES_SQL = """
WITH
ids AS (
    SELECT execution_id FROM executions_queued WHERE {scope}
    UNION SELECT execution_id FROM executions_finished WHERE {scope}
    UNION SELECT execution_id FROM rewards WHERE {scope}
    UNION SELECT execution_id FROM evaluation_failures WHERE {scope}
    UNION SELECT execution_id FROM model_calls WHERE {scope}),
queued AS (
    SELECT execution_id, task_id, group_id, seq AS queued_seq FROM executions_queued WHERE {scope}
    QUALIFY row_number() OVER (PARTITION BY execution_id ORDER BY seq DESC) = 1),
finished AS (
    SELECT execution_id, status FROM executions_finished WHERE {scope}
    QUALIFY row_number() OVER (PARTITION BY execution_id ORDER BY seq DESC) = 1),
evaluation AS (
    SELECT execution_id, reward, partial, error FROM (
        SELECT execution_id, seq, reward, partial, NULL::VARCHAR AS error FROM rewards WHERE {scope}
        UNION ALL
        SELECT execution_id, seq, NULL::DOUBLE, NULL::BOOLEAN, error FROM evaluation_failures WHERE {scope})
    QUALIFY row_number() OVER (PARTITION BY execution_id ORDER BY seq DESC) = 1),
calls AS (
    SELECT execution_id, count(*) AS calls FROM model_calls LEFT JOIN queued USING (execution_id)
    WHERE {scope} AND seq > coalesce(queued.queued_seq, -1)
    GROUP BY execution_id)
SELECT ids.execution_id, queued.group_id, queued.task_id, finished.status, evaluation.reward,
       coalesce(evaluation.partial, false) AS partial, evaluation.error, coalesce(calls.calls, 0) AS calls
FROM ids
LEFT JOIN queued USING (execution_id)
LEFT JOIN finished USING (execution_id)
LEFT JOIN evaluation USING (execution_id)
LEFT JOIN calls USING (execution_id)
ORDER BY queued.queued_seq NULLS LAST, ids.execution_id
"""

CALLS_SQL = "SELECT execution_id, " + ", ".join(CALL_COLUMNS) + " FROM model_calls"

RETRIED_SQL = """
SELECT execution_id, max(seq) FROM executions_queued WHERE {scope} GROUP BY execution_id HAVING count(*) > 1
"""
"""Executions queued more than once (a new attempt after a crash): only calls after the last queueing count."""

COMPLETED_SQL = """
WITH
queued AS (SELECT execution_id, group_id, max(seq) AS queued_seq FROM executions_queued WHERE {scope}
           GROUP BY execution_id, group_id),
done AS (
    SELECT execution_id, seq FROM rewards WHERE {scope}
    UNION ALL SELECT execution_id, seq FROM evaluation_failures WHERE {scope}
    UNION ALL SELECT execution_id, seq FROM executions_finished WHERE {scope} AND status = 'harness_error'),
members AS (
    SELECT queued.group_id, queued.execution_id, min(done.seq) AS done_seq FROM queued
    LEFT JOIN done ON done.execution_id = queued.execution_id AND done.seq > queued.queued_seq
    GROUP BY queued.group_id, queued.execution_id)
SELECT group_id FROM members GROUP BY group_id HAVING count(done_seq) = count(*) ORDER BY max(done_seq), group_id
"""
"""Groups whose every member is done (scored, evaluation failed, harness error), in the order the log
completed them: the scheduler's work projection (`gyre.scheduler.view`) completes groups by the same rule."""

STREAM_ROWS = 4096


class LogSource:
    """Groups of a log, as of the moment it is opened (a DuckDB snapshot of the log's views)."""

    def __init__(self, path: str | Path, con: duckdb.DuckDBPyConnection | None = None, threads: int = 1,
                 run_id: str | None = None) -> None:
        """Open ``path`` (or use ``con``, a connection with the log's views, as it is).

        With ``run_id``, every query sees only that run's events (a run directory may hold a resumed run's
        log; analysis may combine logs).

        A connection opened here scans with ``threads`` DuckDB threads. One is the default: each scan thread
        keeps its own decode buffers (about 100 MB more peak per extra thread on a 43M-token log), and on
        two cores a second scan thread bought no speed, because the builder needs the other core.
        """
        self.path = Path(path)
        if con is None:
            con = LogReader(self.path).duckdb()
            con.execute(f"SET threads = {int(threads)}")
        self.con = con
        self.run_id = run_id

    def _scope(self, group_ids: Iterable[str] | None) -> str:
        """The predicate every query applies: the run, and the executions queued into ``group_ids``."""
        terms = []
        if self.run_id is not None:
            terms.append(f"run_id = {_literal(self.run_id)}")
        if group_ids is not None:  # resolved to literal ids, so the filter is pushed into every scan
            groups = ", ".join(_literal(g) for g in group_ids) or "NULL"
            run = f"run_id = {_literal(self.run_id)} AND " if self.run_id is not None else ""
            ids = [row[0] for row in self.con.execute(
                f"SELECT DISTINCT execution_id FROM executions_queued WHERE {run}group_id IN ({groups})").fetchall()]
            terms.append(f"execution_id IN ({', '.join(_literal(e) for e in ids) or 'NULL'})")
        return " AND ".join(terms) or "TRUE"

    def outcomes(self, group_ids: Iterable[str] | None = None) -> list[ExecutionOutcome]:
        """One outcome per execution the log mentions (or of ``group_ids``), in the order they were queued."""
        table = self.con.sql(OUTCOMES_SQL.format(scope=self._scope(group_ids))).to_arrow_table()
        return [
            ExecutionOutcome(
                execution_id=row["execution_id"],
                group_id=row["group_id"],
                task_id=row["task_id"],
                status=row["status"],
                reward=row["reward"],
                partial=bool(row["partial"]),
                eval_error=row["error"],
                calls=int(row["calls"]),
            )
            for row in table.to_pylist()
        ]

    def completed(self, group_ids: Iterable[str]) -> list[str]:
        """Those of ``group_ids`` whose every member is done, in the order they completed (`COMPLETED_SQL`)."""
        return [row[0] for row in self.con.execute(COMPLETED_SQL.format(scope=self._scope(group_ids))).fetchall()]

    def execution_calls(self, execution_id: str) -> pa.Table:
        """The ``model_calls`` rows of one execution (for ``show``; a full scan of the calls)."""
        return self.con.sql(CALLS_SQL + f" WHERE execution_id = ? AND {self._scope(None)}",
                            params=[execution_id]).to_arrow_table()

    def groups(self, group_ids: Iterable[str] | None = None) -> Iterator[Group]:
        """Every group (or those of ``group_ids``, with the predicate pushed into every query): those that
        need no calls first, then the rest as their calls complete in the scan."""
        scope = self._scope(group_ids)
        members: dict[str | None, list[ExecutionOutcome]] = defaultdict(list)
        for outcome in self.outcomes(group_ids):
            members[outcome.group_id].append(outcome)
        waiting: dict[str, set[str]] = {}
        wanted: dict[str, str] = {}
        for group_id, outcomes in members.items():
            group = Group(group_id, tuple(Member(o) for o in outcomes))
            need = {o.execution_id for o in outcomes if o.verdict == "scored" and o.calls > 0}
            if group_id is None or group.pending or not need:
                yield group
                continue
            waiting[group_id] = need
            wanted.update({execution_id: group_id for execution_id in need})
        if not waiting:
            return
        expected = {o.execution_id: o.calls for outcomes in members.values() for o in outcomes}
        retried = dict(self.con.execute(RETRIED_SQL.format(scope=scope)).fetchall())
        pieces: dict[str, list[CallFragment]] = defaultdict(list)
        received: dict[str, int] = defaultdict(int)
        for batch in self.con.sql(f"{CALLS_SQL} WHERE {scope}").to_arrow_reader(STREAM_ROWS):
            for execution_id, rows in _split(batch, wanted):
                if execution_id in retried:  # only the last attempt's calls
                    seqs = batch.column("seq").to_numpy()
                    rows = rows[seqs[rows] > retried[execution_id]]
                    if not len(rows):
                        continue
                pieces[execution_id].append(CallFragment.from_rows(batch, rows))
                received[execution_id] += len(rows)
                if received[execution_id] < expected[execution_id]:
                    continue
                group_id = wanted[execution_id]
                waiting[group_id].discard(execution_id)
                if not waiting[group_id]:
                    del waiting[group_id]
                    yield _loaded(group_id, members[group_id], pieces)
        for group_id, missing in waiting.items():  # the scan disagreed with the count: flag, never guess
            for execution_id in missing:
                pieces[execution_id].append(
                    CallFragment.broken(
                        f"the log scan returned {received[execution_id]} of its {expected[execution_id]} calls"
                    )
                )
            yield _loaded(group_id, members[group_id], pieces)


Follow = Callable[[int, float, threading.Event], Iterator[pa.RecordBatch]]
"""``(from_seq, poll_s, stop)`` -> the log's batches from ``from_seq`` on, as they are written, until ``stop``."""

BATCH_KINDS = ("execution_queued", "execution_finished", "reward_recorded", "evaluation_failed",
               "model_call_finished")
"""The kinds a batch is built from."""


class LiveLogSource(LogSource):
    """A run's growing log for step-by-step batch building: tables created once, data added incrementally.

    A fresh `LogSource` per step decodes the whole live segment again, and every query scans every call,
    so the cost of a step grows with the run. Here a follower thread tails the log (`LogReader.follow`:
    only bytes not seen yet are read); `refresh(upto)` moves what it read, up to seq ``upto``, into one flat
    table per batch kind, and each step's queries are filtered to its executions (`groups(group_ids=...)`),
    a filter DuckDB pushes into each table scan.
    """

    def __init__(self, path: str | Path, run_id: str | None = None, threads: int = 1, poll_s: float = 0.02,
                 follow: Follow | None = None) -> None:
        """``follow(from_seq, poll_s, stop)`` yields the log's batches as they are written (default: tail the
        files at ``path``; a process on another host than the log passes `gyre.cluster.log_client.RemoteLog`'s,
        and ``path`` only names the log in errors)."""
        from gyre.events.schema import event_schema

        con = duckdb.connect()
        con.execute(f"SET threads = {int(threads)}")
        con.register("gyre_new", event_schema().empty_table())
        for kind in BATCH_KINDS:  # one flat table per kind: a step's filter never touches other rows' tokens
            con.execute(f"CREATE TABLE {EVENT_TYPES[kind].view} AS {_flat(kind)}")
        con.unregister("gyre_new")
        super().__init__(path, con=con, run_id=run_id)
        self.next_seq = 0
        self._batches: queue.Queue[pa.RecordBatch | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._follower: Follow = follow or (lambda from_seq, poll_s, stop: LogReader(self.path).follow(
            from_seq=from_seq, poll_s=poll_s, stop=stop))
        self._thread = threading.Thread(target=self._follow, name="gyre-batch-source", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for batch in self._follower(0, self._poll_s, self._stop):
                self._batches.put(batch)
        except BaseException as error:  # handed to refresh, never swallowed
            self._batches.put(error)

    def refresh(self, upto: int, timeout_s: float = 60.0) -> int:
        """Load the batch kinds' events up to seq ``upto`` (written to the log); returns the rows added."""
        items: list[pa.RecordBatch | BaseException] = []
        seen = self.next_seq
        while seen <= upto:
            try:
                item = self._batches.get(timeout=timeout_s)
            except queue.Empty:
                self._load(items)
                raise TrajectoryError(f"the log at {self.path} did not reach seq {upto} within {timeout_s} s "
                                      f"(read up to {self.next_seq - 1})") from None
            items.append(item)
            if isinstance(item, BaseException):
                break
            seen = max(seen, _last_seq(item) + 1)
        return self._load(items)

    def refresh_available(self, wait_s: float) -> int:
        """Load everything the follower has read by now, waiting up to ``wait_s`` for something when it has
        read nothing new (a streamed step waits on its groups this way); returns the rows added."""
        try:
            items = [self._batches.get(timeout=wait_s)]
        except queue.Empty:
            return 0
        while not isinstance(items[-1], BaseException):
            try:
                items.append(self._batches.get_nowait())
            except queue.Empty:
                break
        return self._load(items)

    def _load(self, items: list[pa.RecordBatch | BaseException]) -> int:
        """Insert the followed batches, all at once: the follower yields about one small batch per event, and
        each statement costs the same whatever its rows (tens of ms on a loaded core), so one insert per kind
        present in them all — never one per batch and kind (a step's first query took minutes so)."""
        batches = [item for item in items if not isinstance(item, BaseException)]
        added = 0
        if batches:
            try:
                table = pa.Table.from_batches(batches)
            except pa.ArrowInvalid:  # schemas differ (a follower may widen one): unified column by column
                table = pa.concat_tables([pa.Table.from_batches([b]) for b in batches], promote_options="default")
            rows = {c["values"]: c["counts"] for c in table.column("kind").value_counts().to_pylist()}
            present = [kind for kind in BATCH_KINDS if kind in rows]
            if present:
                self.con.register("gyre_new", table)
                for kind in present:
                    self.con.execute(f"INSERT INTO {EVENT_TYPES[kind].view} {_flat(kind)}")
                self.con.unregister("gyre_new")
            self.next_seq = max(self.next_seq, max(_last_seq(b) for b in batches) + 1)
            added = sum(rows[kind] for kind in present)
        for item in items:
            if isinstance(item, BaseException):
                raise TrajectoryError(f"following the log at {self.path} failed: {item}") from item
        return added

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.con.close()


def _last_seq(batch: pa.RecordBatch) -> int:
    return int(batch.column("seq")[-1].as_py())


def _flat(kind: str) -> str:
    from gyre.events.schema import ENVELOPE_COLUMNS

    return f"SELECT {', '.join(ENVELOPE_COLUMNS)}, UNNEST({kind}) FROM gyre_new WHERE kind = '{kind}'"


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _split(batch: pa.RecordBatch, wanted: dict[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """Row indices of ``batch`` per wanted execution."""
    encoded = batch.column("execution_id").dictionary_encode()
    names = encoded.dictionary.to_pylist()
    keep_name = np.array([name in wanted for name in names], dtype=bool)
    if not keep_name.any():
        return
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(keep_name[codes])
    rows = rows[np.argsort(codes[rows], kind="stable")]
    sorted_codes = codes[rows]
    cuts = np.flatnonzero(np.diff(sorted_codes)) + 1
    for part in np.split(rows, cuts):
        yield names[codes[part[0]]], part


def _loaded(group_id: str, outcomes: list[ExecutionOutcome], pieces: dict[str, list[CallFragment]]) -> Group:
    """The group with each member's fragments joined, so that only one copy of its tokens stays alive."""
    return Group(
        group_id, tuple(Member(o, _joined(o.execution_id, pieces.pop(o.execution_id, None))) for o in outcomes)
    )


def _joined(execution_id: str, fragments: list[CallFragment] | None) -> ExecutionCalls | TrajectoryError | None:
    if fragments is None:
        return None
    try:
        return ExecutionCalls.from_fragments(execution_id, fragments)
    except TrajectoryError as error:  # a value, not swallowed: the builder counts (or, strict, raises) it
        return error
