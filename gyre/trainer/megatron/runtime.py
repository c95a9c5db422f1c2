"""Process-wide setup Megatron-core needs: torch.distributed and its model-parallel state (tp = pp = 1).

On CPU two adjustments make megatron-core 0.16.1 run (checked on this project's machines):

* its global memory buffer (scratch for attention scores) allocates with ``torch.cuda.current_device()``;
  it is replaced by one that allocates on CPU;
* its CUDA RNG tracker forks CUDA generator states around dropout; the inference tracker, whose ``fork`` is
  a no-op, is installed instead. This is only sound because the backend runs with dropout 0 (checked).

Both touch module state of megatron, so they are applied here, once per process, and nowhere else.
"""

import functools
import operator
import tempfile
from pathlib import Path
from typing import Any

from gyre.trainer.errors import BackendUnavailableError


def require_megatron() -> None:
    """Raise a clear error when megatron-core is not installed."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(
            "the Megatron backend needs megatron-core (pip install 'megatron-core==0.16.1'); "
            "the torch backend trains the same models without it"
        ) from e


def require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"{what} needs CUDA: megatron-core's DistributedDataParallel and optimizer allocate their buffers "
            "with torch.cuda.current_device(). On CPU the Megatron backend runs forward and backward only; "
            "use the torch backend to train."
        )


class MegatronRuntime:
    """Initialise (and later tear down) torch.distributed and Megatron's parallel state for one process.

    An existing process group is reused (a launcher such as torchrun set it up); otherwise a one-rank group
    is created, gloo on CPU and NCCL on CUDA, through a file store in a temporary directory.
    """

    def __init__(self, device: str = "cpu") -> None:
        require_megatron()
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.device = device
        self._owns_group = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not dist.is_initialized():
            self._tmp = tempfile.TemporaryDirectory(prefix="gyre-megatron-")
            backend = "nccl" if device == "cuda" else "gloo"
            if device == "cuda":
                torch.cuda.set_device(0)
            init = f"file://{Path(self._tmp.name) / 'store'}"
            dist.init_process_group(backend, init_method=init, rank=0, world_size=1)
            self._owns_group = True
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if device == "cpu":
            _cpu_adjustments()
        else:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def close(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "MegatronRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cpu_adjustments() -> None:
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        """Megatron's scratch buffer, allocated on CPU."""

        def get_tensor(self, tensor_shape: Any, dtype: Any, name: Any, mem_alloc_context: Any = None) -> Any:
            required = functools.reduce(operator.mul, tensor_shape, 1)
            buffer = self.buffer.get((name, dtype))
            if buffer is None or buffer.numel() < required:
                buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, requires_grad=False)
            return buffer[0:required].view(*tensor_shape)

    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
