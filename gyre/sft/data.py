"""Demonstrations: OpenAI- or Anthropic-format conversations, rendered with the checkpoint's own chat template,
tokenized with a mask that is true on assistant tokens only (what the policy itself would have produced).

An assistant span is what the template adds after the generation prompt, up to and including ``<|im_end|>``
(the token the engine stops on); the newline the template writes after it is the next turn's, not the model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    assistant: list[bool]
    """Per token: true where the loss applies (assistant output)."""


def from_anthropic(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(OpenAI messages, OpenAI tools) of an Anthropic Messages record (system apart, content blocks)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for m in record["messages"]:
        content = m["content"]
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        text = "".join(b.get("text", "") for b in content if b["type"] == "text")
        if m["role"] == "assistant":
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}
                     for b in content if b["type"] == "tool_use"]
            messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        for b in content:
            if b["type"] == "tool_result":
                result = b["content"] if isinstance(b["content"], str) else "".join(
                    part.get("text", "") for part in b["content"])
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        if text:
            messages.append({"role": "user", "content": text})
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                               "parameters": t["input_schema"]}} for t in record.get("tools", [])]
    return messages, tools


def conversation(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) in the OpenAI format, whichever format the record is in."""
    if "system" in record or any(isinstance(m.get("content"), list) and m["content"]
                                 and isinstance(m["content"][0], dict) and "type" in m["content"][0]
                                 and m["content"][0]["type"] in ("tool_use", "tool_result")
                                 for m in record.get("messages", [])):
        messages, tools = from_anthropic(record)
        return messages, tools or None
    return record["messages"], record.get("tools") or None


def render(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> Example:
    """The conversation's tokens and assistant mask, rendered with ``tokenizer``'s chat template."""
    messages, tools = conversation(record)
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        if not full.startswith(upto) or not upto.startswith(prefix):
            raise ConfigError("the chat template does not render a conversation as a prefix of its continuation; "
                              "SFT needs the prefix property to find the assistant tokens")
        end = upto.rindex(END_OF_TURN, len(prefix)) + len(END_OF_TURN)
        spans.append((len(prefix), end))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in encoded["offset_mapping"]]
    return Example(list(encoded["input_ids"]), mask)


def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read demonstrations {path}: {e}") from e
    records = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e})") from e
    if not records:
        raise ConfigError(f"{path} holds no demonstrations")
    return records
