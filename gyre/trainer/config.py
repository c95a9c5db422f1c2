"""Options of the trainer: frozen, keyword-only records, validated once when built.

``GSPOConfig`` shapes the loss, ``OptimizerConfig`` the AdamW step, ``TorchBackendConfig`` the torch backend.
They hold no behaviour; the components that use them are built from them.
"""

from dataclasses import dataclass, field
from typing import Literal

from gyre.trainer.errors import TrainerConfigError

DType = Literal["float32", "float64", "bfloat16"]
Attention = Literal["tree", "dense"]


@dataclass(frozen=True, kw_only=True)
class GSPOConfig:
    """The GSPO objective (arXiv 2507.18071) as Gyre trains it.

    ``eps_low`` / ``eps_high`` bound the sequence ratio's clip range ``[1 - eps_low, 1 + eps_high]``; the paper
    used 3e-4 / 4e-4 (GRPO's 0.2 / 0.27 are far too wide for a length-normalised ratio). ``tis_cap`` truncates
    the importance weight of a sequence at ``C`` (truncated importance sampling): behaviour log-probs come from
    the inference engine, so the ratio also measures the engine/trainer mismatch, and on the side the clip
    leaves open (negative advantage, ratio above ``1 + eps_high``) it would otherwise be unbounded. ``None``
    turns it off. ``max_log_ratio`` clamps the mean log-ratio before ``exp`` so a corrupt log-prob cannot
    overflow (verl clamps at 10 as well). There is no KL term: the batch carries no reference log-probs and
    GSPO is run with beta = 0.
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    tis_cap: float | None = 2.0
    max_log_ratio: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise TrainerConfigError(f"GSPOConfig.eps_low must be within [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0:
            raise TrainerConfigError(f"GSPOConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.tis_cap is not None and not self.tis_cap >= 1 + self.eps_high:
            raise TrainerConfigError(
                f"GSPOConfig.tis_cap must be >= 1 + eps_high (or None to turn TIS off), got {self.tis_cap}"
            )
        if not self.max_log_ratio > 0:
            raise TrainerConfigError(f"GSPOConfig.max_log_ratio must be > 0, got {self.max_log_ratio}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with global-norm gradient clipping; ``max_grad_norm=None`` disables clipping.

    ``weight_decay`` applies to matrices (embeddings, projections) only, never to biases or norm scales, as
    Megatron's optimizer does, so both backends take the same step.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise TrainerConfigError(f"OptimizerConfig.lr must be > 0, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise TrainerConfigError(f"OptimizerConfig.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise TrainerConfigError(f"OptimizerConfig.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise TrainerConfigError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise TrainerConfigError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


@dataclass(frozen=True, kw_only=True)
class TorchBackendConfig:
    """How the torch backend runs a micro-batch.

    ``attention = "tree"`` (default) runs flat passes under gyre's sparse tree attention: memory linear in
    tokens, queries scored in chunks of ``attention_chunk`` against their ancestors only. ``"dense"`` is the
    reference: padded passes with a ``[B, 1, L, L]`` additive mask through the HF kernel
    ``attn_implementation`` (``None`` keeps the model's: the tiny model uses ``eager``; it must accept a 4D
    mask). ``max_forward_tokens`` bounds the (padded) tokens of one forward pass, hence the activation memory
    of a pass, and for dense passes ``max_attention_area`` their score entries (``B * L * L``); each pass runs
    forward, loss and backward before the next, so activation memory is per pass, not per micro-batch. A block
    (one tree) longer than the limits gets a pass of its own: the trajectory processor's ``token_budget``
    is what bounds it, and ``max_micro_batch_tokens`` (``None``: no limit) makes the trainer refuse a
    micro-batch that forwards more, so a mis-sized batch fails with a clear error instead of running out of
    memory (peak memory grows linearly with forwarded tokens; ``docs/trainer.md`` gives the rate).
    ``dtype`` casts the model (``None`` keeps it).
    """

    loss: GSPOConfig = field(default_factory=GSPOConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    max_forward_tokens: int = 16_384
    max_attention_area: int = 1 << 24
    dtype: DType | None = None
    device: str = "cpu"
    attn_implementation: str | None = None
    attention: Attention = "tree"
    attention_chunk: int = 256
    max_micro_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("tree", "dense"):
            raise TrainerConfigError(f"TorchBackendConfig.attention must be 'tree' or 'dense', got {self.attention!r}")
        if self.attention_chunk < 1:
            raise TrainerConfigError(f"TorchBackendConfig.attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.max_micro_batch_tokens is not None and self.max_micro_batch_tokens < 1:
            raise TrainerConfigError(
                f"TorchBackendConfig.max_micro_batch_tokens must be >= 1 or None, got {self.max_micro_batch_tokens}"
            )
        if self.attention == "tree" and self.attn_implementation is not None:
            raise TrainerConfigError(
                "TorchBackendConfig.attn_implementation picks the kernel of attention='dense'; "
                f"with attention='tree' leave it None (got {self.attn_implementation!r})"
            )
        if self.max_forward_tokens < 1:
            raise TrainerConfigError(
                f"TorchBackendConfig.max_forward_tokens must be >= 1, got {self.max_forward_tokens}"
            )
        if self.max_attention_area < 1:
            raise TrainerConfigError(
                f"TorchBackendConfig.max_attention_area must be >= 1, got {self.max_attention_area}"
            )
        if self.dtype not in (None, "float32", "float64", "bfloat16"):
            raise TrainerConfigError(
                f"TorchBackendConfig.dtype must be float32, float64, bfloat16 or None, got {self.dtype!r}"
            )
