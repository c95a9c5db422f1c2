"""Shape of the tiny model: a frozen, validated record that maps one-to-one onto a `Qwen2Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Config


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Qwen2 hyper-parameters small enough for CPU tests (~0.5M parameters at the defaults).

    `initializer_range` is larger than Qwen's 0.02 on purpose: with tiny random weights every next-token
    distribution is almost flat, so greedy decoding would hinge on near-ties that float noise can flip.
    """

    vocab_size: int
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 131072
    """128K, so a real Claude Code prompt (~49K byte-level tokens) fits."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.1
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("TinyModelConfig.hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("TinyModelConfig.num_attention_heads must be divisible by num_key_value_heads")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("TinyModelConfig: head_dim must be even for rotary embeddings")

    def to_hf(self) -> Qwen2Config:
        """The equivalent `transformers.Qwen2Config` (eager attention, so the reference path is plain math)."""
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_ids) or None,
            attn_implementation="eager",
        )
