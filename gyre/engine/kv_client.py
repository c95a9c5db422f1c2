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
from gyre.engine.wire import WirePool, post_or_raise

M = TypeVar("M", bound=BaseModel)
IdsArg = bytes | Sequence[int]
"""Token ids (a list, an `array("i")`, an int ndarray), or `ids_bytes` of them."""


def _wire(ids: IdsArg) -> bytes:
    return ids if isinstance(ids, bytes) else ids_bytes(ids)


class KvClient:
    """`/gyre/kv/*` of one engine. A 409 answer becomes `KvRefusedError` (the caller recomputes). Token ids
    travel raw after the call's JSON fields (`KV_BODY_TYPE`); a caller making several calls on one prefix
    converts it once (`ids_bytes`) and passes the bytes (`IdsArg`). With `wire` (a `WirePool` to the same
    `http://` engine), POSTs go through it instead of httpx: a redirect's two calls on the critical path save
    about a millisecond each."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, timeout_s: float = 120.0,
                 wire: WirePool | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._wire = wire
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
        status, answer = await self._send(method, path, content, kind)
        if status == 409:
            try:
                error = json.loads(answer).get("error", {})
            except (ValueError, AttributeError):
                error = {}
            raise KvRefusedError(error.get("field", "kv"), error.get("message", answer.decode(errors="replace")))
        if status >= 400:
            raise EngineHTTPError(url, status, answer.decode(errors="replace"))
        if model is None:
            return None
        try:
            return model.model_validate_json(answer)
        except ValidationError as e:
            raise EngineProtocolError(f"{url} answered an unexpected body: {e}") from e

    async def _send(self, method: str, path: str, content: bytes | None, kind: str) -> tuple[int, bytes]:
        url = self.base_url + path
        if self._wire is not None and method == "POST":
            answer = await post_or_raise(self._wire, path, content or b"", {"content-type": kind}, self.timeout_s, url)
            return answer.status, answer.body
        try:
            resp = await self._http.request(
                method, url, content=content, headers={"content-type": kind}, timeout=self.timeout_s,
            )
        except httpx.TransportError as e:
            raise _transport_error(e, url, self.timeout_s) from e
        return resp.status_code, resp.content
