"""One chat completion through the proxy (OpenAI API, stdlib only); the reply goes into the answer file."""

import json
import os
import sys
import urllib.request

with open(sys.argv[1]) as f:
    task = f.read()
answer = sys.argv[2]
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ.get("OPENAI_MODEL", "gyre"),
                     "messages": [{"role": "user", "content": task}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=25) as response:
    reply = json.loads(response.read())["choices"][0]["message"]["content"] or ""
with open(answer, "w") as f:
    f.write(reply)
