#!/usr/bin/env python3
"""Command evaluator of the toy task set: `evaluate.py GRADING_FILE WORKSPACE` prints one JSON line.

GRADING_FILE is what Gyre writes for `{grading_file}`: {"task_id", "answer_file", "grading", "status",
"partial", ...}. The last stdout line is {"reward": float, "details": {...}}; any exception propagates, so the
process exits non-zero and Gyre records `evaluation_failed` (crash) instead of a reward.
"""

import json
import sys
from pathlib import Path

from grading import grade


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: evaluate.py GRADING_FILE WORKSPACE", file=sys.stderr)
        return 2
    document = json.loads(Path(argv[0]).read_text())
    reward, details = grade(document["grading"], Path(argv[1]), document["answer_file"])
    print(json.dumps({"reward": reward, "details": details}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
