"""Branch kinds: which agent of an execution a call belongs to, and whether it is a compaction.

The rule (documented in docs/proxy.md):
1. A call that extends an earlier call (it has a parent) belongs to the parent's agent.
2. A new root belongs to the agent with the same *identity*: the text of its user messages before the first
   assistant turn and before a summary request (`Conversation.identity_text`: the task of the main agent,
   the assignment of a sub-agent). A summary request repeats the conversation it summarises, so it carries
   that conversation's identity even when its system prompt differs.
3. A new root with an unknown identity is: the agent of the execution's latest call when it is a summary
   request (a harness that quotes the conversation in one message, as opencode does, compacts right after
   that agent's step); the agent being continued after a compaction when its identity contains a
   *continuation marker* (the agent of the latest summary call); else the main agent when the execution has
   none yet; else a new sub-agent. Its identity is remembered for that agent.
4. The branch is the agent's kind (`main` | `sub-agent`), with `-summary` appended when the newest user or
   tool message contains a *summary-request marker* (the compaction instruction).

Markers are substrings, configurable (`MarkersConfig`); the defaults are Claude Code's, Codex CLI's and
opencode's compaction prompts.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from gyre.errors import ConfigError
from gyre.events.fields import BranchKind
from gyre.proxy.conversation import Conversation

CLAUDE_CODE_SUMMARY_REQUEST = "Your task is to create a detailed summary of the conversation so far"
CLAUDE_CODE_CONTINUATION = "This session is being continued from a previous conversation"
CODEX_SUMMARY_REQUEST = "You are performing a CONTEXT CHECKPOINT COMPACTION"
CODEX_CONTINUATION = "Another language model started to solve this problem and produced a summary"
OPENCODE_SUMMARY_REQUEST = "Create a new anchored summary from the conversation history"
OPENCODE_CONTINUATION = "What did we do so far?"


class MarkersConfig(BaseModel):
    """Substrings that identify compaction: the instruction to summarise, and the summary's continuation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    summary_request: tuple[str, ...] = (CLAUDE_CODE_SUMMARY_REQUEST, CODEX_SUMMARY_REQUEST, OPENCODE_SUMMARY_REQUEST)
    summary_continuation: tuple[str, ...] = (CLAUDE_CODE_CONTINUATION, CODEX_CONTINUATION, OPENCODE_CONTINUATION)

    @classmethod
    def load(cls, path: str | Path) -> MarkersConfig:
        """From a `.json` or `.toml` file with the two lists (either may be omitted)."""
        path = Path(path)
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
            return cls.model_validate(data)
        except (OSError, ValueError, ValidationError) as e:
            raise ConfigError(f"markers config {path}: {e}") from e

    def is_summary_request(self, text: str) -> bool:
        return any(m in text for m in self.summary_request)

    def is_continuation(self, text: str) -> bool:
        return any(m in text for m in self.summary_continuation)


@dataclass(eq=False)
class Agent:
    name: str
    kind: Literal["main", "sub-agent"]


class AgentBook:
    """The agents of one execution and the identities that lead to them."""

    def __init__(self, markers: MarkersConfig) -> None:
        self.markers = markers
        self._by_identity: dict[str, Agent] = {}
        self._main: Agent | None = None
        self._last_summarised: Agent | None = None
        self._latest: Agent | None = None
        self._sub_agents = 0

    def classify(self, conversation: Conversation, parent_agent: Agent | None) -> tuple[Agent, BranchKind]:
        summary = self.markers.is_summary_request(conversation.last_request_text())
        if parent_agent is not None:
            agent = parent_agent
        else:
            identity = conversation.identity_text(self.markers.is_summary_request)
            agent = self._root_agent(identity, summary)
        if summary:
            self._last_summarised = agent
        self._latest = agent
        if agent.kind == "main":
            return agent, "main-summary" if summary else "main"
        return agent, "sub-agent-summary" if summary else "sub-agent"

    def _root_agent(self, identity: str, summary: bool) -> Agent:
        agent = self._by_identity.get(identity)
        if agent is not None:
            return agent
        if summary and self._latest is not None:
            return self._latest  # a summary request quoting the conversation in one message (opencode)
        if self._last_summarised is not None and self.markers.is_continuation(identity):
            agent = self._last_summarised
        elif self._main is None:
            agent = self._main = Agent("main", "main")
        else:
            self._sub_agents += 1
            agent = Agent(f"sub-agent-{self._sub_agents}", "sub-agent")
        self._by_identity[identity] = agent
        return agent
