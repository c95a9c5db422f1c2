"""The toy agent's model client: the official OpenAI SDK, with the agent's own retry loop.

The SDK's built-in retries are switched off (`max_retries=0`) so that every retry is the agent's decision,
counted and logged: transient failures (connection, timeout, 429, 5xx, a reply without choices) are
retried with exponential backoff; anything else (400, 401, 404) stops the agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai

RETRYABLE = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)
"""APITimeoutError is an APIConnectionError; InternalServerError covers every 5xx status."""


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
    def __init__(self, client: openai.OpenAI, *, model: str, max_tokens: int, temperature: float | None,
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
                response = self.client.chat.completions.create(**request)
                if not response.choices:
                    raise ModelUnavailable("the reply has no choices")
            except (*RETRYABLE, ModelUnavailable) as e:
                if attempt >= self.max_retries:
                    raise ModelUnavailable(f"model call failed after {attempt + 1} attempts: {e}") from e
                delay = self.backoff_s * 2**attempt
                attempt += 1
                self.retries += 1
                self.log("retry", agent=agent, attempt=attempt, delay_s=delay, error=f"{type(e).__name__}: {e}")
                time.sleep(delay)
                continue
            except openai.APIError as e:
                raise ModelUnavailable(f"model call refused: {type(e).__name__}: {e}") from e
            choice = response.choices[0]
            calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments)
                          for c in (choice.message.tool_calls or []) if c.type == "function")
            return Reply(choice.message.content, calls, choice.finish_reason)
