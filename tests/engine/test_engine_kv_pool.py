"""The KV page pool (`kv.KvPool`): imports read into pages populated once, radix edges of imported KV hold
them and hand them back on eviction, a full pool falls back to fresh memory, and no page is ever held by two
blocks at once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engine.kv_protocol import KvImportRequest, KvOfferRequest, KvReserveRequest
from gyre.engine.local import LocalEngine, LocalEngineConfig, kv_port
from gyre.engine.local.kv import KvPool, KVShape, PoolBlock
from gyre.engine.local.radix import RadixCache
from gyre.engine.local.scheduler import EngineRequest, RequestOutput
from gyre.engine.protocol import SamplingParams
from gyre.errors import TransferError

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(150)]
OTHER = [(11 * i + 5) % 250 + 1 for i in range(150)]


def encoded(ids: list[int], start: int) -> torch.Tensor:
    """KV for `ids[start:]` whose entries encode (position, token id), so a match can be checked exactly."""
    seg = torch.zeros(SHAPE.num_layers, 2, SHAPE.num_kv_heads, len(ids) - start, SHAPE.head_dim)
    for pos in range(start, len(ids)):
        seg[..., pos - start, 0] = pos
        seg[..., pos - start, 1] = ids[pos]
    return seg


def pooled_pages(pool: KvPool, ids: list[int], start: int) -> tuple[PoolBlock, torch.Tensor]:
    block = pool.alloc(len(ids) - start)
    assert block is not None
    pages = block.tensor(len(ids) - start)
    pages.copy_(encoded(ids, start))  # what a transfer would have written
    return block, pages


# -- the pool alone ---------------------------------------------------------------------------------------


def test_the_pool_hands_out_first_fit_runs_merges_freed_ones_and_refuses_when_full() -> None:
    pool = KvPool(SHAPE, page_size=4, tokens=30)  # rounded up to 8 pages of 4 tokens
    assert (pool.pages, pool.tokens) == (8, 32) and pool.buf.shape == (2, 2, 2, 32, 4)
    a, b, c = pool.alloc(5), pool.alloc(8), pool.alloc(12)  # 2, 2 and 3 pages
    assert a is not None and b is not None and c is not None
    assert [(x.first_page, x.pages) for x in (a, b, c)] == [(0, 2), (2, 2), (4, 3)]
    assert pool.alloc(5) is None and pool.stats.refused == 1  # 1 page left
    b.release()
    assert pool.free_runs() == [(2, 2), (7, 1)]
    a.retain()
    a.release()  # still held once
    assert pool.free_runs() == [(2, 2), (7, 1)]
    a.release()
    c.release()
    assert pool.free_runs() == [(0, 8)] and pool.stats.pages_in_use == 0 and pool.stats.frees == 3
    assert pool.stats.peak_pages_in_use == 7 and pool.stats.allocations == 3
    with pytest.raises(AssertionError, match="released more often"):
        a.release()


def test_a_block_views_its_pages_in_every_plane() -> None:
    pool = KvPool(SHAPE, page_size=4, tokens=16)
    pool.alloc(4)
    block = pool.alloc(6)
    assert block is not None and block.start_token == 4
    view = block.tensor(6)
    view.fill_(7.0)
    assert view.shape == (2, 2, 2, 6, 4) and view.stride()[3:] == (4, 1)
    assert int((pool.buf == 7.0).sum()) == view.numel()
    assert bool((pool.buf[:, :, :, 4:10] == 7.0).all())
    assert view.data_ptr() - pool.buf.data_ptr() == 4 * 4 * 4  # token 4 of plane 0
    assert pool.plane_stride == 16 * 4 * 4


# -- the radix cache owns imported pages ----------------------------------------------------------------------


def test_evicting_an_imported_edge_returns_its_pages_and_the_next_import_reuses_them() -> None:
    pool = KvPool(SHAPE, page_size=16, tokens=160)
    cache = RadixCache(capacity_tokens=160)
    block, pages = pooled_pages(pool, PROMPT, 0)
    assert cache.insert_pages(PROMPT, 0, pages, block) == len(PROMPT)
    block.release()  # the importer's reference; the edge holds its own
    assert pool.stats.pages_in_use == 10
    m = cache.match(PROMPT)
    assert m.length == 150 and m.blocks == [block] and torch.equal(torch.cat(m.segments, 3), encoded(PROMPT, 0))

    # a second import finds the pool full, evicts the older imported edge, and lands in the same pages
    assert pool.alloc(150) is None
    assert cache.make_room(lambda: pool.largest_free_tokens() >= 160, keep=[])
    again, pages2 = pooled_pages(pool, OTHER, 0)
    assert (again.first_page, again.pages) == (block.first_page, block.pages) and block.refs == 0
    cache.insert_pages(OTHER, 0, pages2, again)
    again.release()
    assert cache.match(PROMPT).length == 0 and cache.match(OTHER).length == 150
    assert pool.stats.allocations == 2 and pool.stats.fallbacks == 0
    cache.clear()
    assert pool.stats.pages_in_use == 0 and pool.free_runs() == [(0, 10)]


def test_a_split_imported_edge_keeps_views_of_its_block_until_both_halves_go() -> None:
    pool = KvPool(SHAPE, page_size=16, tokens=320)
    cache = RadixCache(capacity_tokens=1000)
    block, pages = pooled_pages(pool, PROMPT, 0)
    cache.insert_pages(PROMPT, 0, pages, block)
    block.release()
    branch = PROMPT[:100] + OTHER[:20]  # a local continuation that shares 100 tokens: splits the edge
    from gyre.engine.local.kv import SequenceKV

    local = SequenceKV(SHAPE, len(branch))
    local.append_segment(encoded(branch, 0))
    cache.insert(branch, local)
    assert block.refs == 2  # the upper half and the lower one
    m = cache.match(PROMPT)
    assert m.length == 150 and all(s.data_ptr() >= pool.buf.data_ptr() for s in m.segments)
    assert torch.equal(torch.cat(m.segments, 3), encoded(PROMPT, 0))
    assert torch.equal(torch.cat(cache.match(branch).segments, 3), encoded(branch, 0))
    cache.capacity_tokens = 120  # evicts the lower half (least recently used), not yet the pages
    cache.match(branch)
    cache.insert(branch, local)
    assert cache.match(PROMPT).length == 100 and block.refs == 1 and pool.stats.pages_in_use == 10
    cache.clear()
    assert block.refs == 0 and pool.stats.pages_in_use == 0


def test_make_room_spares_the_path_the_import_builds_on() -> None:
    pool = KvPool(SHAPE, page_size=16, tokens=160)
    cache = RadixCache(capacity_tokens=1000)
    block, pages = pooled_pages(pool, PROMPT, 0)
    cache.insert_pages(PROMPT, 0, pages, block)
    block.release()
    assert not cache.make_room(lambda: pool.largest_free_tokens() >= 160, keep=PROMPT[:150])
    assert cache.match(PROMPT).length == 150 and pool.stats.pages_in_use == 10


# -- property: alloc / free / insert / split / evict / offer never hand out a page twice --------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("import"), st.integers(0, 3), st.integers(1, 60), st.integers(0, 59)),
        st.tuples(st.just("local"), st.integers(0, 3), st.integers(1, 60), st.just(0)),
        st.tuples(st.just("offer"), st.integers(0, 3), st.integers(1, 60), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 7), st.just(0), st.just(0)),
        st.tuples(st.just("shrink"), st.integers(0, 150), st.just(0), st.just(0)),
        st.tuples(st.just("clear"), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=40,
)
BASES = [[(k * 37 + i * (k + 3)) % 9 + 1 for i in range(60)] for k in range(4)]  # shared prefixes, branching


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([1, 4, 16]), st.integers(8, 200))
def test_no_page_is_handed_out_twice(ops: list[tuple[str, int, int, int]], page_size: int, pool_tokens: int) -> None:
    pool = KvPool(SHAPE, page_size=page_size, tokens=pool_tokens)
    cache = RadixCache(capacity_tokens=150)
    held: list[list[PoolBlock]] = []  # offers: blocks retained off the scheduler thread
    for op, k, n, s in ops:
        ids = BASES[k % len(BASES)][:n]
        if op == "import":
            start = min(cache.match(ids, count=False).length, s, n - 1)
            block = pool.alloc(n - start)
            if block is None and cache.make_room(
                    lambda n=n, start=start: pool.largest_free_tokens() >= pool.pages_for(n - start) * page_size,
                    ids[:start]):
                block = pool.alloc(n - start)
            if block is not None:
                pages = block.tensor(n - start)
                pages.copy_(encoded(ids, start))
                cache.insert_pages(ids, start, pages, block)
                block.release()
        elif op == "local":
            from gyre.engine.local.kv import SequenceKV

            kv = SequenceKV(SHAPE, n)
            kv.append_segment(encoded(ids, 0))
            cache.insert(ids, kv)
        elif op == "offer":
            m = cache.match(ids, count=False)
            held.append([b.retain() for b in m.blocks])
        elif op == "release" and held:
            for b in held.pop(k % len(held)):
                b.release()
        elif op == "shrink":
            cache.capacity_tokens = k
            cache._evict()
        elif op == "clear":
            cache.clear()
        # every cached prefix still reads back exactly what was written for it
        for base in BASES:
            m = cache.match(base, count=False)
            if m.length:
                assert torch.equal(torch.cat(m.segments, 3), encoded(base[: m.length], 0))
        # live blocks are disjoint, and with the free runs they tile the pool
        nodes, stack = [], [cache._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            nodes.append(node)
        live = {id(b): b for b in [n.block for n in nodes if n.block is not None] + [b for o in held for b in o]}
        for b in live.values():
            owners = sum(n.block is b for n in nodes) + sum(x is b for o in held for x in o)
            assert b.refs == owners > 0
        runs = sorted([(b.first_page, b.pages) for b in live.values()] + pool.free_runs())
        assert sum(p for _, p in runs) == pool.pages
        assert all(a + p == b for (a, p), (b, _) in itertools.pairwise(runs))
        assert pool.stats.pages_in_use == sum(b.pages for b in live.values())
    for o in held:
        for b in o:
            b.release()
    cache.clear()
    assert pool.free_runs() == [(0, pool.pages)] and pool.stats.pages_in_use == 0


# -- engines: the second import allocates nothing new; a full pool falls back -----------------------------------


def _generate(engine: LocalEngine, ids: list[int], n: int = 6) -> RequestOutput:
    done: Future[RequestOutput] = Future()
    engine.scheduler.submit(EngineRequest(
        rid=f"r-{id(done)}", input_ids=ids, sink=lambda out: out.finished and done.set_result(out),
        params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)))
    return done.result(60)


def _move(src: LocalEngine, dst: LocalEngine, ids: list[int]) -> int:
    offer = src.kv.offer(KvOfferRequest(input_ids=ids))
    try:
        return dst.kv.import_(KvImportRequest(input_ids=ids, offer=offer)).cached_tokens
    finally:
        src.kv.release(offer.offer_id)


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    pool_tokens = getattr(request, "param", None)
    a, b = LocalEngine(LocalEngineConfig(seed=0)), LocalEngine(LocalEngineConfig(seed=0, kv_pool_tokens=pool_tokens))
    a.start()
    b.start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def fresh_buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    real = kv_port.receive_buffer

    def counting(shape: KVShape, tokens: int) -> torch.Tensor:
        made.append(tokens)
        return real(shape, tokens)

    monkeypatch.setattr(kv_port, "receive_buffer", counting)
    return made


def test_a_second_import_lands_in_the_pages_the_first_gave_back(engines, fresh_buffers: list[int]) -> None:
    a, b = engines
    assert b.kv_pool is not None and b.kv_pool.tokens >= b.runner.max_positions  # default: the context
    ids = PROMPT + _generate(a, PROMPT).output_ids
    want = _generate(a, ids)
    for _ in range(2):
        b.scheduler.flush_cache().result()
        assert b.kv_pool.stats.pages_in_use == 0  # the flush returned the imported pages
        assert _move(a, b, ids) == len(ids) - 1
        got = _generate(b, ids)
        assert got.cached_tokens == len(ids) - 1 and got.output_ids == want.output_ids
    s = b.kv_pool.stats
    assert fresh_buffers == [] and s.fallbacks == 0 and s.allocations == 2 and s.frees == 1
    assert s.peak_pages_in_use == s.pages_in_use == -(-(len(ids) - 1) // 16)
    assert b.scheduler.snapshot()["kv_pool"]["allocations"] == 2
    assert b.kv.endpoint.registered == 1  # the pool, registered once


@pytest.mark.parametrize("engines", [64], indirect=True)
def test_an_import_the_pool_cannot_hold_falls_back_to_fresh_memory(engines, fresh_buffers: list[int]) -> None:
    a, b = engines
    assert b.kv_pool is not None and b.kv_pool.tokens == 64
    ids = PROMPT + _generate(a, PROMPT).output_ids
    assert _move(a, b, ids) == len(ids) - 1
    got = _generate(b, ids)
    assert got.cached_tokens == len(ids) - 1 and got.output_ids == _generate(a, ids).output_ids
    assert fresh_buffers == [len(ids) - 1] and b.kv_pool.stats.fallbacks == 1 and b.kv_pool.stats.allocations == 0
    assert b.kv.endpoint.registered == 0  # the fresh buffer was registered for the move alone


@pytest.mark.parametrize("engines", [160], indirect=True)
def test_a_full_pool_evicts_older_imports_before_falling_back(engines, fresh_buffers: list[int]) -> None:
    a, b = engines
    first = PROMPT + _generate(a, PROMPT).output_ids
    second = OTHER + _generate(a, OTHER).output_ids
    assert _move(a, b, first) == len(first) - 1
    assert _move(a, b, second) == len(second) - 1  # the pool holds one: the first import's edge is evicted
    assert fresh_buffers == [] and b.kv_pool is not None and b.kv_pool.stats.fallbacks == 0
    assert _generate(b, second).cached_tokens == len(second) - 1
    assert _generate(b, first).cached_tokens == 0


@pytest.mark.parametrize("engines", [0], indirect=True)
def test_no_pool_when_configured_off(engines, fresh_buffers: list[int]) -> None:
    a, b = engines
    ids = PROMPT + _generate(a, PROMPT).output_ids
    assert b.kv_pool is None and "kv_pool" not in b.scheduler.snapshot()
    assert _move(a, b, ids) == len(ids) - 1 and fresh_buffers == [len(ids) - 1]


def test_pages_of_a_failed_read_are_never_handed_out_again(engines, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = engines
    ids = PROMPT + _generate(a, PROMPT).output_ids
    assert b.kv_pool is not None
    real = type(b.kv.endpoint).read

    def timed_out(self, peer, local, remote):  # as a timeout leaves it: spans in flight
        raise TransferError("read timed out; spans abandoned")

    monkeypatch.setattr(type(b.kv.endpoint), "read", timed_out)
    with pytest.raises(TransferError):
        _move(a, b, ids)
    pages = -(-(len(ids) - 1) // 16)
    s = b.kv_pool.stats
    assert s.quarantined_pages == s.pages_in_use == pages and b.kv_pool.free_runs() == [(pages, s.pages - pages)]
    monkeypatch.setattr(type(b.kv.endpoint), "read", real)
    assert _move(a, b, ids) == len(ids) - 1  # the next import lands elsewhere, and works
    assert _generate(b, ids).output_ids == _generate(a, ids).output_ids
    b.scheduler.flush_cache().result()
    assert b.kv_pool.stats.pages_in_use == pages  # only the quarantined ones


def test_push_reservations_keep_fresh_memory(engines, fresh_buffers: list[int]) -> None:
    """A cancelled or expired reservation may still be written by a late sender: its memory is unregistered
    then, which pool pages cannot be."""
    a, b = engines
    ids = PROMPT + _generate(a, PROMPT).output_ids
    res = b.kv.reserve(KvReserveRequest(input_ids=ids))
    assert fresh_buffers == [len(ids) - 1] and b.kv_pool is not None and b.kv_pool.stats.allocations == 0
    b.kv.cancel(res.reservation_id)
    assert b.kv.endpoint.registered == 0


def test_an_offer_of_imported_pages_keeps_them_from_the_next_import(engines) -> None:
    """B imports from A, then offers those pooled edges on; evicting them while offered must not free them."""
    a, b = engines
    ids = PROMPT + _generate(a, PROMPT).output_ids
    _move(a, b, ids)
    assert b.kv_pool is not None
    offer = b.kv.offer(KvOfferRequest(input_ids=ids))
    b.scheduler.flush_cache().result()
    assert b.kv_pool.stats.pages_in_use > 0  # held by the offer
    b.kv.release(offer.offer_id)
    assert b.kv_pool.stats.pages_in_use == 0


# -- recycled per-sequence buffers ------------------------------------------------------------------------------


def test_sequence_buffers_hand_back_a_kept_buffer_of_a_fitting_size_and_bound_what_they_keep() -> None:
    from gyre.engine.local.kv import SequenceBuffers, SequenceKV, size_class

    assert [size_class(t) for t in (1, 4, 9, 100, 1506, 32773, 32768)] == [1, 4, 10, 112, 1536, 40960, 32768]
    per_token = SHAPE.bytes_per_token()
    bufs = SequenceBuffers(SHAPE, max_bytes=400 * per_token, min_bytes=10 * per_token)
    kv = SequenceKV(SHAPE, 100, bufs)
    assert kv.capacity == 112  # its size class: room for a longer continuation
    first = kv.buf.data_ptr()
    kv.append_segment(encoded(PROMPT[:100], 0))
    kv.release()
    assert bufs.kept_bytes == 112 * per_token and kv.length == 0
    assert SequenceKV(SHAPE, 201, bufs).buf.data_ptr() != first  # 112 < 201 tokens: too small
    again = SequenceKV(SHAPE, 110, bufs)  # 112 lies within 110..220: reused, stale data and all
    assert again.buf.data_ptr() == first and again.capacity == 112 and again.length == 0
    assert bufs.snapshot() == {"kept": 0, "kept_bytes": 0, "reused": 1, "allocated": 2}
    assert SequenceKV(SHAPE, 20, bufs).capacity == 20  # a fresh one: nothing kept
    again.length = 100
    again.reserve(50)  # grows into a new buffer (224 tokens) and gives the old one back
    assert again.capacity == 224 and bufs.kept_bytes == 112 * per_token
    again.release()
    assert bufs.kept_bytes == 336 * per_token
    SequenceKV(SHAPE, 160, bufs).release()  # reuses the 224 (within 160..320), gives it back
    assert bufs.kept_bytes == 336 * per_token
    SequenceKV(SHAPE, 300, bufs).release()  # a fresh 320: 656 > 400 in all, so the oldest go (112, 224)
    assert bufs.snapshot()["kept"] == 1 and bufs.kept_bytes == 320 * per_token
    SequenceKV(SHAPE, 5, bufs).release()  # under min_bytes: not kept
    assert bufs.snapshot()["kept"] == 1


def test_a_continuation_copies_its_cached_prefix_into_the_previous_sequence_buffer(engines) -> None:
    a, _ = engines
    ids = PROMPT * 10  # 1,500 tokens: a 1.5 MiB buffer on the tiny model, above the 1 MiB floor
    first = _generate(a, ids)
    before = a.scheduler.snapshot()["kv_buffers"]
    assert before["kept"] >= 1
    again = _generate(a, ids + first.output_ids)
    after = a.scheduler.snapshot()["kv_buffers"]
    assert again.cached_tokens == len(ids) + len(first.output_ids) - 1
    assert after["reused"] == before["reused"] + 1
    assert again.output_ids == _generate(a, ids + first.output_ids).output_ids
