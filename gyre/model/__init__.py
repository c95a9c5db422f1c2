"""The tiny Qwen2-architecture model and byte-level tokenizer that CPU tests and the demo share.

Everything is built in code from a seed; nothing is downloaded. `save_tiny(dir)` writes a directory that
`transformers` loads offline with `from_pretrained`.
"""

from gyre.model.config import TinyModelConfig
from gyre.model.tiny import build_tiny_model, load_tiny, save_tiny
from gyre.model.tokenizer import SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "TinyModelConfig",
    "build_tiny_model",
    "build_tokenizer",
    "load_tiny",
    "save_tiny",
]
