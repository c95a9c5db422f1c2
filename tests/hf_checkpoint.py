"""A small Hugging Face-format Qwen2 checkpoint built in code: random-init weights, a real byte-level BPE
tokenizer trained on a few KB of text generated here, and a chat template of its own (tests/templates).

Nothing is downloaded. The tokenizer pipeline is the one `transformers` uses for `model_type == "qwen2"`
(NFC, Qwen2's split regex, ByteLevel), so `AutoTokenizer.from_pretrained(dir)` gives the same ids.
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

from gyre.model import TinyModelConfig, build_tiny_model
from gyre.model.tokenizer import QWEN2_SPLIT_REGEX, SPECIAL_TOKENS, TAG_TOKENS

TEMPLATES = Path(__file__).parent / "templates"
WORDS = (
    "the", "a", "file", "read", "write", "test", "function", "return", "value", "list", "path", "error", "agent",
    "model", "token", "call", "tool", "result", "python", "def", "class", "import", "print", "assert", "open",
    "close", "run", "check", "build", "train", "step", "loss", "reward", "branch", "tree", "cell", "proxy",
    "engine", "log", "event", "json", "name", "arguments", "content", "user", "assistant", "system", "hello",
    "world", "done",
)


def corpus(seed: int = 0, sentences: int = 300) -> list[str]:
    """A few KB of English-and-code-like text with JSON and tags, the shapes an agent conversation has."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(words.capitalize() + rng.choice([".", "?", ":", "!"]))
        if i % 5 == 0:
            lines.append(f'{{"name": "{rng.choice(WORDS)}", "arguments": {{"path": "{rng.choice(WORDS)}.py"}}}}')
        if i % 7 == 0:
            lines.append(f"def {rng.choice(WORDS)}(x):\n    return x + {i}\n")
    return lines


@lru_cache(maxsize=2)
def train_tokenizer(vocab_size: int = 700, seed: int = 0):  # -> PreTrainedTokenizerFast
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(fuse_unk=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        show_progress=False,
    )
    core.train_from_iterator(corpus(seed), trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def save_checkpoint(
    directory: Path, template: str = "qwen2_style", *, model_vocab: int | None = None, seed: int = 0
) -> Path:
    """Write weights, config and the BPE tokenizer with `tests/templates/<template>.jinja` as its template."""
    tokenizer = train_tokenizer()
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    vocab = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = TinyModelConfig(
        vocab_size=model_vocab or (vocab + 63) // 64 * 64,  # padded, as real checkpoints pad their vocabulary
        pad_token_id=ids[1],
        eos_token_ids=tuple(ids),
        tie_word_embeddings=True,
    )
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_model(seed, config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
