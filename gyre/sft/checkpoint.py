"""The starting checkpoint of a warm start: a byte-level BPE tokenizer trained here on the demonstrations,
saved with the Qwen-style chat template, and a random-init tiny Qwen2 sized by the config — a Hugging Face
checkpoint directory, the path a downloaded model would take.

The tokenizer pipeline is the one `transformers` uses for ``model_type == "qwen2"`` (NFC, a split regex,
ByteLevel), with the ChatML markers as special tokens and the tool tags as added ones, as in Qwen2.5. The split
differs from Qwen2's in one way, because a 1M-parameter model must copy and transform words it never saw:
only the protocol's frequent words (in at least ``word_share`` of the texts: the system prompt, tool schemas,
task wording) are pieces of their own; every other letter, and every digit, is a token by itself. A held-out
word is then the same character tokens wherever it appears (tool result, tool-call argument, answer), so
copying it is attention, not memory, and upper-casing it is a per-character map. Qwen2's regex would glue a
quote or space to the word and merge its letters into pieces learned on training words only.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.model import TinyModelConfig, build_tiny_model
from gyre.model.chat_template import CHAT_TEMPLATE
from gyre.model.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, TAG_TOKENS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


WORD_SHARE = 0.05
"""A word in at least this share of the texts is a piece of its own (protocol wording); rarer words are spelled."""
_WORD = re.compile(r"[^\W\d_]+")


def split_regex(texts: list[str], word_share: float = WORD_SHARE) -> str:
    """The pre-tokenizer split: frequent words whole (with one leading non-letter, as Qwen2 glues it), any other
    letter or digit alone, punctuation runs and whitespace as Qwen2 splits them."""
    counts = Counter(w for text in texts for w in set(_WORD.findall(text)))
    words = sorted((w for w, n in counts.items() if n >= word_share * len(texts)), key=lambda w: (-len(w), w))
    alternatives = []
    if words:
        group = "(?:" + "|".join(re.escape(w) for w in words) + r")(?!\p{L})"
        alternatives += [r"[^\r\n\p{L}\p{N}]" + group, r"(?<!\p{L})" + group]
    return "|".join([*alternatives, r"\p{L}", r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)",
                     r"\s+"])


def train_bpe(texts: Iterable[str], vocab_size: int, word_share: float = WORD_SHARE) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on ``texts``, split by `split_regex`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts)
    core = Tokenizer(models.BPE(fuse_unk=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex(texts, word_share)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(t, special=True, normalized=False)
                                                  for t in SPECIAL_TOKENS], show_progress=False)
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                   model_max_length=131072)


def save_base(directory: Path, texts: Iterable[str], *, vocab_size: int, seed: int, hidden_size: int,
              layers: int, heads: int, kv_heads: int, intermediate_size: int, context: int) -> Path:
    """Tokenizer + random-init model + configs in ``directory`` (an HF checkpoint `load_tiny` reads)."""
    tokenizer = train_bpe(texts, vocab_size)
    ids = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    config = TinyModelConfig(vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=hidden_size,
                             intermediate_size=intermediate_size, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=context, pad_token_id=ids[1], eos_token_ids=tuple(ids),
                             initializer_range=0.02)  # trained from scratch by SFT: the usual init, not the toy's 0.1
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_model(seed, config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
