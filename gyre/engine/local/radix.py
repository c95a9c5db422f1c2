"""Prefix KV cache keyed by token ids: a radix tree whose edges own the KV of their tokens.

Like SGLang's RadixCache, shared prefixes are stored once (a multi-turn conversation costs O(total
tokens), not O(turns x tokens)) and the longest cached prefix of a new request is found in one walk.
Unlike it, a hit is *copied* into the request's own contiguous buffer (see kv.py): one memcpy per hit
buys a gather-free decode loop, which is the better trade on CPU.

KV of position p depends only on tokens 0..p and the weights, so a cached prefix is valid for any
request that starts with the same ids - until the weights change, when the engine clears the tree.
Eviction is LRU over leaves under a token budget. Only the scheduler thread touches the tree.

Edges of imported KV (`insert_pages` with a `PoolBlock`) are views of `KvPool` pages and hold a reference to
their block; a split keeps both halves as views of it (no copy), and the block returns to the pool when the
last edge on it is evicted or cleared (and every offer holding it let go). `make_room` evicts such edges,
least recently used first, when an import finds the pool full. Edges of locally computed KV own a tensor.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gyre.engine.local.kv import PoolBlock, SequenceKV

TokenIds = Sequence[int] | np.ndarray
"""A key: a list of ids (requests) or an int64 array (KV migration's routes, which never build the list)."""


class _Node:
    __slots__ = ("block", "children", "kv", "last_used", "parent", "tokens")

    def __init__(self, tokens: np.ndarray, kv: torch.Tensor | None, parent: _Node | None,
                 block: PoolBlock | None = None) -> None:
        self.tokens = tokens  # int64 ids of the edge from `parent`
        self.kv = kv  # [layers, 2, kv_heads, len(tokens), head_dim]
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_used = 0
        self.block = block  # the pool pages `kv` views (this edge holds one reference), or None


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """`length` leading tokens are cached; `segments` (views into the tree) hold their KV in order;
    `blocks` are the distinct pool blocks under them (retain them to read the segments off the scheduler
    thread: an eviction could otherwise hand their pages to the next import)."""

    length: int
    segments: list[torch.Tensor] = field(default_factory=list)
    blocks: list[PoolBlock] = field(default_factory=list)


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hits: int = 0
    matched_tokens: int = 0
    inserted_tokens: int = 0
    evicted_tokens: int = 0


def _common_prefix(edge: np.ndarray, ids: np.ndarray, pos: int) -> int:
    n = min(len(edge), len(ids) - pos)
    diff = np.flatnonzero(edge[:n] != ids[pos : pos + n])
    return int(diff[0]) if diff.size else n


class RadixCache:
    """Token-id prefix tree of KV segments, bounded by `capacity_tokens` (0 disables caching)."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        old = getattr(self, "_root", None)
        self._root = _Node(np.empty(0, dtype=np.int64), None, None)
        self.tokens = 0
        stack = [old] if old is not None else []
        while stack:  # every pool block an edge held goes back
            n = stack.pop()
            stack.extend(n.children.values())
            if n.block is not None:
                n.block.release()
                n.block = None

    def match(self, ids: TokenIds, limit: int | None = None, *, count: bool = True) -> PrefixMatch:
        """Longest cached prefix of `ids[:limit]`; marks the path as recently used. `count=False` leaves
        the hit statistics alone (a KV migration asking what is cached is not a request's lookup)."""
        arr = np.asarray(ids[: len(ids) if limit is None else limit], dtype=np.int64)
        self.stats.lookups += count
        now = next(self._clock)
        node, pos, segments, blocks = self._root, 0, [], []
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            c = _common_prefix(child.tokens, arr, pos)
            assert child.kv is not None and c > 0
            child.last_used = now
            segments.append(child.kv[:, :, :, :c])
            if child.block is not None and all(b is not child.block for b in blocks):
                blocks.append(child.block)
            pos += c
            if c < len(child.tokens):
                break
            node = child
        if pos and count:
            self.stats.hits += 1
            self.stats.matched_tokens += pos
        return PrefixMatch(pos, segments, blocks)

    def insert(self, ids: TokenIds, kv: SequenceKV) -> None:
        """Cache the KV of `ids` (`kv` holds at least `len(ids)` positions); only missing tokens are copied."""
        assert kv.length >= len(ids), "KV must cover every inserted token"
        self._insert(ids, kv.segment)

    def insert_pages(self, ids: TokenIds, start: int, pages: torch.Tensor, block: PoolBlock | None = None) -> int:
        """Cache `ids` whose KV for positions `start..len(ids)` is `pages` (`[layers, 2, kv_heads, n,
        head_dim]`, imported from another engine; kept as is, not copied). Positions before `start` must
        still be cached here, or nothing past them is inserted. With `block` (the pool pages `pages` views),
        the new edge takes a reference of its own; the caller keeps and releases its one. Returns the cached
        length of `ids` now."""
        assert pages.shape[3] == len(ids) - start, "pages must cover ids[start:]"

        def piece(lo: int, hi: int) -> torch.Tensor | None:
            return pages[:, :, :, lo - start : hi - start] if lo >= start else None

        return self._insert(ids, piece, block)

    def _insert(self, ids: TokenIds, piece: Callable[[int, int], torch.Tensor | None],
                block: PoolBlock | None = None) -> int:
        """Walk `ids`, attaching `piece(pos, len(ids))` where the tree ends; returns the tokens cached."""
        if self.capacity_tokens == 0 or len(ids) == 0:
            return 0
        arr = np.asarray(ids, dtype=np.int64)
        now = next(self._clock)
        node, pos = self._root, 0
        while pos < len(arr):
            first = int(arr[pos])
            child = node.children.get(first)
            if child is None:
                kv = piece(pos, len(arr))
                if kv is None:
                    break
                leaf = _Node(arr[pos:].copy(), kv, node, block.retain() if block is not None else None)
                leaf.last_used = now
                node.children[first] = leaf
                self.tokens += len(arr) - pos
                self.stats.inserted_tokens += len(arr) - pos
                pos = len(arr)
                break
            c = _common_prefix(child.tokens, arr, pos)
            if c < len(child.tokens):
                child = self._split(child, c)
            child.last_used = now
            pos += c
            node = child
        self._evict()
        return pos

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; returns the new upper node."""
        assert child.parent is not None and child.kv is not None
        if child.block is not None:  # pool pages: both halves stay views of the block, each holding it
            upper = _Node(child.tokens[:at].copy(), child.kv[:, :, :, :at], child.parent, child.block.retain())
            rest = child.kv[:, :, :, at:]
        else:  # an owned tensor: each half gets its own, so either can be freed alone
            upper = _Node(child.tokens[:at].copy(), child.kv[:, :, :, :at].clone(), child.parent)
            rest = child.kv[:, :, :, at:].clone()
        upper.last_used = child.last_used
        child.parent.children[int(child.tokens[0])] = upper
        child.tokens = child.tokens[at:].copy()
        child.kv = rest
        child.parent = upper
        upper.children[int(child.tokens[0])] = child
        return upper

    def _evict(self) -> None:
        if self.tokens > self.capacity_tokens:
            self._evict_lru(lambda: self.tokens <= self.capacity_tokens)

    def make_room(self, done: Callable[[], bool], keep: TokenIds) -> bool:
        """Evict edges that hold pool pages, least recently used first, until `done()` (the pool can serve an
        import); the edges on the path of `keep` (the prefix that import builds on) stay. Returns `done()`."""
        path: set[int] = set()
        node, pos = self._root, 0
        arr = np.asarray(keep, dtype=np.int64)
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            path.add(id(child))
            pos += len(child.tokens)
            node = child
        return self._evict_lru(done, lambda n: n.block is not None and id(n) not in path)

    def _evict_lru(self, done: Callable[[], bool], allowed: Callable[[_Node], bool] = lambda n: True) -> bool:
        """Evict leaves (and parents they leave childless) in LRU order until `done()`."""
        order = itertools.count()
        heap = [(n.last_used, next(order), n) for n in self._leaves() if allowed(n)]
        heapq.heapify(heap)
        while not done() and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[int(leaf.tokens[0])]
            self.tokens -= len(leaf.tokens)
            self.stats.evicted_tokens += len(leaf.tokens)
            if leaf.block is not None:
                leaf.block.release()
                leaf.block = None
            if parent is not self._root and not parent.children and allowed(parent):
                heapq.heappush(heap, (parent.last_used, next(order), parent))
        return done()

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self._root:
                out.append(n)
        return out

    def node_count(self) -> int:
        count, stack = 0, [self._root]
        while stack:
            n = stack.pop()
            count += 1
            stack.extend(n.children.values())
        return count - 1
