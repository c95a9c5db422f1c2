"""Emulated live runs against the simulator, step by step: what streaming micro-steps buy live.

    .venv/bin/python -m benchmarks.stream_live RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a finished `gyre run CONFIG --emulate SCENARIO` run. Per run (folded from its log and its
``cluster-config.json``): ``emulated_s`` = first `execution_queued` to last `weights_published` (the window of
``benchmarks.cluster_compare``) times the run's ``time_scale``; per step, when it opened, when its last reward
came and when it finished (emulated seconds from the first queueing); and ``predicted_s``, ``gyre sim`` on
the same scenario and steps with the run's policy and the parameters a policy decides by (streaming,
partial rollouts, hysteresis, staleness), with ``sim_error`` = predicted / live - 1. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gyre.cluster.emulated import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of finished --emulate runs")
    args = parser.parse_args()
    print(json.dumps({"runs": [measure(r) for r in args.runs]}, indent=2))


if __name__ == "__main__":
    main()
