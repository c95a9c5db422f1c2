"""The local engine's side of KV migration: layout, reserve, export, commit (see `gyre.engine.kv_protocol`).

Pages: `page_size` tokens are the unit of export and import. A reservation covers the pages of the prefix
up to its last token but one (which the continuing request computes anyway, for its logits); the last page
may be partly filled - this engine's cache is token-granular and keeps the filled part. Both engines must
use the same page size, layout and policy version.

Zero copies besides the transfer itself: the sender writes straight out of its prefix cache's blocks (each
radix edge owns one tensor, and edges are never written after insertion, so they are safe to read off the
scheduler thread while the reference is held), and the receiver's reserved tensor becomes a radix edge as
it is. Only the scheduler thread touches the cache; the transfers run on the caller's (HTTP worker) thread.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from gyre.engine.errors import EngineRequestError, KvRefusedError
from gyre.engine.kv_protocol import (
    KvCommitRequest,
    KvCommitResult,
    KvExportRequest,
    KvExportResult,
    KvLayout,
    KvReservation,
    KvReserveRequest,
)
from gyre.engine.local.kv import KVShape
from gyre.engine.local.scheduler import Scheduler
from gyre.transfer import EndpointConfig, Region, Span, TransferEndpoint, merge_spans

T = TypeVar("T")
MAX_OPEN_RESERVATIONS = 16
"""Reservations a vanished proxy never committed are dropped, oldest first, past this many."""


@dataclass(slots=True)
class _Reserved:
    ids: list[int]
    start: int
    end: int
    version: str
    pages: torch.Tensor | None
    region: Region | None


class KvPort:
    """Export and import of prefix-cache pages for one engine."""

    def __init__(self, scheduler: Scheduler, shape: KVShape, page_size: int, transfer: EndpointConfig) -> None:
        self.scheduler = scheduler
        self.shape = shape
        self.page_size = page_size
        self.transfer_config = transfer
        self._endpoint: TransferEndpoint | None = None
        self._lock = threading.Lock()
        self._reserved: OrderedDict[str, _Reserved] = OrderedDict()

    @property
    def endpoint(self) -> TransferEndpoint:
        """This engine's Mooncake endpoint, started on first use (an engine that never migrates has none)."""
        with self._lock:
            if self._endpoint is None:
                self._endpoint = TransferEndpoint(self.transfer_config)
            return self._endpoint

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
            s = self.shape
            pages = torch.empty(s.num_layers, 2, s.num_kv_heads, end - start, s.head_dim, dtype=s.dtype)
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

        def lookup() -> tuple[list[torch.Tensor], int, str]:
            if req.rid is not None:
                self.scheduler.cache_sequence(req.rid)
            match = self.scheduler.cache.match(req.input_ids, limit=res.end, count=False)
            return match.segments, match.length, self.scheduler.weight_version

        segments, have, version = self._on_scheduler(lookup)
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
        tb = res.layout.token_bytes
        elt = segments[0].element_size()
        local: list[Span] = []
        remote: list[Span] = []
        bounds, off = [], 0
        for seg in segments:
            bounds.append((seg, off))
            off += seg.shape[3]
        s = self.shape
        planes = itertools.product(range(s.num_layers), range(2), range(s.num_kv_heads))
        for plane, (layer, kv, head) in enumerate(planes):  # the order of KV_ORDER
            for seg, seg_off in bounds:
                a, b = max(seg_off, res.start), min(seg_off + seg.shape[3], end)
                if a >= b:
                    continue
                st = seg.stride()
                assert st[4] == 1 and st[3] == s.head_dim, "tokens of a plane must be contiguous"
                base = seg.data_ptr() + (layer * st[0] + kv * st[1] + head * st[2] + (a - seg_off) * st[3]) * elt
                local.append(Span(base, (b - a) * tb))
                remote.append(Span(res.addr + plane * res.plane_stride + (a - res.start) * tb, (b - a) * tb))
        return merge_spans(local, remote)  # whole edges on both sides collapse into one span
