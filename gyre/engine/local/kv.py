"""KV storage: one contiguous, growable buffer per running sequence, and the page pool imported KV lands in.

Layout `[layers, 2 (k, v), kv_heads, capacity, head_dim]`: attention for a sequence reads a contiguous
`[kv_heads, length, head_dim]` slice with no gather, and a prefix can be copied in or out in one slice.
Capacity doubles on demand, so appending n tokens costs amortised O(n).

`KvPool` is memory allocated and populated once, at engine start, in the same layout with `pool tokens` as
the token dimension, cut into pages of `page_size` tokens. An import (`kv_port`) reads another engine's KV
into a run of free pages; the radix edge it becomes is a view of those pages, and the pages go back to the
pool when the last holder (edges, offers) lets go. Fresh memory costs 1-3 ms per MiB to first touch on the
dev VM (the hypervisor backs guest pages on first use, and seems to take freed ones back), which was most of
what an import cost beyond its transfer; pool pages are touched once, at start, and never returned.

`SequenceBuffers` recycles per-sequence buffers for the same reason: a continuation that hits a cached
prefix copies it into its sequence's buffer before its first step, and at 32K tokens on the tiny model
(32 MiB) that copy into fresh memory took 16-21 ms of a 37 ms first token; into a recycled buffer it is a
plain memcpy.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from dataclasses import dataclass

import torch

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's mmap module

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populated(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh memory (flat uint8), 2 MiB-aligned, advised for huge pages and populated. libc's
    madvise through ctypes, not `mmap.madvise`: that one holds the GIL for the whole populate, which stalled
    the engine's other threads (the importing one included) for its ~10 ms. Falls back to first touch by
    `zero_` where the kernel lacks the advice."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps `area` mapped while it lives
    offset = -base.data_ptr() % HUGE_PAGE
    addr = base.data_ptr() + offset
    _libc.madvise(addr, nbytes, mmap.MADV_HUGEPAGE)  # a hint: no error matters
    if _libc.madvise(addr, nbytes, MADV_POPULATE_WRITE) != 0:
        base[offset : offset + nbytes].zero_()
    return base[offset : offset + nbytes]


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


def size_class(tokens: int) -> int:
    """`tokens` rounded up to a quarter of a power of two (at most +25%, so a continuation a little longer
    than the sequence before it still fits that sequence's buffer)."""
    if tokens <= 4:
        return max(tokens, 1)
    step = 1 << (tokens.bit_length() - 3)  # a quarter of the power of two at or below `tokens`
    return -(-tokens // step) * step


class SequenceBuffers:
    """A free-list of per-sequence KV buffers (`[layers, 2, kv_heads, capacity, head_dim]`) whose sequences
    finished, so the next sequence of a similar size writes into memory already touched instead of fresh
    memory. `take(tokens)` returns the smallest kept buffer of `tokens..2 * tokens` capacity, else a new one
    of `size_class(tokens)` (headroom for a longer continuation); `give(buf)` keeps buffers of at least
    `min_bytes`, the oldest dropped beyond `max_bytes` in all. Used on the scheduler thread only (a lock keeps
    it safe anyway)."""

    def __init__(self, shape: KVShape, max_bytes: int, min_bytes: int = 1 << 20) -> None:
        self.shape = shape
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._free: list[torch.Tensor] = []  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        """Buffers handed out again."""
        self.allocated = 0
        """Buffers `take` had to allocate."""

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def take(self, tokens: int) -> torch.Tensor:
        tokens = max(tokens, 1)
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):
                cap = buf.shape[3]
                if tokens <= cap <= 2 * tokens and (best is None or cap < self._free[best].shape[3]):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
                self._bytes -= buf.nbytes
                self.reused += 1
                return buf
            self.allocated += 1
        if tokens * self.shape.bytes_per_token() < self.min_bytes:
            return self.shape.empty(tokens)  # never kept: no headroom either
        return self.shape.empty(size_class(tokens))

    def give(self, buf: torch.Tensor) -> None:
        if buf.nbytes < self.min_bytes or buf.nbytes > self.max_bytes:
            return
        with self._lock:
            self._free.append(buf)
            self._bytes += buf.nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._free.pop(0).nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"kept": len(self._free), "kept_bytes": self._bytes, "reused": self.reused,
                    "allocated": self.allocated}


class SequenceKV:
    """Keys and values of one sequence's first `length` tokens. With `buffers`, its buffer (and every
    larger one it grows into) comes from that free-list, and `release()` gives it back."""

    def __init__(self, shape: KVShape, capacity: int = 64, buffers: SequenceBuffers | None = None) -> None:
        self.shape = shape
        self.buffers = buffers
        self.buf = buffers.take(capacity) if buffers is not None else shape.empty(max(capacity, 1))
        self.length = 0

    def release(self) -> None:
        """The sequence is done: give its buffer back for reuse (the object must not be used after)."""
        if self.buffers is not None and self.buf.numel():
            self.buffers.give(self.buf)
        self.buf = self.shape.empty(1)
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
        grown = self.buffers.take(cap) if self.buffers is not None else self.shape.empty(cap)
        grown[:, :, :, : self.length] = self.buf[:, :, :, : self.length]
        if self.buffers is not None:
            self.buffers.give(self.buf)
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


@dataclass(slots=True)
class PoolStats:
    """Counters of a `KvPool` (reported under `kv_pool` in `/gyre/stats`)."""

    pages: int = 0
    page_size: int = 0
    pages_in_use: int = 0
    peak_pages_in_use: int = 0
    allocations: int = 0
    """Runs of pages handed out."""
    refused: int = 0
    """`alloc` calls no free run could serve (an import then evicts imported edges and asks again)."""
    fallbacks: int = 0
    """Imports and reservations that received into fresh memory after all (the pool was full or too small)."""
    frees: int = 0
    quarantined_pages: int = 0
    """Pages of failed reads, never handed out again (Mooncake may still write them)."""


