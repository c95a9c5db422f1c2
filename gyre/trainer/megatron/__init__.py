"""The Megatron-core trainer backend (Qwen2 architecture, tp = pp = 1).

Importable without megatron-core or CUDA: megatron is imported when a runtime or backend is built, and a
missing package or GPU is a ``BackendUnavailableError`` that says what to use instead.
"""

from gyre.trainer.megatron.backend import MegatronBackend
from gyre.trainer.megatron.config import MegatronBackendConfig
from gyre.trainer.megatron.runtime import MegatronRuntime, require_cuda, require_megatron
from gyre.trainer.megatron.weights import Shape, to_hf, to_megatron

__all__ = [
    "MegatronBackend",
    "MegatronBackendConfig",
    "MegatronRuntime",
    "Shape",
    "require_cuda",
    "require_megatron",
    "to_hf",
    "to_megatron",
]
