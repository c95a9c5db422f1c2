"""What a run report shows, read from the log with DuckDB and shaped into plain series (JSON-ready).

Times are seconds since the run's first event. A "batch" of rollouts is the executions queued on one
policy version (a step's rollouts in ``gyre train``; in the simulator, whatever the policy sampled from that
version); held-out executions (group ids starting ``heldout-``) are kept out of the training curves and the
rollout tail figures, and have their own curve.
"""

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from gyre.evaluation.heldout import GROUP_PREFIX
from gyre.log import LogReader

METRICS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("loss", "GSPO loss and gradient norm", ("loss", "grad_norm")),
    ("clip", "clipped and TIS-truncated token share", ("clip_fraction", "tis_truncated_fraction")),
    ("mismatch", "trainer vs engine log-prob: |diff| mean, max; KL (k3)", ("log_ratio_mean", "log_ratio_max", "kl")),
    ("entropy", "policy entropy per token (sampled estimate)", ("entropy",)),
    ("length", "response length (policy tokens per execution)", ("response_tokens_mean", "response_tokens_max")),
    ("groups", "reward spread: std over the step, mean std within groups", ("reward_std", "group_reward_std")),
    ("advantage", "advantages: mean, std, min, max", ("advantage_mean", "advantage_std", "advantage_min",
                                                    "advantage_max")),
    ("throughput", "forwarded tokens per second of forward-backward", ("tokens_per_s",)),
    ("phases", "step time by phase (s)", ("rollout_s", "batch_s", "forward_backward_s", "optimizer_s")),
)
"""Small-multiple plots of ``train_steps`` columns: id, title, columns."""

TAIL_QUANTILE = 0.9


def report_data(log: str | Path) -> dict[str, Any]:
    """Everything the report plots, from the log at ``log``."""
    con = LogReader(log).duckdb()

    def rows(sql: str) -> list[dict[str, Any]]:
        cursor = con.execute(sql)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    t0_row = con.execute("SELECT min(ts) FROM events").fetchone()
    t0 = t0_row[0] if t0_row else None

    def secs(ts: Any) -> float:
        return (ts - t0).total_seconds() if ts is not None and t0 is not None else 0.0

    started = rows("SELECT run_id, name, policy, ts FROM runs_started ORDER BY seq LIMIT 1")
    finished = rows("SELECT status, ts FROM runs_finished ORDER BY seq DESC LIMIT 1")
    end_row = con.execute("SELECT max(ts) FROM events").fetchone()
    steps = rows("SELECT * EXCLUDE (seq, ts, run_id, execution_id, call_id, cell_id) FROM train_steps ORDER BY step")
    heldout = rows("SELECT step, policy_version, pass_rate, reward_mean, scored, passed, executions "
                   "FROM heldout_evaluations ORDER BY seq")
    executions = rows(f"""
        SELECT q.execution_id, q.group_id, q.policy_version, q.ts AS queued, f.ts AS finished, f.duration_s,
               f.status, r.reward
        FROM executions_queued q
        LEFT JOIN executions_finished f USING (execution_id)
        LEFT JOIN (SELECT execution_id, arg_max(reward, seq) AS reward FROM rewards GROUP BY 1) r USING (execution_id)
        WHERE q.group_id IS NULL OR NOT starts_with(q.group_id, '{GROUP_PREFIX}')
        ORDER BY q.seq""")
    all_executions = rows("SELECT 1 AS up, ts FROM executions_queued UNION ALL "
                          "SELECT -1 AS up, ts FROM executions_finished ORDER BY ts, up DESC")
    cells = rows("SELECT cell_id, role, ts FROM cells ORDER BY seq")
    requests = rows("SELECT cell_id, from_role, to_role, watermark, ts FROM role_switch_requests ORDER BY seq")
    switches = rows("SELECT cell_id, from_role, to_role, duration_s, ts FROM role_switches ORDER BY seq")
    lost = rows("SELECT cell_id, ts FROM cells_lost ORDER BY seq")
    end = secs(end_row[0]) if end_row else 0.0

    return {
        "run": {
            "run_id": started[0]["run_id"] if started else None,
            "name": started[0]["name"] if started else None,
            "policy": started[0]["policy"] if started else None,
            "status": finished[0]["status"] if finished else "running",
            "duration_s": end,
            "steps": len(steps),
        },
        "steps": _columns(steps),
        "rewards": _rewards(steps, executions),
        "heldout": _columns(heldout),
        "metrics": [{"id": i, "title": t, "columns": list(c)} for i, t, c in METRICS],
        "cells": _cells(cells, requests, switches, lost, secs, end),
        "watermark": _watermark(all_executions, secs),
        "requested_watermark": [[secs(r["ts"]), r["watermark"]] for r in requests if r["watermark"] is not None],
        "rollouts": _rollouts(executions, secs),
        "switches": [{"cell": s["cell_id"], "direction": f"{s['from_role']}→{s['to_role']}",
                      "t": secs(s["ts"]), "duration_s": s["duration_s"]} for s in switches],
    }


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Row dicts to one list per column (JSON numbers; None stays null)."""
    if not rows:
        return {}
    return {name: [_plain(r[name]) for r in rows] for name in rows[0]}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _rewards(steps: list[dict[str, Any]], executions: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Mean and std of the training rewards per policy version: every scored execution sampled from it
    (the batch statistics of ``train_steps`` count only the executions a step used)."""
    by_version: dict[int, list[float]] = defaultdict(list)
    for e in executions:
        if e["reward"] is not None:
            by_version[e["policy_version"]].append(e["reward"])
    versions = sorted(by_version)
    means = [sum(by_version[v]) / len(by_version[v]) for v in versions]
    stds = [(sum((x - m) ** 2 for x in by_version[v]) / len(by_version[v])) ** 0.5
            for v, m in zip(versions, means, strict=True)]
    return {"version": versions, "mean": means, "std": stds, "count": [len(by_version[v]) for v in versions]}


