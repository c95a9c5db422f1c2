"""Busy and idle time read back from a log with DuckDB, so any run (simulated or live) can be judged.

An execution holds 1/slots of its cell from its start (or the redirect that brought it there) until it
finishes, moves or is cut (queued again, partial rollouts); a micro-step holds its cell for its duration;
the optimizer holds the core from the step's last micro-step to ``train_step_finished``. Everything else
is idle: switches, joins, waiting.
"""

from dataclasses import dataclass

import duckdb

BUSY_SQL = """
WITH placed AS (
    SELECT execution_id, cell_id, epoch_us(ts) AS t, seq FROM executions_started
    UNION ALL SELECT execution_id, to_cell_id, epoch_us(ts), seq FROM call_redirects
    UNION ALL SELECT execution_id, NULL, epoch_us(ts), seq FROM executions_finished
    UNION ALL SELECT execution_id, NULL, epoch_us(ts), seq FROM executions_queued),
held AS (
    SELECT cell_id, lead(t) OVER (PARTITION BY execution_id ORDER BY seq) - t AS us FROM placed),
optimizer AS (
    SELECT epoch_us(f.ts) - (SELECT max(epoch_us(m.ts)) FROM micro_steps m WHERE m.step = f.step) AS us
    FROM train_steps f)
SELECT
    (SELECT coalesce(sum(h.us / c.slots), 0) FROM held h JOIN cells c USING (cell_id)) / 1e6,
    (SELECT coalesce(sum(duration_s), 0) FROM micro_steps) + (SELECT coalesce(sum(us), 0) FROM optimizer) / 1e6,
    (SELECT epoch_us(max(ts)) - epoch_us(min(ts)) FROM events) / 1e6,
    (SELECT count(*) FROM cells),
    (SELECT coalesce(sum(gpus), 0) FROM cells)
"""


@dataclass(frozen=True)
class LogBusy:
    rollout_s: float
    """Cell-seconds of rollout slots held."""
    training_s: float
    """Cell-seconds of micro-steps and optimizer steps."""
    makespan_s: float
    cells: int
    gpus: int

    @property
    def utilization(self) -> float:
        return (self.rollout_s + self.training_s) / (self.cells * self.makespan_s)

    @property
    def idle_gpu_hours(self) -> float:
        return self.gpus * self.makespan_s * (1 - self.utilization) / 3600


def log_busy(con: duckdb.DuckDBPyConnection) -> LogBusy:
    """Busy time of the run behind ``con`` (a connection from ``LogReader.duckdb()``)."""
    rollout_s, training_s, makespan_s, cells, gpus = con.execute(BUSY_SQL).fetchone()
    return LogBusy(float(rollout_s), float(training_s), float(makespan_s), int(cells), int(gpus))
