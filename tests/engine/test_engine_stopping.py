"""Finish rules: stop tokens (EOS unless ignored), stop strings across multi-byte tokens, length; text trim."""

from __future__ import annotations

import pytest

from gyre.engine.local.stopping import StopChecker, visible_text
from gyre.engine.protocol import FinishReason, SamplingParams
from gyre.model import build_tokenizer

TOK = build_tokenizer()
EOS = frozenset({258, 256})


def decode(ids) -> str:
    return TOK.decode(list(ids))


def run(params: SamplingParams, ids: list[int]) -> tuple[int, FinishReason | None]:
    """Feed ids one at a time, as the scheduler does; returns how many were consumed and why it stopped."""
    checker = StopChecker(params, EOS, decode)
    for n in range(1, len(ids) + 1):
        finish = checker.check(ids[:n])
        if finish is not None:
            return n, finish
    return len(ids), None


def test_eos_stops_unless_ignored() -> None:
    ids = [*b"ab", 258, *b"cd"]
    assert run(SamplingParams(), ids) == (3, FinishReason(type="stop", matched=258))
    assert run(SamplingParams(ignore_eos=True), ids) == (5, None)
    assert run(SamplingParams(ignore_eos=True, stop_token_ids=[99]), ids) == (4, FinishReason(type="stop", matched=99))


def test_multibyte_stop_string_spanning_many_byte_tokens() -> None:
    ids = list("前言世界后".encode())
    n, finish = run(SamplingParams(stop="世界"), ids)
    assert finish == FinishReason(type="stop", matched="世界")
    assert n == len("前言世界".encode())


def test_length_after_stop_checks() -> None:
    assert run(SamplingParams(max_new_tokens=3), list(b"abcdef")) == (3, FinishReason(type="length", length=3))
    # a stop token on the last allowed position reports the stop, which is more informative
    assert run(SamplingParams(max_new_tokens=3), [*b"ab", 258]) == (3, FinishReason(type="stop", matched=258))


@pytest.mark.parametrize(
    ("params", "finish", "text"),
    [
        (SamplingParams(), FinishReason(type="stop", matched=258), "hi!"),
        (
            SamplingParams(no_stop_trim=True, skip_special_tokens=False),
            FinishReason(type="stop", matched=258),
            "hi!<|im_end|>",
        ),
        (SamplingParams(stop="!"), FinishReason(type="stop", matched="!"), "hi"),
        (SamplingParams(stop="!", no_stop_trim=True), FinishReason(type="stop", matched="!"), "hi!"),
    ],
)
def test_visible_text_trims_the_match(params, finish, text) -> None:
    ids = [*b"hi!", 258]
    if isinstance(finish.matched, str):
        ids = list(b"hi!")
    out = visible_text(
        ids, finish, params, lambda x: TOK.decode(list(x), skip_special_tokens=params.skip_special_tokens)
    )
    assert out == text
