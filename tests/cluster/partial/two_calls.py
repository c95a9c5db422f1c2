"""Two chat calls through the proxy (stdlib only), ordered by files, never by sleeps: the task's first line is
``HOLD <dir> <kind>``. A ``slow`` execution makes its first call, says so (``<dir>/slow-<pid>``) and waits for
``<dir>/release`` before its second; a ``fast`` one makes its calls once both slow ones have made their
first, so its batch completes while they are between calls (the test cuts them there)."""

import json
import os
import sys
import time
import urllib.request

with open(sys.argv[1]) as f:
    _, hold, kind = f.readline().split()
answer = sys.argv[2]


def call(content: str) -> str:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": os.environ.get("OPENAI_MODEL", "gyre"),
                         "messages": [{"role": "user", "content": content}]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:  # a cut call waits for a cell to admit it
        return json.loads(response.read())["choices"][0]["message"]["content"] or ""


def wait_for(done) -> None:
    while not done():
        time.sleep(0.05)  # polls a file the test or a peer writes: the order is the files', not the clock's


if kind == "slow":
    first = call("Write the word hello.")
    open(os.path.join(hold, f"slow-{os.getpid()}"), "w").close()
    wait_for(lambda: os.path.exists(os.path.join(hold, "release")))
else:
    wait_for(lambda: sum(n.startswith("slow-") for n in os.listdir(hold)) >= 2)
    first = call("Write the word hello.")
with open(answer, "w") as f:
    f.write(first + call("Again: hello."))
