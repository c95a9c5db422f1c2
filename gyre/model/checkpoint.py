"""What a Hugging Face checkpoint directory says about itself that every component must agree on.

The engine, the proxy's renderer and the trainer each load the directory; a tokenizer whose ids run past
the model's embedding, or a chat template that ends turns on a token the model never stops on, would make
them disagree silently. These checks make it a clear error at start instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    directory: Path
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context_length: int | None


def read_checkpoint_info(directory: str | Path) -> CheckpointInfo | None:
    """`config.json` (+ `generation_config.json`) of a checkpoint directory; None when there is none."""
    path = Path(directory)
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {path}: cannot read its config: {e}") from e
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ConfigError(f"checkpoint {path}: config.json has no positive vocab_size")
    eos: set[int] = set()
    for source in (config.get("eos_token_id"), generation.get("eos_token_id")):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list):
            eos.update(int(i) for i in source)
    context = config.get("max_position_embeddings")
    return CheckpointInfo(path, vocab, tuple(sorted(eos)), context if isinstance(context, int) else None)


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, vocab_size: int, where: str) -> None:
    """Every id the tokenizer can produce must index the model's embedding (models may pad theirs)."""
    size = len(tokenizer)
    if size > vocab_size:
        raise ConfigError(
            f"{where}: the tokenizer has {size} tokens but the model's vocabulary has {vocab_size}: "
            f"ids {vocab_size}..{size - 1} would index past the embedding (wrong tokenizer for these weights?)"
        )


def stop_texts(tokenizer: PreTrainedTokenizerBase, info: CheckpointInfo | None) -> tuple[str, ...]:
    """The texts of the tokens generation stops on (the checkpoint's eos ids, else the tokenizer's eos)."""
    ids = list(info.eos_token_ids) if info is not None and info.eos_token_ids else []
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return tuple(tokenizer.convert_ids_to_tokens(ids))
