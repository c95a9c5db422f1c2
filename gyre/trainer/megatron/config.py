"""Options of the Megatron backend (no megatron import: the record validates anywhere)."""

from dataclasses import dataclass, field
from typing import Literal

from gyre.trainer.config import GSPOConfig, OptimizerConfig
from gyre.trainer.errors import TrainerConfigError


@dataclass(frozen=True, kw_only=True)
class MegatronBackendConfig:
    """The Megatron backend: same loss and optimizer options as the torch backend, plus Megatron's own.

    ``device="cpu"`` runs the model path (forward, tree mask, loss, backward) for real on CPU; the optimizer
    and gradient reduction go through Megatron's ``DistributedDataParallel`` and ``get_megatron_optimizer``,
    which allocate CUDA buffers, so ``optimizer_step`` needs ``device="cuda"``.
    """

    loss: GSPOConfig = field(default_factory=GSPOConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    max_forward_tokens: int = 16_384
    max_attention_area: int = 1 << 24
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise TrainerConfigError(f"MegatronBackendConfig.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise TrainerConfigError(
                f"MegatronBackendConfig.dtype must be float32, float64 or bfloat16, got {self.dtype!r}"
            )
        if self.max_forward_tokens < 1 or self.max_attention_area < 1:
            raise TrainerConfigError("MegatronBackendConfig.max_forward_tokens and max_attention_area must be >= 1")
