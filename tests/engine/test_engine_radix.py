"""Prefix cache: longest-prefix matches return the exact KV that was inserted; splits and LRU eviction."""

from __future__ import annotations

import torch

from gyre.engine.local.kv import KVShape, SequenceKV
from gyre.engine.local.radix import RadixCache

SHAPE = KVShape(num_layers=2, num_kv_heads=1, head_dim=2)


def kv_for(ids: list[int]) -> SequenceKV:
    """A fake KV whose every entry encodes (token position, token id), so copies can be checked."""
    kv = SequenceKV(SHAPE, 1)
    seg = torch.zeros(2, 2, 1, len(ids), 2)
    for pos, tok in enumerate(ids):
        seg[..., pos, 0] = pos
        seg[..., pos, 1] = tok
    kv.append_segment(seg)
    return kv


def assemble(cache: RadixCache, ids: list[int], limit: int | None = None) -> tuple[int, SequenceKV]:
    m = cache.match(ids, limit)
    kv = SequenceKV(SHAPE, 1)
    for s in m.segments:
        kv.append_segment(s)
    assert kv.length == m.length
    return m.length, kv


def test_match_returns_inserted_kv_and_respects_limit() -> None:
    cache = RadixCache(1000)
    a = [1, 2, 3, 4, 5]
    cache.insert(a, kv_for(a))
    n, kv = assemble(cache, [1, 2, 3, 9])
    assert n == 3
    assert torch.equal(kv.buf[:, :, :, :3], kv_for(a).buf[:, :, :, :3])
    assert assemble(cache, a, limit=4)[0] == 4
    assert assemble(cache, [7, 1, 2])[0] == 0


def test_shared_prefixes_are_stored_once_and_split_correctly() -> None:
    cache = RadixCache(1000)
    a, b = [1, 2, 3, 4], [1, 2, 7, 8, 9]
    cache.insert(a, kv_for(a))
    cache.insert(b, kv_for(b))
    assert cache.tokens == 4 + 3  # [1,2] shared
    for ids in (a, b):
        n, kv = assemble(cache, ids)
        assert n == len(ids)
        assert torch.equal(kv.buf[:, :, :, :n], kv_for(ids).buf[:, :, :, :n])
    cache.insert(a, kv_for(a))  # re-inserting adds nothing
    assert cache.tokens == 7


def test_multi_turn_extension_reuses_everything_before() -> None:
    cache = RadixCache(1000)
    turn1 = list(range(10))
    cache.insert(turn1, kv_for(turn1))
    turn2 = [*turn1, 50, 51, 52]
    assert assemble(cache, turn2, limit=len(turn2) - 1)[0] == 10
    cache.insert(turn2, kv_for(turn2))
    assert cache.tokens == 13


def test_lru_eviction_keeps_recent_prefixes() -> None:
    cache = RadixCache(10)
    old, new = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    cache.insert(old, kv_for(old))
    cache.insert(new, kv_for(new))
    assert cache.tokens <= 10
    assert assemble(cache, new)[0] == 6
    assert assemble(cache, old)[0] == 0
    assert cache.stats.evicted_tokens == 6


def test_capacity_zero_disables_and_clear_empties() -> None:
    off = RadixCache(0)
    off.insert([1, 2], kv_for([1, 2]))
    assert off.tokens == 0
    on = RadixCache(100)
    on.insert([1, 2], kv_for([1, 2]))
    on.clear()
    assert on.tokens == 0 and on.match([1, 2]).length == 0
