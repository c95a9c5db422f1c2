#!/usr/bin/env python3
"""The scenario task set's grader: the reward the workload drew for this execution, after its evaluation time.

Usage: ``grade.py GRADING_FILE EXECUTION_ID``. The grading table (``grading`` in the grading file, hidden from
the harness) holds, per rollout of the group, the workload's ``reward``, ``eval_s`` and ``eval_failed``, and
the run's ``time_scale``. The grader sleeps ``eval_s / time_scale``; an evaluation the workload says failed
exits 1 (an evaluator error: the execution is excluded, never scored 0); otherwise it prints
``{"reward": R}``. Which rollout: the number at the end of the execution id (``…-e2``, ``…-r02``). Stdlib only.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

_ROLLOUT = re.compile(r"-[re]0*(\d+)$")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: grade.py GRADING_FILE EXECUTION_ID", file=sys.stderr)
        return 2
    grading = json.loads(Path(argv[0]).read_text())["grading"]
    match = _ROLLOUT.search(argv[1])
    rollouts = grading.get("rollouts", [])
    if match is None or int(match[1]) >= len(rollouts):
        print(f"execution {argv[1]!r} is not a rollout of this group ({len(rollouts)} rollouts)", file=sys.stderr)
        return 2
    rollout = rollouts[int(match[1])]
    time.sleep(float(rollout["eval_s"]) / float(grading.get("time_scale", 1.0)))
    if rollout["eval_failed"]:
        print("the workload drew a failed evaluation for this execution", file=sys.stderr)
        return 1
    print(json.dumps({"reward": float(rollout["reward"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