def _cells(cells: list[dict[str, Any]], requests: list[dict[str, Any]], switches: list[dict[str, Any]],
           lost: list[dict[str, Any]], secs: Any, end: float) -> list[dict[str, Any]]:
    """Each cell's role over time: segments ``[t0, t1, role]``; between a switch's request and its
    completion the role is ``switching``."""
    changes: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for c in cells:
        changes[c["cell_id"]].append((secs(c["ts"]), c["role"]))
    for r in requests:
        changes[r["cell_id"]].append((secs(r["ts"]), "switching"))
    for s in switches:
        changes[s["cell_id"]].append((secs(s["ts"]), s["to_role"]))
    for item in lost:
        changes[item["cell_id"]].append((secs(item["ts"]), "lost"))
    out = []
    for cell_id, marks in changes.items():
        marks.sort(key=lambda m: m[0])  # stable: a request and its completion at one instant keep their order
        segments = []
        for (t, role), nxt in zip(marks, [*marks[1:], (end, "")], strict=True):
            if role != "lost" and nxt[0] > t:
                segments.append([t, nxt[0], role])
        out.append({"cell": cell_id, "segments": segments})
    return out


def _watermark(changes: list[dict[str, Any]], secs: Any) -> list[list[float]]:
    """Running + queued executions over time, as ``[t, value]`` steps (held-out executions included: they
    occupy the cells too)."""
    level, points = 0, []
    for c in changes:
        level += c["up"]
        points.append([secs(c["ts"]), level])
    return points


def _rollouts(executions: list[dict[str, Any]], secs: Any) -> dict[str, Any]:
    """Duration CDF and tail figures of the finished training executions."""
    done = [e for e in executions if e["duration_s"] is not None]
    durations = sorted(e["duration_s"] for e in done)
    n = len(durations)

    def quantile(q: float) -> float | None:
        return durations[min(n - 1, int(q * n))] if n else None

    total = sum(durations)
    slowest = durations[int(TAIL_QUANTILE * n):] if n else []
    batches: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in done:
        if e["finished"] is not None:
            batches[e["policy_version"]].append(e)
    tail = []
    for version in sorted(batches):
        batch = batches[version]
        start = min(secs(e["queued"]) for e in batch)
        ends = sorted(secs(e["finished"]) for e in batch)
        last = ends[-1]
        at_quantile = ends[max(0, math.ceil(TAIL_QUANTILE * len(ends)) - 1)]
        span = last - start
        tail.append([version, (last - at_quantile) / span if span > 0 else 0.0, len(batch)])
    return {
        "cdf": [[d, (i + 1) / n] for i, d in enumerate(durations)],
        "p50": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99), "max": durations[-1] if n else None,
        "count": n,
        "slowest_share_of_time": sum(slowest) / total if total > 0 else None,
        "tail_share": tail,
        "statuses": _count(e["status"] for e in done),
        "quantile": TAIL_QUANTILE,
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for v in values:
        out[str(v)] += 1
    return dict(out)
