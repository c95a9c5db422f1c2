"""`TokenCodec.tiny` (the tokenizers pipeline alone, no `transformers` in the proxy process) against the codec of
the wrapped tokenizer: the same ids, texts, bytes, special ids and renderer, and `transformers` left unimported."""

from __future__ import annotations

import subprocess
import sys
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.model.chat_template import CHAT_TEMPLATE
from gyre.model.tokenizer import SPECIAL_TOKENS, TAG_TOKENS, VOCAB_SIZE, build_tokenizer
from gyre.proxy.render import ChatMLRenderer
from gyre.proxy.template_render import codec_renderer
from gyre.proxy.tokens import TokenCodec

WRAPPED = TokenCodec(build_tokenizer())
TINY = TokenCodec.load("tiny")
MARKED = "".join(SPECIAL_TOKENS + TAG_TOKENS)


def test_the_tiny_codec_has_the_wrapped_ones_special_ids_template_and_renderer() -> None:
    assert TINY.special_ids == WRAPPED.special_ids == frozenset({256, 258})
    assert TINY.chat_template == WRAPPED.chat_template == CHAT_TEMPLATE and TINY.stop_texts == WRAPPED.stop_texts
    assert isinstance(codec_renderer(TINY), ChatMLRenderer) and isinstance(codec_renderer(WRAPPED), ChatMLRenderer)
    assert [TINY.token_text(i) for i in range(VOCAB_SIZE)] == [WRAPPED.token_text(i) for i in range(VOCAB_SIZE)]
    assert [TINY.token_bytes(i) for i in range(VOCAB_SIZE)] == [WRAPPED.token_bytes(i) for i in range(VOCAB_SIZE)]
    assert len(TINY.tokenizer) == VOCAB_SIZE  # built on demand, the same tokenizer


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_TOKENS + TAG_TOKENS)), max_size=6),
       st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=24))
def test_the_tiny_codec_encodes_and_decodes_as_the_wrapped_one(parts: list[str], ids: list[int]) -> None:
    text = "".join(parts)
    assert TINY.encode(text) == WRAPPED.encode(text)
    assert TINY.encode_many([text, MARKED, text[:7]]) == WRAPPED.encode_many([text, MARKED, text[:7]])
    assert TINY.decode(TINY.encode(text)) == unicodedata.normalize("NFC", text)
    assert TINY.decode(ids) == WRAPPED.decode(ids)


def test_a_proxy_on_the_tiny_tokenizer_imports_no_transformers() -> None:
    probe = ("import sys; from gyre.proxy.tokens import TokenCodec; from gyre.proxy.template_render import "
             "codec_renderer; codec_renderer(TokenCodec.load('tiny')); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
