"""Reward: the share of the letters of "hello" found in the answer (prints one JSON line)."""

import json
import sys

try:
    with open(sys.argv[1]) as f:
        text = f.read()
except FileNotFoundError:
    text = ""
print(json.dumps({"reward": sum(c in text for c in "helo") / 4, "details": {}}))
