"""Codex CLI, unmodified, through a real Gyre proxy: one `codex exec` session, every request and answer recorded.

Used by the opt-in live test (tests/harness/test_codex.py) and to record the replay fixture that `make test`
replays (`python -m tests.harness.codex_session --codex PATH`: run once per Codex release, no network).
Codex talks to a recording relay in front of the proxy, so the fixture holds the bytes Codex sent; the
fixture is scrubbed (ids, paths, dates) and deduplicated (a request repeats the previous one's input and
tools: stored once) to stay small and readable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from agents.codex.launch import write_config
from gyre.proxy import Proxy, ProxyConfig, ProxyServer
from gyre.sink import MemorySink

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "codex" / "codex-session.json"
PROMPT = "Create hello.txt containing the word hello, then check on your sub-agents."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
CALLS: list[tuple[str, str, dict[str, Any]]] = [
    ("Let me look.", "exec_command", {"cmd": "ls"}),
    ("", "apply_patch", {"input": PATCH}),
    ("", "multi_agent_v1.wait_agent", {"targets": []}),
]
FINAL = "Done: hello.txt says hello."


def script(separator: str = "", inner: str = "") -> list[str]:
    """The model's replies: three calls (a function, the freeform apply_patch, a namespaced sub-agent tool),
    then a final message. `separator`/`inner`: the template's layout around a call (Qwen2.5: newlines)."""
    replies = []
    for text, name, arguments in CALLS:
        call = json.dumps({"name": name, "arguments": arguments})
        replies.append(f"{text}{separator if text else ''}<tool_call>{inner}{call}{inner}</tool_call>")
    return [*replies, FINAL]


@dataclass
class Session:
    done: subprocess.CompletedProcess[str]
    exchanges: list[dict[str, Any]]
    events: MemorySink
    workspace: Path
    home: Path
    answer: str = ""
    version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Relay(ThreadingHTTPServer):
    """A recording HTTP relay in front of the proxy: every POST's body and the answer's bytes, in order."""

    daemon_threads = True

    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", 0), _RelayHandler)
        self.target = target
        self.exchanges: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RelayHandler(BaseHTTPRequestHandler):
    server: Relay

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type", "accept")}
        chunks: list[bytes] = []
        with httpx.Client(timeout=None) as client, client.stream(
            "POST", self.server.target + self.path, content=body, headers=headers
        ) as response:
            self.send_response(response.status_code)
            self.send_header("content-type", response.headers.get("content-type", "application/json"))
            self.end_headers()
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                self.wfile.write(chunk)
                self.wfile.flush()
        with self.server.lock:
            self.server.exchanges.append(
                {"path": self.path, "request": json.loads(body), "status": response.status_code,
                 "answer": b"".join(chunks).decode()}
            )


def codex_version(codex: str) -> str:
    return subprocess.run([codex, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def run_session(codex: str, engine_url: str, tmp: Path, *, prompt: str = PROMPT, timeout_s: float = 1800,
                compact_at: int | None = None, **proxy_config: Any) -> Session:
    """Start a proxy in front of `engine_url`, a recording relay in front of it, and run `codex exec`."""
    events = MemorySink()
    server = ProxyServer(Proxy(ProxyConfig(engines={"cell0": engine_url}, **proxy_config), sink=events))
    server.start()
    relay = Relay(server.url)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        registration = server.register_execution("codex-1")
        home, workspace = tmp / "home", tmp / "workspace"
        workspace.mkdir(parents=True, exist_ok=True)
        codex_home = home / ".codex"
        write_config(codex_home, codex=Path(codex), base_url=f"{relay.url}/v1", model="gyre-policy",
                     auto_compact_tokens=compact_at)
        answer = tmp / "answer.txt"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "CODEX_HOME": str(codex_home),
               "OPENAI_API_KEY": registration.token, "RUST_LOG": "error", "NO_COLOR": "1"}
        done = subprocess.run(
            [codex, "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", "--color", "never",
             "--output-last-message", str(answer), prompt],
            cwd=workspace, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
        )
    finally:
        relay.shutdown()
        server.stop()
    return Session(done, relay.exchanges, events, workspace, home,
                   answer.read_text() if answer.exists() else "", codex_version(codex))


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def scrub(value: Any, paths: dict[str, str], ids: dict[str, str]) -> Any:
    """`value` with host paths replaced, every UUID by a stable fake one, dates by one fixed date."""
    if isinstance(value, dict):
        return {k: scrub(v, paths, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, paths, ids) for v in value]
    if not isinstance(value, str):
        return value
    for real, fake in paths.items():
        value = value.replace(real, fake)

    def fake_id(match: re.Match[str]) -> str:
        return ids.setdefault(match.group(0), f"00000000-0000-4000-8000-{len(ids) + 1:012d}")

    return _DATE.sub("2026-01-01", _UUID.sub(fake_id, value))


def fixture(session: Session, replies: list[str]) -> dict[str, Any]:
    """The session as the checked-in fixture: each request (deduplicated against the previous one), the model
    reply the scripted engine gave it, and the output items Codex got back."""
    paths = {str(session.workspace): "/workspace", str(session.home): "/home/codex"}
    ids: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for exchange, reply in zip(session.exchanges, replies, strict=False):
        request = scrub(exchange["request"], paths, ids)
        whole = dict(request)
        entry: dict[str, Any] = {"reply": reply}
        if previous is not None:
            before = previous["input"]
            if request["input"][: len(before)] == before:
                request["input"] = request["input"][len(before):]
                entry["input_from_previous"] = len(before)
            if request.get("tools") == previous.get("tools"):
                del request["tools"]
                entry["tools_from_previous"] = True
        entry["request"] = request
        final = [json.loads(line[6:]) for line in exchange["answer"].splitlines() if line.startswith("data: ")][-1]
        entry["output"] = [_item_shape(i) for i in final["response"]["output"]]
        out.append(entry)
        previous = whole
    return {"codex_version": session.version, "recorded_with": "python -m tests.harness.codex_session",
            "prompt": PROMPT, "exchanges": out}


def _item_shape(item: dict[str, Any]) -> dict[str, Any]:
    keep = ("type", "name", "namespace", "input", "arguments", "role")
    return {k: item[k] for k in keep if k in item}


def requests_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The fixture's requests, whole again."""
    bodies: list[dict[str, Any]] = []
    for entry in data["exchanges"]:
        body = dict(entry["request"])
        if bodies:
            before = bodies[-1]
            body["input"] = before["input"][: entry.get("input_from_previous", 0)] + body["input"]
            if entry.get("tools_from_previous"):
                body["tools"] = before["tools"]
        bodies.append(body)
    return bodies


def main() -> int:
    from tests.proxy.scripted_engine import ScriptedEngine

    parser = argparse.ArgumentParser(description="Record a Codex CLI session through the proxy as a fixture.")
    parser.add_argument("--codex", required=True)
    parser.add_argument("--out", type=Path, default=FIXTURE)
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/gyre-codex-capture"))
    args = parser.parse_args()
    engine = ScriptedEngine()
    engine.start()
    replies = script()
    engine.say(*replies)
    try:
        session = run_session(args.codex, engine.url, args.tmp)
    finally:
        engine.stop()
    print(session.done.stdout[-3000:], session.done.stderr[-3000:], file=sys.stderr)
    if session.done.returncode != 0 or len(session.exchanges) != len(replies):
        print(f"codex exited {session.done.returncode} after {len(session.exchanges)} requests", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture(session, replies), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {session.version})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
