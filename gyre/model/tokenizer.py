"""A byte-level tokenizer built in code: ids 0-255 are raw bytes, special tokens follow.

A pure byte vocabulary needs no training data or merges file; the price (one token per byte) is irrelevant
for a model this small. The pipeline (NFC normaliser, Qwen2's split regex, ByteLevel) is exactly the one
`transformers` forces on any `model_type == "qwen2"` directory through `AutoTokenizer` (`Qwen2Tokenizer`),
so a saved tiny model tokenizes identically however it is loaded. Consequence: `decode(encode(s))` equals
`unicodedata.normalize("NFC", s)`, which is `s` for NFC text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyre.model.chat_template import CHAT_TEMPLATE

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

#: Added tokens in id order, starting at 256. The ChatML markers and `<|endoftext|>` are *special*
#: (dropped by `skip_special_tokens`); the tool and think tags are ordinary added tokens, as in Qwen2.5,
#: so decoded text keeps them for the tool-call parser.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
BYTE_VOCAB_SIZE = 256
VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
PAD_TOKEN = "<|endoftext|>"
# Qwen2's pre-tokenizer split (transformers `models/qwen2/tokenization_qwen2.py`); harmless for a byte vocab.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
EOS_TOKEN = "<|im_end|>"
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN)
"""The special tokens `build_tokenizer` names (pad, eos): its `all_special_ids` are theirs."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of `ByteLevel`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_backend() -> Tokenizer:
    """The tiny tokenizer's `tokenizers` pipeline alone, which `build_tokenizer` wraps: the same ids both ways
    without importing `transformers` (~1 s of CPU, all a proxy process would import it for).

    Id of byte `b` is `b`; `<|endoftext|>` is 256 (pad), `<|im_start|>` 257, `<|im_end|>` 258 (eos).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_map = bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(BYTE_VOCAB_SIZE)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    assert core.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return core


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer as a `PreTrainedTokenizerFast` with the ChatML + tool-call chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_backend(),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    return tok
