"""The local engine's side of KV migration (see `gyre.engine.kv_protocol`): the pull path (offer on the
sender; import - allocate, read, insert - on the receiver; release) and the push path (reserve, export,
commit).

Pages: `page_size` tokens are the unit of export and import. A reservation covers the pages of the prefix
up to its last token but one (which the continuing request computes anyway, for its logits); the last page
may be partly filled - this engine's cache is token-granular and keeps the filled part. Both engines must
use the same page size, layout and policy version.

Zero copies besides the transfer itself: the sender writes straight out of its prefix cache's blocks (each
radix edge owns one tensor, and edges are never written after insertion, so they are safe to read off the
scheduler thread while the reference is held), and the receiver's reserved tensor becomes a radix edge as
it is. Only the scheduler thread touches the cache; the transfers run on the caller's (HTTP worker) thread.

Receive memory comes from the engine's `KvPool` (kv.py): pages populated once at engine start and
registered with the Mooncake endpoint once, when it starts. The import takes a run of free pages on the
scheduler thread (evicting least recently used imported edges if the pool is full), reads into it, and the
radix edge it becomes views those pages; eviction gives them back. Pages of a read that raised are
quarantined, never reused (a timed-out read leaves spans Mooncake may still write). The push path's
reservations keep fresh memory (`reserve`). Without a pool, or when no run is free
even then, it falls back to `receive_buffer`: fresh memory, populated before the transfer, never first
touched inside it (a plain `torch.empty` was first touched on Mooncake's single I/O thread, 4 KiB page by
page - an 8 MiB move took 18 ms instead of 3 ms). Populating fresh memory still costs 1-3 ms per MiB on this
VM (the hypervisor backs it on first use), which is why the pool exists. `KvPool.stats` counts both paths
(`allocations`, `fallbacks`). A spare buffer refilled in the background was tried before the pool and
measured worse on 2 cores: the refill competed with the transfer and the continuation.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from gyre.engine.errors import EngineRequestError, KvRefusedError
from gyre.engine.kv_protocol import (
    KvBlock,
    KvCommitRequest,
    KvCommitResult,
    KvExportRequest,
    KvExportResult,
    KvImportRequest,
    KvImportResult,
    KvLayout,
    KvOffer,
    KvOfferRequest,
    KvReservation,
    KvReserveRequest,
)
from gyre.engine.local.kv import HUGE_PAGE, KvPool, KVShape, PoolBlock, populated
from gyre.engine.local.scheduler import Scheduler
from gyre.errors import TransferError
from gyre.transfer import EndpointConfig, Region, Span, TransferEndpoint, merge_spans

T = TypeVar("T")
MAX_OPEN_RESERVATIONS = 16
"""Reservations a vanished proxy never committed are dropped, oldest first, past this many."""
MAX_OPEN_OFFERS = 16
"""Offers a vanished proxy never released are released, oldest first, past this many."""
__all__ = ["HUGE_PAGE", "KvPort", "populated", "receive_buffer"]


def receive_bytes(shape: KVShape, tokens: int) -> int:
    return shape.bytes_per_token() * tokens


def as_pages(flat: torch.Tensor, shape: KVShape, tokens: int) -> torch.Tensor:
    """The front of a flat uint8 buffer as a `[layers, 2, kv_heads, tokens, head_dim]` tensor."""
    view = flat[: receive_bytes(shape, tokens)].view(shape.dtype)
    return view.view(shape.num_layers, 2, shape.num_kv_heads, tokens, shape.head_dim)


def receive_buffer(shape: KVShape, tokens: int) -> torch.Tensor:
    """An empty pages tensor for `tokens` in populated, huge-page-advised memory (see the module's docstring)."""
    return as_pages(populated(receive_bytes(shape, tokens)), shape, tokens)


def block_of(tensor: torch.Tensor, start: int) -> KvBlock:
    """Describe a cached `[layers, 2, kv_heads, n, head_dim]` block holding tokens `start..start + n`."""
    st = tensor.stride()
    assert st[4] == 1 and st[3] == tensor.shape[4], "tokens of a plane must be contiguous"
    return KvBlock(addr=tensor.data_ptr(), start=start, tokens=tensor.shape[3], stride=(st[0], st[1], st[2], st[3]))


def plane_spans(blocks: list[KvBlock], layout: KvLayout, start: int, end: int, dst: int,
                plane_stride: int) -> tuple[list[Span], list[Span]]:
    """Per plane (the order of `KV_ORDER`), the pieces of each block that fall in `start..end` (source spans)
    and where they go in a destination whose plane p, token t lies at `dst + p*plane_stride + (t-start)*tb`."""
    tb, elt = layout.token_bytes, layout.element_size
    src: list[Span] = []
    out: list[Span] = []
    planes = itertools.product(range(layout.num_layers), range(2), range(layout.num_kv_heads))
    for plane, (layer, kv, head) in enumerate(planes):
        for blk in blocks:
            a, b = max(blk.start, start), min(blk.start + blk.tokens, end)
            if a >= b:
                continue
            st = blk.stride
            base = blk.addr + (layer * st[0] + kv * st[1] + head * st[2] + (a - blk.start) * st[3]) * elt
            src.append(Span(base, (b - a) * tb))
            out.append(Span(dst + plane * plane_stride + (a - start) * tb, (b - a) * tb))
    return merge_spans(src, out)  # whole blocks on both sides collapse into one span per plane


@dataclass(slots=True)
class _Offered:
    tensors: list[torch.Tensor]
    regions: list[Region]
    blocks: list[PoolBlock]


@dataclass(slots=True)
class _Reserved:
    ids: np.ndarray
    start: int
    end: int
    version: str
    pages: torch.Tensor | None
    region: Region | None


@dataclass(frozen=True, slots=True)
class _Receive:
    """Where an import of `tokens` lands: pool pages (`block`) or fresh memory (`region`)."""

    pages: torch.Tensor
    plane_stride: int
    block: PoolBlock | None
    region: Region | None


class KvPort:
    """Export and import of prefix-cache pages for one engine."""

    def __init__(self, scheduler: Scheduler, shape: KVShape, page_size: int, transfer: EndpointConfig,
                 pool: KvPool | None = None) -> None:
        self.scheduler = scheduler
        self.shape = shape
        self.page_size = page_size
        self.transfer_config = transfer
        self.pool = pool
        self._endpoint: TransferEndpoint | None = None
        self._pool_region: Region | None = None
        self._lock = threading.Lock()
        self._reserved: OrderedDict[str, _Reserved] = OrderedDict()
        self._offers: OrderedDict[str, _Offered] = OrderedDict()

    @property
    def endpoint(self) -> TransferEndpoint:
        """This engine's Mooncake endpoint, started on first use (an engine that never migrates has none)."""
        with self._lock:
            if self._endpoint is None:
                self._endpoint = TransferEndpoint(self.transfer_config)
            return self._endpoint

    def _register_pool(self) -> None:
        """Register the whole pool with the endpoint, once, on the first receive into it; it stays registered
        for the engine's life (a registration per move would cost each move, and pin memory under RDMA)."""
        endpoint = self.endpoint
        with self._lock:
            if self._pool_region is None and self.pool is not None:
                self._pool_region = endpoint.register_tensor(self.pool.buf)

    def _take_pages(self, ids: np.ndarray, start: int, end: int) -> PoolBlock | None:
        """On the scheduler thread: pool pages for tokens `start..end` of `ids`, evicting imported edges
        (least recently used, none on `ids[:start]`'s path) if no free run is long enough; None without a
        pool or when even that leaves no room (the caller then uses fresh memory)."""
        pool = self.pool
        if pool is None:
            return None
        n = end - start
        if pool.pages_for(n) > pool.pages:
            pool.note_fallback()
            return None
        block = pool.alloc(n)
        if block is None:
            fits = pool.pages_for(n) * pool.page_size
            if self.scheduler.cache.make_room(lambda: pool.largest_free_tokens() >= fits, ids[:start]):
                block = pool.alloc(n)
        if block is None:
            pool.note_fallback()
        return block

    def _receive(self, block: PoolBlock | None, tokens: int) -> _Receive:
        """Receive memory for `tokens`: `block`'s pages (registered with the pool), or fresh memory registered
        for this move alone."""
        if block is not None:
            assert self.pool is not None
            self._register_pool()
            return _Receive(block.tensor(tokens), self.pool.plane_stride, block, None)
        pages = receive_buffer(self.shape, tokens)
        return _Receive(pages, tokens * self.shape.head_dim * pages.element_size(), None,
                        self.endpoint.register_tensor(pages))

    def layout(self) -> KvLayout:
        s = self.shape
        return KvLayout(
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            dtype=str(s.dtype).removeprefix("torch."),
            page_size=self.page_size,
            policy_version=self.scheduler.weight_version,
        )

    def _on_scheduler(self, fn: Callable[[], T]) -> T:
        return self.scheduler.call(fn).result()

    # -- receiver --------------------------------------------------------------------------------------

    def reserve(self, req: KvReserveRequest) -> KvReservation:
        """The push path's receiver: fresh receive memory, registered until commit or cancel, never pool
        pages - a reservation that expires or is cancelled might still be written by a late sender, and
        only unregistering its memory stops that write (pool pages would be handed to the next import)."""
        ids = req.input_ids
        end = len(ids) - 1  # the last token is computed by the continuing request (its logits are needed)

        def cached() -> tuple[int, str]:
            held = self.scheduler.cache.match(ids, limit=end, count=False).length if end else 0
            return held, self.scheduler.weight_version

        start, version = self._on_scheduler(cached)
        layout = self.layout().model_copy(update={"policy_version": version})
        rid = f"kv-{uuid.uuid4().hex}"  # unique across restarts: a stale commit never hits a new reservation
        pages = region = None
        if end > start:
            pages = receive_buffer(self.shape, end - start)
            region = self.endpoint.register_tensor(pages)
        entry = _Reserved(ids[:end], start, end, version, pages, region)
        with self._lock:
            self._reserved[rid] = entry
            stale = []
            while len(self._reserved) > MAX_OPEN_RESERVATIONS:
                stale.append(self._reserved.popitem(last=False)[1])
        for old in stale:
            self._release(old)
        return KvReservation(
            reservation_id=rid,
            session_id=self.endpoint.session_id,
            layout=layout,
            start=start,
            end=end,
            addr=pages.data_ptr() if pages is not None else 0,
            plane_stride=(end - start) * layout.token_bytes,
        )

    def commit(self, req: KvCommitRequest) -> KvCommitResult:
        entry = self._take(req.reservation_id)
        self._release(entry)
        if not entry.start <= req.end <= entry.end:
            raise EngineRequestError("end", f"{req.end} is outside the reservation's {entry.start}..{entry.end}")

        def insert() -> int:
            if self.scheduler.weight_version != entry.version:
                raise KvRefusedError(
                    "policy_version",
                    f"weights changed from {entry.version!r} to {self.scheduler.weight_version!r} during the move",
                )
            if req.end == entry.start or entry.pages is None:
                return self.scheduler.cache.match(entry.ids, count=False).length
            pages = entry.pages if req.end == entry.end else entry.pages[:, :, :, : req.end - entry.start]
            return self.scheduler.cache.insert_pages(entry.ids[: req.end], entry.start, pages)

        return KvCommitResult(cached_tokens=self._on_scheduler(insert))

    def cancel(self, reservation_id: str) -> None:
        self._release(self._take(reservation_id))

    def _take(self, reservation_id: str) -> _Reserved:
        with self._lock:
            entry = self._reserved.pop(reservation_id, None)
        if entry is None:
            raise KvRefusedError(
                "reservation_id", f"no open reservation {reservation_id!r} (committed, cancelled or expired)"
            )
        return entry

    def _release(self, entry: _Reserved) -> None:
        if entry.region is not None:
            self.endpoint.unregister(entry.region)
            entry.region = None

    # -- sender ----------------------------------------------------------------------------------------

    def export(self, req: KvExportRequest) -> KvExportResult:
        res = req.reservation
        mine = self.layout()
        for field, reason in (("reservation.layout", mine.layout_mismatch(res.layout)),
                              ("reservation.layout.policy_version", mine.version_mismatch(res.layout))):
            if reason is not None:
                raise KvRefusedError(field, reason)
        if res.wanted == 0:
            return KvExportResult(end=res.start, tokens=0, pages=0, bytes=0, seconds=0.0)

        def lookup() -> tuple[list[torch.Tensor], int, str, list[PoolBlock]]:
            if req.rid is not None:
                self.scheduler.cache_sequence(req.rid)
            match = self.scheduler.cache.match(req.input_ids, limit=res.end, count=False)
            return match.segments, match.length, self.scheduler.weight_version, [b.retain() for b in match.blocks]

        segments, have, version, held = self._on_scheduler(lookup)
        try:
            return self._export(req, mine, segments, have, version)
        finally:
            for block in held:  # pool pages stay ours (not handed to an import) until the write is done
                block.release()

    def _export(self, req: KvExportRequest, mine: KvLayout, segments: list[torch.Tensor], have: int,
                version: str) -> KvExportResult:
        res = req.reservation
        if version != res.layout.policy_version:  # the weights changed since the layout was read
            raise KvRefusedError("reservation.layout.policy_version", mine.version_mismatch(res.layout) or version)
        end = min(res.end, have)
        if end <= res.start:
            return KvExportResult(end=res.start, tokens=0, pages=0, bytes=0, seconds=0.0)
        local, remote = self.export_spans(segments, res, end)
        endpoint = self.endpoint
        regions = [endpoint.register_tensor(t) for t in {t.untyped_storage().data_ptr(): t for t in segments}.values()]
        try:
            stats = endpoint.write(res.session_id, local, remote)
        finally:
            for region in regions:
                endpoint.unregister(region)
        first_page = res.start // self.page_size
        return KvExportResult(
            end=end,
            tokens=end - res.start,
            pages=-(-end // self.page_size) - first_page,
            bytes=stats.bytes,
            seconds=stats.seconds,
        )

    def export_spans(self, segments: list[torch.Tensor], res: KvReservation, end: int) -> tuple[list[Span], list[Span]]:
        """Per plane, the pieces of each cached segment that fall in `res.start..end`, and where they go."""
        blocks, off = [], 0
        for seg in segments:
            blocks.append(block_of(seg, off))
            off += seg.shape[3]
        return plane_spans(blocks, res.layout, res.start, end, res.addr, res.plane_stride)

    # -- pull path: sender ---------------------------------------------------------------------------------

    def offer(self, req: KvOfferRequest) -> KvOffer:
        """Hold the cached blocks of `input_ids[:-1]` for a receiver to read, and say where they are."""
        ids = req.input_ids

        def lookup() -> tuple[list[torch.Tensor], int, str, list[PoolBlock]]:
            if req.rid is not None:
                self.scheduler.cache_sequence(req.rid)
            match = self.scheduler.cache.match(ids, limit=len(ids) - 1, count=False)
            return match.segments, match.length, self.scheduler.weight_version, [b.retain() for b in match.blocks]

        segments, end, version, held = self._on_scheduler(lookup)
        layout = self.layout().model_copy(update={"policy_version": version})
        endpoint = self.endpoint
        owners = {t.untyped_storage().data_ptr(): t for t in segments}.values()
        regions = [endpoint.register_tensor(t) for t in owners]
        blocks, off = [], 0
        for seg in segments:
            blocks.append(block_of(seg, off))
            off += seg.shape[3]
        offer_id = f"kvo-{uuid.uuid4().hex}"
        with self._lock:
            self._offers[offer_id] = _Offered(segments, regions, held)
            stale = []
            while len(self._offers) > MAX_OPEN_OFFERS:
                stale.append(self._offers.popitem(last=False)[1])
        for old in stale:
            self._let_go(old)
        return KvOffer(offer_id=offer_id, session_id=endpoint.session_id, layout=layout, end=end, blocks=blocks)

    def release(self, offer_id: str) -> None:
        with self._lock:
            offered = self._offers.pop(offer_id, None)
        if offered is None:
            raise KvRefusedError("offer_id", f"no open offer {offer_id!r} (released or expired)")
        self._let_go(offered)

    def _let_go(self, offered: _Offered) -> None:
        for region in offered.regions:
            self.endpoint.unregister(region)
        offered.regions.clear()
        offered.tensors.clear()
        for block in offered.blocks:  # pool pages the offer kept from being handed to an import
            block.release()
        offered.blocks.clear()

    # -- pull path: receiver -------------------------------------------------------------------------------

    def import_(self, req: KvImportRequest) -> KvImportResult:
        """Read what this engine lacks of an offered prefix and insert it into the prefix cache: reserve,
        read and commit in one call."""
        offer, ids = req.offer, req.input_ids
        mine = self.layout()
        for field, reason in (
            ("offer.layout", offer.layout.layout_mismatch(mine, here="on the sender")),
            ("offer.layout.policy_version", offer.layout.version_mismatch(mine, this="the sender's KV")),
        ):
            if reason is not None:
                raise KvRefusedError(field, reason)
        end = min(offer.end, len(ids) - 1)

        def cached() -> tuple[int, str, PoolBlock | None]:
            held = self.scheduler.cache.match(ids, limit=end, count=False).length if end else 0
            version = self.scheduler.weight_version
            ok = end > held and version == offer.layout.policy_version
            return held, version, self._take_pages(ids, held, end) if ok else None

        start, version, block = self._on_scheduler(cached)
        try:
            return self._import(offer, ids, mine, start, end, version, block)
        finally:
            if block is not None and block.refs:  # the edge inserted holds its own reference
                block.release()

    def _import(self, offer: KvOffer, ids: np.ndarray, mine: KvLayout, start: int, end: int, version: str,
                block: PoolBlock | None) -> KvImportResult:
        if version != offer.layout.policy_version:  # the weights changed since the layout was read
            raise KvRefusedError("offer.layout.policy_version", offer.layout.version_mismatch(
                mine.model_copy(update={"policy_version": version}), this="the sender's KV") or version)
        if end <= start:
            return KvImportResult(start=start, end=start, tokens=0, pages=0, bytes=0, seconds=0.0, cached_tokens=start)
        recv = self._receive(block, end - start)
        pages = recv.pages
        try:
            theirs, ours = plane_spans(offer.blocks, offer.layout, start, end, pages.data_ptr(), recv.plane_stride)
            want = (end - start) * offer.layout.bytes_per_token
            if sum(s.length for s in ours) != want:
                raise KvRefusedError("offer.blocks", f"the offered blocks do not cover tokens {start}..{end}")
            try:
                stats = self.endpoint.read(offer.session_id, ours, theirs)
            except TransferError:
                if block is not None:  # Mooncake may still write these pages (a timeout abandons spans in
                    block.pool.quarantine(block)  # flight): they are never handed out again
                raise
        finally:
            if recv.region is not None:
                self.endpoint.unregister(recv.region)

        def insert() -> int:
            if self.scheduler.weight_version != version:
                now = self.scheduler.weight_version
                raise KvRefusedError("policy_version", f"weights changed from {version!r} to {now!r} during the move")
            return self.scheduler.cache.insert_pages(ids[:end], start, pages, block)

        cached_tokens = self._on_scheduler(insert)
        return KvImportResult(
            start=start, end=end, tokens=end - start, pages=-(-end // self.page_size) - start // self.page_size,
            bytes=stats.bytes, seconds=stats.seconds, cached_tokens=cached_tokens,
        )
