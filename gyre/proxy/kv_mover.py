"""`MooncakeKvMover`: a redirected call's KV moves from the old engine to the new one instead of being
recomputed. The proxy only orchestrates - reserve on the new engine, export (a Mooncake write, engine to
engine) on the old one, commit on the new one - and the bytes never pass through it.

Refusals are outcomes, not failures: a different policy version, page size or layout, an engine that
cannot be reached (a dead cell) or a transfer that fails all leave the call to recompute its prefix, and the
reason goes into the `call_redirected` event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import httpx

from gyre.engine.errors import EngineError, KvRefusedError
from gyre.engine.kv_client import KvClient
from gyre.errors import GyreError
from gyre.proxy.routing import KvMove, KvMoveResult

log = logging.getLogger(__name__)


class MooncakeKvMover:
    """Moves KV pages between engines that serve Gyre's `/gyre/kv/*` endpoints. `engines` gives a cell's
    engine base URL (a mapping, or the proxy's router, so cells added later are found too)."""

    def __init__(self, engines: Mapping[str, str] | Callable[[str], str], *, timeout_s: float = 120.0) -> None:
        self._url_of = engines.__getitem__ if isinstance(engines, Mapping) else engines
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._timeout_s = timeout_s

    def _client(self, cell: str) -> KvClient:
        return KvClient(self._url_of(cell), self._http, self._timeout_s)

    async def move(self, move: KvMove) -> KvMoveResult:
        ids = list(move.token_ids)
        started = time.perf_counter()
        try:
            src, dst = self._client(move.from_cell), self._client(move.to_cell)
        except (KeyError, GyreError) as e:
            return self._refused(move, ids, f"no engine URL for the cell: {e}")
        try:
            reservation = await dst.reserve(ids)
            try:
                exported = await src.export(ids, reservation, move.rid)
            except EngineError:
                await self._cancel(dst, reservation.reservation_id)
                raise
            committed = await dst.commit(reservation.reservation_id, exported.end)
        except KvRefusedError as e:
            return self._refused(move, ids, f"{e.field}: {e.message}")
        except EngineError as e:  # unreachable cell, transfer failure (HTTP 502), bad answer
            return self._refused(move, ids, str(e))
        cached = min(committed.cached_tokens, len(ids) - 1)  # the last token is always computed again
        return KvMoveResult(
            blocks=exported.pages,
            bytes=exported.bytes,
            tokens=exported.tokens,
            transfer_seconds=exported.seconds,
            seconds=time.perf_counter() - started,
            tokens_recomputed=len(ids) - cached,
        )

    @staticmethod
    def _refused(move: KvMove, ids: list[int], reason: str) -> KvMoveResult:
        log.info("call %s: KV not moved %s -> %s (%s); the new engine recomputes it",
                 move.call_id, move.from_cell, move.to_cell, reason)
        return KvMoveResult(tokens_recomputed=len(ids), refused=reason)

    @staticmethod
    async def _cancel(client: KvClient, reservation_id: str) -> None:
        try:
            await client.cancel(reservation_id)
        except EngineError as e:  # the reservation expires on its own (MAX_OPEN_RESERVATIONS)
            log.warning("cancelling KV reservation %s at %s failed: %s", reservation_id, client.base_url, e)

    async def aclose(self) -> None:
        await self._http.aclose()
