"""Data-parallel glue between replicas: sum gradients onto the core, send the new weights back.

The only module of the trainer that imports ``torch.distributed``. Rank 0 is the core. Tensors travel as
one flat buffer per call (one message, not one per parameter), which is what gloo is fast at. On a GPU
cluster the same two calls run over NCCL; across cells the weights go through the transfer engine instead.
"""

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gyre.trainer.errors import TrainerError

CORE_RANK = 0


class ReplicaGroup:
    """A process group of trainer replicas (gloo by default), set up through a shared file store."""

    def __init__(self, rank: int, world_size: int, store_path: str | Path, backend: str = "gloo") -> None:
        if dist.is_initialized():
            raise TrainerError("torch.distributed is already initialised in this process; one replica group each")
        dist.init_process_group(backend, init_method=f"file://{Path(store_path)}", rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size

    @property
    def is_core(self) -> bool:
        return self.rank == CORE_RANK

    def reduce_to_core(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` of every replica into the core's ``tensors`` (in place; others are left as they were)."""
        flat = _flatten_dense_tensors(list(tensors))
        dist.reduce(flat, dst=CORE_RANK, op=dist.ReduceOp.SUM)
        if self.is_core:
            for tensor, summed in zip(tensors, _unflatten_dense_tensors(flat, list(tensors)), strict=True):
                tensor.copy_(summed)

    def broadcast_from_core(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The core's ``tensors`` on every replica (returned; the core gets its own back)."""
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        dist.broadcast(flat, src=CORE_RANK)
        return list(_unflatten_dense_tensors(flat, list(tensors)))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
