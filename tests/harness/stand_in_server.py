"""A stand-in OpenAI-compatible chat-completions server for the toy agent's tests (FastAPI on loopback).

Replies are scripted per agent: the server tells a summary request (the compaction instruction in the last
user message), a sub-agent (its first user message) and the main agent apart, and takes that agent's next
scripted step. Every request is kept with the route it took and its Authorization header.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

SUMMARY_MARKER = "Your task is to create a detailed summary of the conversation so far"
SUB_AGENT_MARKER = "You are a sub-agent."


@dataclass(frozen=True)
class Step:
    """One scripted reply: an HTTP error, tool calls, or plain text."""

    kind: str  # "error" | "tool" | "text"
    text: str = ""
    calls: tuple[tuple[str, str], ...] = ()  # (tool name, raw JSON arguments)
    status: int = 500


def error(status: int = 500) -> Step:
    return Step("error", status=status)


def tool(name: str, arguments: dict[str, Any] | str) -> Step:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return Step("tool", calls=((name, raw),))


def text(content: str) -> Step:
    return Step("text", text=content)


@dataclass
class Seen:
    route: str
    body: dict[str, Any]
    authorization: str | None


@dataclass
class Script:
    main: deque[Step] = field(default_factory=deque)
    sub: deque[Step] = field(default_factory=deque)
    summary: str = "The agent read and wrote files."
    repeat_last: bool = False
    """Keep answering with the last step of a queue once it is used up (for max-turns tests)."""


def route_of(body: dict[str, Any]) -> str:
    messages = body.get("messages", [])
    users = [m for m in messages if m.get("role") == "user"]
    if users and SUMMARY_MARKER in str(users[-1].get("content")):
        return "summary"
    if users and str(users[0].get("content", "")).startswith(SUB_AGENT_MARKER):
        return "sub"
    return "main"


class StandInServer:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._calls = 0
        app = FastAPI()
        app.post("/v1/chat/completions")(self._complete)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StandInServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def requests(self, route: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [s.body for s in self.seen if route is None or s.route == route]

    def _next(self, route: str) -> Step:
        if route == "summary":
            return text(self.script.summary)
        queue = self.script.main if route == "main" else self.script.sub
        if not queue:
            return text("(script exhausted)")
        if self.script.repeat_last and len(queue) == 1:
            return queue[0]
        return queue.popleft()

    async def _complete(self, request: Request) -> JSONResponse:
        body = await request.json()
        route = route_of(body)
        with self._lock:
            self.seen.append(Seen(route, body, request.headers.get("authorization")))
            step = self._next(route)
            self._calls += 1
            n = self._calls
        if step.kind == "error":
            return JSONResponse({"error": {"message": "scripted failure", "type": "server_error"}},
                                status_code=step.status)
        message: dict[str, Any] = {"role": "assistant", "content": step.text or None}
        if step.calls:
            message["tool_calls"] = [{"id": f"call_{n}_{i}", "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for i, (name, arguments) in enumerate(step.calls)]
        return JSONResponse({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if step.calls else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })
