"""Async client of an engine's Gyre-only KV migration endpoints (`gyre.engine.kv_protocol`); no torch."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from gyre.engine.client import _transport_error
from gyre.engine.errors import EngineHTTPError, EngineProtocolError, KvRefusedError
from gyre.engine.kv_protocol import (
    KV_BODY_TYPE,
    KvCommitResult,
    KvExportResult,
    KvImportResult,
    KvLayout,
    KvOffer,
    KvReservation,
    frame_body,
    ids_bytes,
)

M = TypeVar("M", bound=BaseModel)
IdsArg = bytes | Sequence[int]
"""Token ids, or `ids_bytes` of them."""


def _wire(ids: IdsArg) -> bytes:
    return ids if isinstance(ids, bytes) else ids_bytes(ids)


class KvClient:
    """`/gyre/kv/*` of one engine. A 409 answer becomes `KvRefusedError` (the caller recomputes). Token ids
    travel raw after the call's JSON fields (`KV_BODY_TYPE`); a caller making several calls on one prefix
    converts it once (`ids_bytes`) and passes the bytes (`IdsArg`)."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self.timeout_s = timeout_s

    async def layout(self) -> KvLayout:
        return await self._call("GET", "/gyre/kv/layout", None, KvLayout)

    async def offer(self, input_ids: IdsArg, rid: str | None = None) -> KvOffer:
        return await self._call("POST", "/gyre/kv/offer", {"rid": rid}, KvOffer, ids=_wire(input_ids))

    async def import_(self, input_ids: IdsArg, offer: KvOffer) -> KvImportResult:
        body = {"offer": offer.model_dump()}
        return await self._call("POST", "/gyre/kv/import", body, KvImportResult, ids=_wire(input_ids))

    async def release(self, offer_id: str) -> None:
        await self._call("POST", "/gyre/kv/release", {"offer_id": offer_id}, None)

    async def reserve(self, input_ids: IdsArg) -> KvReservation:
        return await self._call("POST", "/gyre/kv/reserve", {}, KvReservation, ids=_wire(input_ids))

    async def export(self, input_ids: IdsArg, reservation: KvReservation, rid: str | None = None) -> KvExportResult:
        body = {"rid": rid, "reservation": reservation.model_dump()}
        return await self._call("POST", "/gyre/kv/export", body, KvExportResult, ids=_wire(input_ids))

    async def commit(self, reservation_id: str, end: int) -> KvCommitResult:
        body = {"reservation_id": reservation_id, "end": end}
        return await self._call("POST", "/gyre/kv/commit", body, KvCommitResult)

    async def cancel(self, reservation_id: str) -> None:
        await self._call("POST", "/gyre/kv/cancel", {"reservation_id": reservation_id}, None)

    async def _call(self, method: str, path: str, body: Any, model: type[M] | None, *,
                    ids: bytes | None = None) -> Any:
        url = self.base_url + path
        if ids is not None:
            content, kind = frame_body(body, ids), KV_BODY_TYPE
        else:
            content, kind = None if body is None else json.dumps(body).encode(), "application/json"
        try:
            resp = await self._http.request(
                method, url, content=content, headers={"content-type": kind}, timeout=self.timeout_s,
            )
        except httpx.TransportError as e:
            raise _transport_error(e, url, self.timeout_s) from e
        if resp.status_code == 409:
            error = resp.json().get("error", {})
            raise KvRefusedError(error.get("field", "kv"), error.get("message", resp.text))
        if resp.status_code >= 400:
            raise EngineHTTPError(url, resp.status_code, resp.text)
        if model is None:
            return None
        try:
            return model.model_validate_json(resp.content)
        except ValidationError as e:
            raise EngineProtocolError(f"{url} answered an unexpected body: {e}") from e
