"""Branch kinds: sub-agents and post-compaction conversations are new roots of the right kind; summary calls
are `*-summary`; configurable markers."""

from __future__ import annotations

from pathlib import Path

import anthropic
import pytest

from gyre.errors import ConfigError
from gyre.proxy import MarkersConfig
from gyre.proxy.branches import (
    CLAUDE_CODE_CONTINUATION,
    CLAUDE_CODE_SUMMARY_REQUEST,
    CODEX_CONTINUATION,
    CODEX_SUMMARY_REQUEST,
    OPENCODE_CONTINUATION,
    OPENCODE_SUMMARY_REQUEST,
    AgentBook,
)
from gyre.proxy.conversation import Conversation, Message
from tests.proxy.proxy_helpers import TOKEN

MAIN = "You are the main agent."
SUB = "You are a search sub-agent."


def _conv(*messages: tuple[str, str]) -> Conversation:
    return Conversation(tuple(Message(r, t) for r, t in messages))  # type: ignore[arg-type]


def test_rule_on_conversations() -> None:
    book = AgentBook(MarkersConfig())
    main, branch = book.classify(_conv(("system", MAIN), ("user", "fix it")), None)
    assert branch == "main"
    sub, branch = book.classify(_conv(("system", SUB), ("user", "find x")), None)
    assert branch == "sub-agent" and sub is not main
    assert book.classify(_conv(("system", "other system"), ("user", "fix it")), None) == (main, "main")
    summary = _conv(("system", "Summarise."), ("user", "fix it"), ("user", CLAUDE_CODE_SUMMARY_REQUEST + "."))
    assert book.classify(summary, None) == (main, "main-summary")
    after = _conv(("system", MAIN), ("user", CLAUDE_CODE_CONTINUATION + " that ran out of context. S"))
    assert book.classify(after, None) == (main, "main")
    assert book.classify(_conv(("user", "child")), sub) == (sub, "sub-agent")
    sub_summary = _conv(("user", "find x"), ("user", CLAUDE_CODE_SUMMARY_REQUEST))
    assert book.classify(sub_summary, sub) == (sub, "sub-agent-summary")


def test_rule_on_codex_shaped_conversations() -> None:
    """Codex CLI sends its environment as a user message of its own before the task: the identity is the
    user messages before the first reply, so a sub-agent (same environment, its own assignment) is not the
    main agent; its compaction prompts are default markers."""
    book = AgentBook(MarkersConfig())
    env = ("user", "<environment_context><cwd>/w</cwd></environment_context>")
    main, branch = book.classify(_conv(("system", MAIN), env, ("user", "fix it")), None)
    assert branch == "main"
    sub, branch = book.classify(_conv(("system", MAIN), env, ("user", "find x")), None)
    assert branch == "sub-agent" and sub is not main
    summary = _conv(("system", MAIN), env, ("user", "fix it"), ("assistant", "ok"), ("user", CODEX_SUMMARY_REQUEST))
    assert book.classify(summary, main) == (main, "main-summary")
    resumed = _conv(("system", MAIN), env, ("user", "fix it"), ("user", CODEX_CONTINUATION + " of the task: S"))
    assert book.classify(resumed, None) == (main, "main")


def test_rule_on_opencode_shaped_compaction() -> None:
    """opencode's summary request quotes the conversation in one user message under its own system prompt: it
    belongs to the agent of the latest call; the conversation it continues with is that agent's new root."""
    book = AgentBook(MarkersConfig())
    main, _ = book.classify(_conv(("system", MAIN), ("user", "fix it")), None)
    sub, _ = book.classify(_conv(("system", SUB), ("user", "find x")), None)
    book.classify(_conv(("user", "find x"), ("assistant", "found"), ("user", "more")), sub)
    quoted = _conv(("system", "Summarise."), ("user", "<conversation>[User]: find x</conversation>\n"
                                                      + OPENCODE_SUMMARY_REQUEST + "."))
    assert book.classify(quoted, None) == (sub, "sub-agent-summary")
    resumed = _conv(("system", SUB), ("user", OPENCODE_CONTINUATION), ("assistant", "S"), ("user", "Continue."))
    assert book.classify(resumed, None) == (sub, "sub-agent")
    book.classify(_conv(("user", "fix it"), ("assistant", "a"), ("user", "b")), main)
    assert book.classify(quoted, None) == (main, "main-summary")  # not remembered: the agent that just ran


def test_markers_load_and_reject(tmp_path: Path) -> None:
    good = tmp_path / "m.toml"
    good.write_text('summary_request = ["SUMMARISE NOW"]\n')
    markers = MarkersConfig.load(good)
    assert markers.summary_request == ("SUMMARISE NOW",)
    assert markers.summary_continuation == (CLAUDE_CODE_CONTINUATION, CODEX_CONTINUATION, OPENCODE_CONTINUATION)
    bad = tmp_path / "m.json"
    bad.write_text('{"summary_requests": ["x"]}')
    with pytest.raises(ConfigError, match="summary_requests"):
        MarkersConfig.load(bad)


def test_claude_code_like_session(scripted, start_proxy) -> None:
    p = start_proxy({"cell0": scripted.url})
    client = anthropic.Anthropic(base_url=p.url, auth_token=TOKEN, max_retries=0, timeout=30)

    def ask(system: str, messages: list) -> str:
        scripted.say(f"reply {len(scripted.requests)}")
        message = client.messages.create(model="c", max_tokens=100, system=system, messages=messages)
        return message.content[0].text

    main: list = [{"role": "user", "content": "Fix the failing test"}]
    main.append({"role": "assistant", "content": ask(MAIN, main)})  # 0 main root
    main.append({"role": "user", "content": "tool output"})
    main.append({"role": "assistant", "content": ask(MAIN, main)})  # 1 main child
    sub: list = [{"role": "user", "content": "Find where parse() is defined"}]
    sub.append({"role": "assistant", "content": ask(SUB, sub)})  # 2 sub-agent root
    sub.append({"role": "user", "content": "grep result"})
    ask(SUB, sub)  # 3 sub-agent child
    summary_request = [*main, {"role": "user", "content": CLAUDE_CODE_SUMMARY_REQUEST + ". Be thorough."}]
    summary = ask("You summarise conversations.", summary_request)  # 4 main-summary root
    resumed: list = [{"role": "user", "content": f"{CLAUDE_CODE_CONTINUATION} that ran out of context. {summary}"}]
    resumed.append({"role": "assistant", "content": ask(MAIN, resumed)})  # 5 main root
    resumed.append({"role": "user", "content": "next"})
    resumed.append({"role": "assistant", "content": ask(MAIN, resumed)})  # 6 main child
    ask(MAIN, [*resumed, {"role": "user", "content": CLAUDE_CODE_SUMMARY_REQUEST}])  # 7 main-summary child

    calls = p.events("model_call_finished")
    ids = [c.call_id for c in calls]
    assert [c.branch for c in calls] == [
        "main",
        "main",
        "sub-agent",
        "sub-agent",
        "main-summary",
        "main",
        "main",
        "main-summary",
    ]
    assert [c.parent_call_id for c in calls] == [None, ids[0], None, ids[2], None, None, ids[5], ids[6]]
    started = p.events("model_call_started")
    assert [s.branch for s in started] == [c.branch for c in calls]
