"""Build, save and load the tiny model; the same seed always yields the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gyre.model.config import TinyModelConfig
from gyre.model.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

PAD_TOKEN_ID = 256 + SPECIAL_TOKENS.index(PAD_TOKEN)
EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index(EOS_TOKEN)


def default_config() -> TinyModelConfig:
    """The config matching `build_tokenizer()`. Generation stops on `<|im_end|>` and `<|endoftext|>`, as Qwen's."""
    return TinyModelConfig(vocab_size=VOCAB_SIZE, pad_token_id=PAD_TOKEN_ID, eos_token_ids=(EOS_TOKEN_ID, PAD_TOKEN_ID))


def build_tiny_model(seed: int = 0, config: TinyModelConfig | None = None) -> Qwen2ForCausalLM:
    """A randomly initialised `Qwen2ForCausalLM` in eval mode, float32, deterministic for `seed`.

    The global torch RNG is forked, so building a model does not disturb the caller's random stream.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = config or default_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg.to_hf())
    return model.eval()


def save_tiny(directory: str | Path, seed: int = 0, config: TinyModelConfig | None = None) -> Path:
    """Write model weights (safetensors), config and tokenizer so `from_pretrained(directory)` works offline."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_model(seed, config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def load_tiny(directory: str | Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Load a directory written by `save_tiny` (or any Qwen2 checkpoint) without touching the network."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(directory, attn_implementation="eager", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model.eval(), tokenizer
