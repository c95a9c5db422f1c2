"""Text <-> token ids for the proxy, through the `tokenizers` backend (no torch, no Python-side loops).

The proxy encodes only what it renders new and decodes only what the model wrote; it never decodes a
recorded prompt to re-encode it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.model.checkpoint import check_vocabulary, read_checkpoint_info, stop_texts
from gyre.proxy.bytelevel import byte_level_bytes

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

TINY_TOKENIZER = "tiny"
SHORT_UNIT_CHARS = 64
SHORT_UNITS_KEPT = 4096
"""Units this short are kept encoded (at most this many; all forgotten when full): most are the template's
own, the same on every call (an assistant turn's generation prompt), and a tokenizer call costs ~10 us
however short its text (more from a cold cache), a lookup well under 1 us. Tokenizing is deterministic,
so a kept encoding is the one a new call would give."""


class TokenCodec:
    """Encode/decode with special tokens kept as text, so a reply decodes to what the template renders."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_texts: tuple[str, ...] = ()) -> None:
        backend: Tokenizer | None = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("the proxy needs a fast (Rust `tokenizers`) tokenizer")
        self._setup(backend, tokenizer.all_special_ids, getattr(tokenizer, "chat_template", None), stop_texts)
        self._tokenizer: PreTrainedTokenizerBase | None = tokenizer

    def _setup(self, backend: Tokenizer, special_ids: Iterable[int], chat_template: str | None,
               stop_texts: tuple[str, ...]) -> None:
        self._backend = backend
        self.special_ids = frozenset(int(i) for i in special_ids)
        self.chat_template = chat_template
        self._short: dict[str, tuple[int, ...]] = {}
        self.stop_texts = stop_texts
        """Texts of the model's stop tokens, when known (a checkpoint directory says): the chat template must
        end a turn with one of them."""

    @classmethod
    def tiny(cls) -> TokenCodec:
        """The in-code tiny tokenizer straight from its `tokenizers` pipeline (`build_backend`): the same ids as
        `TokenCodec(build_tokenizer())`, but a proxy serving it never imports `transformers` (~1 s of CPU in
        every proxy process); `tokenizer` builds the wrapped one only if something asks for it."""
        from gyre.model.chat_template import CHAT_TEMPLATE
        from gyre.model.tokenizer import NAMED_SPECIAL_TOKENS, build_backend

        codec = cls.__new__(cls)
        backend = build_backend()
        codec._setup(backend, [backend.token_to_id(t) for t in NAMED_SPECIAL_TOKENS], CHAT_TEMPLATE, ())
        codec._tokenizer = None
        return codec

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The Hugging Face tokenizer (its chat template, its vocabulary); built on first use by `tiny`."""
        if self._tokenizer is None:
            from gyre.model.tokenizer import build_tokenizer

            self._tokenizer = build_tokenizer()
        return self._tokenizer

    @classmethod
    def load(cls, name: str) -> TokenCodec:
        """`"tiny"` (the in-code tiny tokenizer) or a local tokenizer or checkpoint directory; nothing is
        downloaded. A checkpoint directory's tokenizer is checked against its model's vocabulary."""
        if name == TINY_TOKENIZER:
            return cls.tiny()
        from transformers import AutoTokenizer

        if not Path(name).is_dir():
            raise FileNotFoundError(f"tokenizer {name!r} is neither 'tiny' nor a local directory")
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        info = read_checkpoint_info(name)
        if info is not None:
            check_vocabulary(tokenizer, info.vocab_size, f"checkpoint {name}")
        return cls(tokenizer, stop_texts(tokenizer, info) if info is not None else ())

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        # the `_fast` batch skips the character offsets that `encode` tracks and the proxy never reads:
        # ~25% less CPU for a call's new units, even for one text. One text per batch: a batch of several
        # goes to the tokenizer's thread pool, which for a call's few short texts costs more CPU than it
        # saves and holds the event loop waiting for the other threads (~140 -> ~115 us for a call's two)
        encode = self._backend.encode_batch_fast
        out = []
        for text in texts:
            if len(text) > SHORT_UNIT_CHARS:
                out.append(encode([text], add_special_tokens=False)[0].ids)
                continue
            ids = self._short.get(text)
            if ids is None:
                if len(self._short) >= SHORT_UNITS_KEPT:
                    self._short.clear()
                ids = self._short[text] = tuple(encode([text], add_special_tokens=False)[0].ids)
            out.append(list(ids))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """UTF-8 bytes of one token as OpenAI logprobs report them (byte-level tokens may be partial chars)."""
        piece = self._backend.id_to_token(token_id)
        return b"" if piece is None else byte_level_bytes(piece)
