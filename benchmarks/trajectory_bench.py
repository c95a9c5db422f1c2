"""Trajectory processor benchmark: build throughput, peak memory, and forward tokens of three forms.

Usage::

    python benchmarks/trajectory_bench.py [--executions 100] [--seed 0] [--cap 5] [--log DIR] [--repeat 3]

Synthesises a run (unless ``--log`` names one), then builds capped tree-packed micro-batches from it
``--repeat`` times in this process (best time counts: throughput is log tokens read per second, DuckDB
scan included) and once more in a fresh child process, whose peak RSS above its RSS just before the
build (``/proc/self/status``, Linux) is the memory figure. The payload is what the log holds for the
model calls: 4 bytes per token id plus 4 bytes per behaviour log-prob. Prints one JSON object.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _consume(log: Path, cap: int | None, form: str, token_budget: int) -> dict[str, Any]:
    from gyre.trajectory import BatchBuilder, TrajectoryConfig

    builder = BatchBuilder(TrajectoryConfig(cap=cap, form=form, token_budget=token_budget))  # type: ignore[arg-type]
    for batch in builder.from_log(log):  # the trainer's side: take a micro-batch, let it go
        del batch
    return builder.report.to_dict()


def _memory() -> tuple[int, int]:
    """Current and peak resident memory of this process, in bytes (Linux ``/proc``)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    """Start the peak-RSS mark afresh (a child's ``ru_maxrss`` starts at its parent's, so it cannot be used)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(log: Path, cap: int | None, form: str = "packed", token_budget: int = 1 << 20) -> dict[str, Any]:
    """One build in this process: wall time and peak RSS growth over the RSS just before it."""
    import duckdb  # noqa: F401 - imported before the baseline, like the builder's own imports

    import gyre.trajectory.source  # noqa: F401

    _reset_peak()
    baseline, _ = _memory()
    start = time.perf_counter()
    report = _consume(log, cap, form, token_budget)
    seconds = time.perf_counter() - start
    _, peak = _memory()
    return {
        "seconds": seconds,
        "peak_rss_growth_bytes": peak - baseline,
        "baseline_rss_bytes": baseline,
        "report": report,
    }


def payload(log: Path) -> dict[str, int]:
    """Tokens and bytes of the log's model-call payload (ids int32, log-probs float32)."""
    from gyre.log import LogReader

    tokens, policy, calls = (
        LogReader(log)
        .duckdb()
        .sql("SELECT sum(len(prompt_delta_ids) + len(output_ids)), sum(len(output_ids)), count(*) FROM model_calls")
        .fetchall()[0]
    )
    return {
        "tokens": int(tokens),
        "policy_tokens": int(policy),
        "model_calls": int(calls),
        "bytes": 4 * int(tokens) + 4 * int(policy),
    }


def run(
    executions: int = 100,
    seed: int = 0,
    cap: int = 5,
    log: Path | None = None,
    repeat: int = 3,
    min_tokens: int = 100_000,
    max_tokens: int = 700_000,
    token_budget: int = 1 << 20,
) -> dict[str, Any]:
    """Everything the benchmark reports, as a dictionary (``main`` prints it as JSON)."""
    from gyre.trajectory.synth import SynthConfig
    from gyre.trajectory.synth_log import synthesize

    scratch = None
    synth_seconds = None
    if log is None:
        scratch = tempfile.TemporaryDirectory(prefix="gyre-trajectory-bench-")
        log = Path(scratch.name) / "log"
        start = time.perf_counter()
        synthesize(log, SynthConfig(executions=executions, seed=seed, min_tokens=min_tokens, max_tokens=max_tokens))
        synth_seconds = time.perf_counter() - start
    try:
        data = payload(log)
        timings = [measure(log, cap, token_budget=token_budget) for _ in range(repeat)]
        best = min(timings, key=lambda t: t["seconds"])
        child = subprocess.run(
            [sys.executable, __file__, "--measure", str(log), "--cap", str(cap), "--token-budget", str(token_budget)],
            check=True,
            capture_output=True,
            text=True,
        )
        memory = json.loads(child.stdout)
        expanded = measure(log, cap, form="expanded", token_budget=token_budget)
        report = best["report"]
        capped_expanded, packed = report["tokens_expanded"], report["tokens_tree_packed"]
        uncapped = report["tokens_expanded_uncapped"]
        return {
            "executions": report["executions"],
            "executions_used": report["executions_used"],
            "log_tokens": data["tokens"],
            "model_calls": data["model_calls"],
            "tokens_per_execution": data["tokens"] // max(1, report["executions"]),
            "payload_bytes": data["bytes"],
            "synth_seconds": synth_seconds,
            "build_seconds": best["seconds"],
            "build_seconds_all": [t["seconds"] for t in timings],
            "throughput_tokens_per_s": data["tokens"] / best["seconds"],
            "expanded_build_seconds": expanded["seconds"],
            "peak_rss_growth_bytes": memory["peak_rss_growth_bytes"],
            "peak_memory_vs_payload": memory["peak_rss_growth_bytes"] / data["bytes"],
            "cap": cap,
            "forward_tokens": {
                "expanded_uncapped": uncapped,
                "expanded_capped": capped_expanded,
                "tree_packed_capped": packed,
                "tree_packed_uncapped": report["tokens_total"],
            },
            "cap_cut_vs_uncapped_expanded": 1 - capped_expanded / uncapped if uncapped else 0.0,
            "packing_cut_vs_capped_expanded": 1 - packed / capped_expanded if capped_expanded else 0.0,
            "packed_capped_cut_vs_uncapped_expanded": 1 - packed / uncapped if uncapped else 0.0,
            "policy_tokens_trained": report["policy_tokens_trained"],
            "policy_tokens_total": report["policy_tokens_total"],
            "trajectories_total": report["trajectories_total"],
            "trajectories_kept": report["trajectories_kept"],
            "micro_batches": report["micro_batches"],
        }
    finally:
        if scratch is not None:
            scratch.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executions", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=int, default=5)
    parser.add_argument("--log", type=Path, default=None, help="benchmark an existing log instead of synthesising")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=700_000)
    parser.add_argument("--token-budget", type=int, default=1 << 20)
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure is not None:  # the child process of the memory measurement
        result = measure(args.measure, args.cap, token_budget=args.token_budget)
        print(json.dumps({k: v for k, v in result.items() if k != "report"}))
        return
    print(
        json.dumps(
            run(
                args.executions,
                args.seed,
                args.cap,
                args.log,
                args.repeat,
                args.min_tokens,
                args.max_tokens,
                args.token_budget,
            )
        )
    )


if __name__ == "__main__":
    main()
