"""The tiny tokenizer: exact byte-level round trips and a chat template that expresses tool calls."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.model import SPECIAL_TOKENS, build_tokenizer, save_tiny
from gyre.model.tokenizer import TAG_TOKENS, VOCAB_SIZE


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_ids_are_bytes_then_special_tokens(tok) -> None:
    assert len(tok) == VOCAB_SIZE
    assert tok.encode("A\n\xff", add_special_tokens=False) == [65, 10, 0xC3, 0xBF]
    for i, t in enumerate(SPECIAL_TOKENS + TAG_TOKENS):
        assert tok.convert_tokens_to_ids(t) == 256 + i
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text())
def test_text_round_trips(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.binary(max_size=64))
def test_byte_ids_decode_to_their_bytes(tok, data: bytes) -> None:
    """Any byte string, valid UTF-8 or not, decodes exactly when it is valid and never crashes otherwise."""
    text = tok.decode(list(data))
    try:
        assert text == data.decode("utf-8")
    except UnicodeDecodeError:
        assert isinstance(text, str)


def test_special_and_tag_tokens_are_single_ids(tok) -> None:
    ids = tok.encode("<|im_start|>x<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert ids == [257, 120, 259, 123, 125, 260, 258]
    assert tok.decode(ids, skip_special_tokens=True) == "x<tool_call>{}</tool_call>"


TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "sure",
            "tool_calls": [
                {"type": "function", "function": {"name": "ls", "arguments": {"path": "."}}},
                {"type": "function", "function": {"name": "ls", "arguments": '{"path": "src"}'}},
            ],
        },
        {"role": "tool", "content": "a.py"},
        {"role": "tool", "content": [{"type": "text", "text": "b.py"}]},
        {"role": "assistant", "content": "done"},
    ]


def test_chat_template_renders_roles_and_tool_calls(tok) -> None:
    text = tok.apply_chat_template(conversation(), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert (
        "<|im_start|>assistant\nsure"
        '<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>'
        '<tool_call>{"name": "ls", "arguments": {"path": "src"}}</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nb.py\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>assistant\ndone<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1


def test_chat_template_without_tools_or_system(tok) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_reply_rerenders_as_exact_extension(tok) -> None:
    """prompt + the model's own reply tokens + <|im_end|> == the re-rendered conversation (TITO-friendly)."""
    history = conversation()[:2]
    prompt = tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    reply = 'ok<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>'
    call = {"type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}
    full = tok.apply_chat_template(
        [*history, {"role": "assistant", "content": "ok", "tool_calls": [call]}], tools=TOOLS, tokenize=False
    )
    assert full == prompt + reply + "<|im_end|>\n"
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    reply_ids = tok.encode(reply + "<|im_end|>", add_special_tokens=False)
    assert tok.encode(full, add_special_tokens=False)[: len(prompt_ids) + len(reply_ids)] == prompt_ids + reply_ids


def test_saved_tokenizer_loads_identically_with_auto_tokenizer(tok, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    save_tiny(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    samples = ["héllo  世界 🚀\n\n x", "e\u0301 it's 123", "<|im_start|>a<tool_call>b</tool_call>"]
    for s in samples:
        assert loaded.encode(s, add_special_tokens=False) == tok.encode(s, add_special_tokens=False)
    msgs = conversation()
    assert loaded.apply_chat_template(msgs, tools=TOOLS, tokenize=False) == tok.apply_chat_template(
        msgs, tools=TOOLS, tokenize=False
    )
    assert loaded.eos_token_id == tok.eos_token_id
