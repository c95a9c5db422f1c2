"""`MooncakeKvMover`: a redirected call's KV moves from the old engine to the new one instead of being
recomputed. The proxy only orchestrates and the bytes never pass through it. The default pull path makes
two calls on the critical path - offer on the old engine (it holds its blocks and says where they are),
import on the new one (it reads them with Mooncake and inserts them into its cache) - and releases the
offer after the move, off the critical path. The push path (`path="push"`: reserve on the new engine,
export - a Mooncake write - on the old one, commit on the new one) makes three, each parsing the prefix's
ids again: kept for comparison (`benchmarks/kv_migration_bench.py`).

Refusals are outcomes, not failures: a different policy version, page size or layout, an engine that
cannot be reached (a dead cell) or a transfer that fails all leave the call to recompute its prefix, and the
reason goes into the `call_redirected` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Literal

import httpx

from gyre.engine.errors import EngineError, KvRefusedError
from gyre.engine.kv_client import KvClient
from gyre.engine.kv_protocol import ids_bytes
from gyre.engine.wire import WirePool
from gyre.errors import GyreError
from gyre.proxy.routing import KvMove, KvMoveResult

log = logging.getLogger(__name__)


class MooncakeKvMover:
    """Moves KV pages between engines that serve Gyre's `/gyre/kv/*` endpoints. `engines` gives a cell's
    engine base URL (a mapping, or the proxy's router, so cells added later are found too)."""

    def __init__(self, engines: Mapping[str, str] | Callable[[str], str], *, timeout_s: float = 120.0,
                 path: Literal["pull", "push"] = "pull") -> None:
        if path not in ("pull", "push"):
            raise ValueError(f"MooncakeKvMover path must be 'pull' or 'push', got {path!r}")
        self._url_of = engines.__getitem__ if isinstance(engines, Mapping) else engines
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._wires: dict[str, WirePool] = {}
        """Kept-alive connections per plain-http engine URL (the calls' POSTs skip httpx's ~1 ms each)."""
        self._timeout_s = timeout_s
        self.path = path
        self._releases: set[asyncio.Task[None]] = set()

    def _client(self, cell: str) -> KvClient:
        url = self._url_of(cell).rstrip("/")
        wire = self._wires.get(url)
        if wire is None and url.startswith("http://"):
            wire = self._wires[url] = WirePool(url, max_idle=8)
        return KvClient(url, self._http, self._timeout_s, wire)

    async def move(self, move: KvMove) -> KvMoveResult:
        n = len(move.token_ids)
        started = time.perf_counter()
        try:
            src, dst = self._client(move.from_cell), self._client(move.to_cell)
        except (KeyError, ValueError, GyreError) as e:
            return self._refused(move, f"no engine URL for the cell: {e}")
        try:
            wire = ids_bytes(move.token_ids)  # once: both calls carry the same prefix
            if self.path == "pull":
                offer = await src.offer(wire, move.rid)
                try:
                    done = await dst.import_(wire, offer)
                finally:
                    self._release_later(src, offer.offer_id)
                blocks, nbytes, tokens = done.pages, done.bytes, done.tokens
                transfer, cached = done.seconds, done.cached_tokens
            else:
                reservation = await dst.reserve(wire)
                try:
                    exported = await src.export(wire, reservation, move.rid)
                except EngineError:
                    await self._cancel(dst, reservation.reservation_id)
                    raise
                committed = await dst.commit(reservation.reservation_id, exported.end)
                blocks, nbytes, tokens = exported.pages, exported.bytes, exported.tokens
                transfer, cached = exported.seconds, committed.cached_tokens
        except KvRefusedError as e:
            return self._refused(move, f"{e.field}: {e.message}")
        except EngineError as e:  # unreachable cell, transfer failure (HTTP 502), bad answer
            return self._refused(move, str(e))
        cached = min(cached, n - 1)  # the last token is always computed again
        return KvMoveResult(
            blocks=blocks,
            bytes=nbytes,
            tokens=tokens,
            transfer_seconds=transfer,
            seconds=time.perf_counter() - started,
            tokens_recomputed=n - cached,
        )

    def _release_later(self, client: KvClient, offer_id: str) -> None:
        """Release an offer without delaying the call (the old engine expires offers nobody releases)."""

        async def release() -> None:
            try:
                await client.release(offer_id)
            except EngineError as e:
                log.warning("releasing KV offer %s at %s failed: %s", offer_id, client.base_url, e)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    @staticmethod
    def _refused(move: KvMove, reason: str) -> KvMoveResult:
        log.info("call %s: KV not moved %s -> %s (%s); the new engine recomputes it",
                 move.call_id, move.from_cell, move.to_cell, reason)
        return KvMoveResult(tokens_recomputed=len(move.token_ids), refused=reason)

    @staticmethod
    async def _cancel(client: KvClient, reservation_id: str) -> None:
        try:
            await client.cancel(reservation_id)
        except EngineError as e:  # the reservation expires on its own (MAX_OPEN_RESERVATIONS)
            log.warning("cancelling KV reservation %s at %s failed: %s", reservation_id, client.base_url, e)

    async def settled(self) -> None:
        """Wait for the offers released in the background (tests and shutdown)."""
        while self._releases:
            await asyncio.gather(*list(self._releases))

    async def aclose(self) -> None:
        await self.settled()
        for wire in self._wires.values():
            wire.close()
        self._wires.clear()
        await self._http.aclose()