class PoolBlock:
    """A run of `pages` pool pages from `first_page`, returned to the pool when its last reference is
    released. `tensor(n)` views its first `n` tokens as `[layers, 2, kv_heads, n, head_dim]` (strided: the
    pool's planes are `pool.tokens` long)."""

    __slots__ = ("first_page", "pages", "pool", "refs")

    def __init__(self, pool: KvPool, first_page: int, pages: int) -> None:
        self.pool = pool
        self.first_page = first_page
        self.pages = pages
        self.refs = 1

    @property
    def start_token(self) -> int:
        return self.first_page * self.pool.page_size

    def tensor(self, tokens: int) -> torch.Tensor:
        assert 0 < tokens <= self.pages * self.pool.page_size, "the view must lie inside the block"
        a = self.start_token
        return self.pool.buf[:, :, :, a : a + tokens]

    def retain(self) -> PoolBlock:
        self.pool.retain(self)
        return self

    def release(self) -> None:
        self.pool.release(self)

    def __repr__(self) -> str:
        return f"PoolBlock(pages {self.first_page}..{self.first_page + self.pages}, refs {self.refs})"


class KvPool:
    """`tokens` (rounded up to whole pages) of KV memory, populated once, handed out as contiguous runs of
    pages (first fit; freed runs merge with free neighbours). Thread-safe: blocks are allocated on the
    scheduler thread and may be released on an HTTP worker's (an offer's release)."""

    def __init__(self, shape: KVShape, page_size: int, tokens: int) -> None:
        if page_size < 1 or tokens < 1:
            raise ValueError("a KV pool needs page_size >= 1 and tokens >= 1")
        self.shape = shape
        self.page_size = page_size
        self.pages = -(-tokens // page_size)
        self.tokens = self.pages * page_size
        elt = shape.empty(0).element_size()
        flat = populated(shape.bytes_per_token() * self.tokens)
        self.flat = flat
        self.buf = flat.view(shape.dtype).view(shape.num_layers, 2, shape.num_kv_heads, self.tokens, shape.head_dim)
        self.plane_stride = self.tokens * shape.head_dim * elt
        """Bytes between neighbouring (layer, k|v, head) planes of any block."""
        self.stats = PoolStats(pages=self.pages, page_size=page_size)
        self._lock = threading.Lock()
        self._free: list[list[int]] = [[0, self.pages]]  # sorted, disjoint, never adjacent: [first, count]

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, tokens: int) -> PoolBlock | None:
        """A block of whole pages covering `tokens` (one reference, the caller's), or None if no free run is
        long enough."""
        need = self.pages_for(tokens)
        if need < 1:
            raise ValueError("a pool block holds at least one token")
        with self._lock:
            for i, run in enumerate(self._free):
                if run[1] >= need:
                    first = run[0]
                    if run[1] == need:
                        del self._free[i]
                    else:
                        run[0] += need
                        run[1] -= need
                    s = self.stats
                    s.allocations += 1
                    s.pages_in_use += need
                    s.peak_pages_in_use = max(s.peak_pages_in_use, s.pages_in_use)
                    return PoolBlock(self, first, need)
            self.stats.refused += 1
            return None

    def retain(self, block: PoolBlock) -> None:
        with self._lock:
            assert block.refs > 0, f"{block} was already returned to the pool"
            block.refs += 1

    def release(self, block: PoolBlock) -> None:
        with self._lock:
            assert block.refs > 0, f"{block} was released more often than retained"
            block.refs -= 1
            if block.refs:
                return
            self._give_back(block.first_page, block.pages)
            self.stats.frees += 1
            self.stats.pages_in_use -= block.pages

    def _give_back(self, first: int, count: int) -> None:
        runs = self._free
        lo, hi = 0, len(runs)
        while lo < hi:  # the first run starting after `first`
            mid = (lo + hi) // 2
            if runs[mid][0] < first:
                lo = mid + 1
            else:
                hi = mid
        i = lo
        assert i == len(runs) or first + count <= runs[i][0], "a freed block overlaps a free run"
        assert i == 0 or runs[i - 1][0] + runs[i - 1][1] <= first, "a freed block overlaps a free run"
        if i < len(runs) and runs[i][0] == first + count:  # merge with the run after
            runs[i][0] = first
            runs[i][1] += count
        else:
            runs.insert(i, [first, count])
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == runs[i][0]:  # and with the run before
            runs[i - 1][1] += runs[i][1]
            del runs[i]

    def quarantine(self, block: PoolBlock) -> None:
        """Take `block` out of circulation for good: its pages stay in use and are never handed out again."""
        with self._lock:
            assert block.refs > 0, f"{block} was already returned to the pool"
            block.refs = 0
            self.stats.quarantined_pages += block.pages

    def note_fallback(self) -> None:
        with self._lock:
            self.stats.fallbacks += 1

    def free_runs(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(a, n) for a, n in self._free]

    def largest_free_tokens(self) -> int:
        with self._lock:
            return max((n for _, n in self._free), default=0) * self.page_size

    def snapshot(self) -> dict[str, int]:
        s = self.stats
        return {"pages": s.pages, "page_size": s.page_size, "pages_in_use": s.pages_in_use,
                "peak_pages_in_use": s.peak_pages_in_use, "allocations": s.allocations, "refused": s.refused,
                "fallbacks": s.fallbacks, "frees": s.frees,
                "quarantined_pages": s.quarantined_pages}
