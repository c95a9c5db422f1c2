"""Per-sequence KV storage: one contiguous, growable buffer per running sequence.

Layout `[layers, 2 (k, v), kv_heads, capacity, head_dim]`: attention for a sequence reads a contiguous
`[kv_heads, length, head_dim]` slice with no gather, and a prefix can be copied in or out in one slice.
Capacity doubles on demand, so appending n tokens costs amortised O(n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVShape:
    """Everything but the token dimension of one sequence's KV."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def empty(self, tokens: int) -> torch.Tensor:
        return torch.empty(self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim, dtype=self.dtype)

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.empty(0).element_size()


class SequenceKV:
    """Keys and values of one sequence's first `length` tokens."""

    def __init__(self, shape: KVShape, capacity: int = 64) -> None:
        self.shape = shape
        self.buf = shape.empty(max(capacity, 1))
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.buf.shape[3]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more tokens beyond `length`."""
        need = self.length + extra
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2
        grown = self.shape.empty(cap)
        grown[:, :, :, : self.length] = self.buf[:, :, :, : self.length]
        self.buf = grown

    def append_segment(self, segment: torch.Tensor) -> None:
        """Append a `[layers, 2, kv_heads, n, head_dim]` block (a cached prefix piece)."""
        n = segment.shape[3]
        self.reserve(n)
        self.buf[:, :, :, self.length : self.length + n] = segment
        self.length += n

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `[kv_heads, n, head_dim]` keys/values for positions `start..start+n` (caller reserved)."""
        n = k.shape[1]
        self.buf[layer, 0, :, start : start + n] = k
        self.buf[layer, 1, :, start : start + n] = v

    def keys_values(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buf[layer, 0, :, :upto], self.buf[layer, 1, :, :upto]

    def segment(self, start: int, end: int) -> torch.Tensor:
        """An owned copy of positions `start..end`, for the prefix cache."""
        return self.buf[:, :, :, start:end].clone()

    def reset(self) -> None:
        """Forget every token (the buffer is kept for reuse)."""
        self.length = 0
