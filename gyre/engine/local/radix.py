"""Prefix KV cache keyed by token ids: a radix tree whose edges own the KV of their tokens.

Like SGLang's RadixCache, shared prefixes are stored once (a multi-turn conversation costs O(total
tokens), not O(turns x tokens)) and the longest cached prefix of a new request is found in one walk.
Unlike it, a hit is *copied* into the request's own contiguous buffer (see kv.py): one memcpy per hit
buys a gather-free decode loop, which is the better trade on CPU.

KV of position p depends only on tokens 0..p and the weights, so a cached prefix is valid for any
request that starts with the same ids - until the weights change, when the engine clears the tree.
Eviction is LRU over leaves under a token budget. Only the scheduler thread touches the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gyre.engine.local.kv import SequenceKV


class _Node:
    __slots__ = ("children", "kv", "last_used", "parent", "tokens")

    def __init__(self, tokens: np.ndarray, kv: torch.Tensor | None, parent: _Node | None) -> None:
        self.tokens = tokens  # int64 ids of the edge from `parent`
        self.kv = kv  # [layers, 2, kv_heads, len(tokens), head_dim]
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_used = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """`length` leading tokens are cached; `segments` (views into the tree) hold their KV in order."""

    length: int
    segments: list[torch.Tensor] = field(default_factory=list)


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
        self._root = _Node(np.empty(0, dtype=np.int64), None, None)
        self.tokens = 0

    def match(self, ids: list[int], limit: int | None = None, *, count: bool = True) -> PrefixMatch:
        """Longest cached prefix of `ids[:limit]`; marks the path as recently used. `count=False` leaves
        the hit statistics alone (a KV migration asking what is cached is not a request's lookup)."""
        arr = np.asarray(ids[: len(ids) if limit is None else limit], dtype=np.int64)
        self.stats.lookups += count
        now = next(self._clock)
        node, pos, segments = self._root, 0, []
        while pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            c = _common_prefix(child.tokens, arr, pos)
            assert child.kv is not None and c > 0
            child.last_used = now
            segments.append(child.kv[:, :, :, :c])
            pos += c
            if c < len(child.tokens):
                break
            node = child
        if pos and count:
            self.stats.hits += 1
            self.stats.matched_tokens += pos
        return PrefixMatch(pos, segments)

    def insert(self, ids: list[int], kv: SequenceKV) -> None:
        """Cache the KV of `ids` (`kv` holds at least `len(ids)` positions); only missing tokens are copied."""
        assert kv.length >= len(ids), "KV must cover every inserted token"
        self._insert(ids, kv.segment)

    def insert_pages(self, ids: list[int], start: int, pages: torch.Tensor) -> int:
        """Cache `ids` whose KV for positions `start..len(ids)` is `pages` (`[layers, 2, kv_heads, n,
        head_dim]`, imported from another engine; kept as is, not copied). Positions before `start` must
        still be cached here, or nothing past them is inserted. Returns the cached length of `ids` now."""
        assert pages.shape[3] == len(ids) - start, "pages must cover ids[start:]"

        def piece(lo: int, hi: int) -> torch.Tensor | None:
            return pages[:, :, :, lo - start : hi - start] if lo >= start else None

        return self._insert(ids, piece)

    def _insert(self, ids: list[int], piece: Callable[[int, int], torch.Tensor | None]) -> int:
        """Walk `ids`, attaching `piece(pos, len(ids))` where the tree ends; returns the tokens cached."""
        if self.capacity_tokens == 0 or not ids:
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
                leaf = _Node(arr[pos:].copy(), kv, node)
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
        upper = _Node(child.tokens[:at].copy(), child.kv[:, :, :, :at].clone(), child.parent)
        upper.last_used = child.last_used
        child.parent.children[int(child.tokens[0])] = upper
        child.tokens = child.tokens[at:].copy()
        child.kv = child.kv[:, :, :, at:].clone()
        child.parent = upper
        upper.children[int(child.tokens[0])] = child
        return upper

    def _evict(self) -> None:
        if self.tokens <= self.capacity_tokens:
            return
        order = itertools.count()
        heap = [(n.last_used, next(order), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.tokens > self.capacity_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[int(leaf.tokens[0])]
            self.tokens -= len(leaf.tokens)
            self.stats.evicted_tokens += len(leaf.tokens)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, next(order), parent))

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
