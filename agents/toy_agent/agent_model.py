"""The toy agent's model client: the official OpenAI SDK (or, with ``--client http``, the same requests over the
standard library), with the agent's own retry loop.

The SDK's built-in retries are switched off (`max_retries=0`) so that every retry is the agent's decision,
counted and logged: transient failures (connection, timeout, 429, 5xx, a reply without choices) are
retried with exponential backoff; anything else (400, 401, 404) stops the agent.

Why a second transport: importing the SDK costs ~0.55 s of CPU per process on these machines, over half of
what one execution of a learning run costs in all (engine, trainer and proxy included). ``--client http``
sends the identical Chat Completions request with `urllib` and reads the reply as JSON — what harnesses with
their own HTTP client do (Codex CLI) — so a run of thousands of short executions is not mostly imports.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Transient(Exception):
    """A failure worth retrying: the connection, a timeout, 429 or a 5xx."""


class Refused(Exception):
    """The API refused the request (400, 401, 404...): retrying would not help."""


class Transport(Protocol):
    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST /chat/completions; the reply as the API's JSON object. Raises `Transient` or `Refused`."""


class SdkTransport:
    """The official SDK; it reads OPENAI_BASE_URL and OPENAI_API_KEY itself."""

    def __init__(self, timeout_s: float) -> None:
        import openai  # here, not at the top: ``--client http`` never pays for the import

        self.openai = openai
        try:
            self.client = openai.OpenAI(max_retries=0, timeout=timeout_s)
        except openai.OpenAIError as e:  # no OPENAI_API_KEY
            raise Refused(str(e)) from e

    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        openai = self.openai
        try:
            return self.client.chat.completions.create(**request).model_dump()
        except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as e:
            raise Transient(f"{type(e).__name__}: {e}") from e  # APITimeoutError is an APIConnectionError
        except openai.APIError as e:
            raise Refused(f"{type(e).__name__}: {e}") from e


class HttpTransport:
    """The same request with `urllib`: OPENAI_BASE_URL (the SDK's default otherwise) and a Bearer OPENAI_API_KEY."""

    def __init__(self, timeout_s: float) -> None:
        key = os.environ.get("OPENAI_API_KEY")
        if not key:
            raise Refused("OPENAI_API_KEY is not set")
        base = os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        self.url = base.rstrip("/") + "/chat/completions"
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.timeout_s = timeout_s

    def create(self, request: dict[str, Any]) -> dict[str, Any]:
        post = urllib.request.Request(self.url, json.dumps(request).encode(), self.headers, method="POST")
        try:
            with urllib.request.urlopen(post, timeout=self.timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            detail = f"Error code: {e.code} - {e.read().decode(errors='replace')[:500]}"
            raise (Transient if e.code >= 500 or e.code == 429 else Refused)(detail) from e  # as SdkTransport
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise Transient(f"{type(e).__name__}: {e}") from e
        except json.JSONDecodeError as e:
            raise Transient(f"the reply is not JSON: {e}") from e


def connect(client: str, timeout_s: float) -> Transport:
    """The transport named by ``--client``; `Refused` when it cannot be built (no API key)."""
    return HttpTransport(timeout_s) if client == "http" else SdkTransport(timeout_s)


class ModelUnavailable(RuntimeError):
    """The model could not be reached after every retry, or refused the request outright."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None

    def as_message(self) -> dict[str, Any]:
        """The reply as the assistant message that continues the conversation (verbatim, for prefix reuse)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in self.tool_calls]
        return message


class ModelClient:
    def __init__(self, client: Transport, *, model: str, max_tokens: int, temperature: float | None,
                 max_retries: int, backoff_s: float, log: Callable[..., None]) -> None:
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.log = log
        self.calls = 0
        self.retries = 0

    def complete(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None, agent: str,
                 max_tokens: int | None = None) -> Reply:
        request: dict[str, Any] = {"model": self.model, "messages": messages,
                                   "max_tokens": max_tokens or self.max_tokens}
        if tools:
            request["tools"] = tools
        if self.temperature is not None:
            request["temperature"] = self.temperature
        attempt = 0
        while True:
            self.calls += 1
            try:
                response = self.client.create(request)
                if not response.get("choices"):
                    raise ModelUnavailable("the reply has no choices")
            except (Transient, ModelUnavailable) as e:
                if attempt >= self.max_retries:
                    raise ModelUnavailable(f"model call failed after {attempt + 1} attempts: {e}") from e
                delay = self.backoff_s * 2**attempt
                attempt += 1
                self.retries += 1
                self.log("retry", agent=agent, attempt=attempt, delay_s=delay, error=f"{type(e).__name__}: {e}")
                time.sleep(delay)
                continue
            except Refused as e:
                raise ModelUnavailable(f"model call refused: {e}") from e
            choice = response["choices"][0]
            message = choice["message"]
            calls = tuple(ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                          for c in (message.get("tool_calls") or []) if c.get("type") == "function")
            return Reply(message.get("content"), calls, choice.get("finish_reason"))
