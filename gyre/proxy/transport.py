"""The proxy's link to an engine: SGLang's `/generate`, with the prompt sent as cached JSON.

A call in a 700K-token execution sends 700K ids. Serialising them afresh costs tens of milliseconds of the
proxy's single event loop per call; but all but the newest few are the recorded ids of earlier calls, which
never change. So each finished call keeps the JSON text of its own tokens (`CallRecord.wire`), and a prompt
goes out as those fragments joined (a memcpy) plus the JSON of what is new: O(new tokens) of real work.

Responses are parsed with `gyre.engine`'s SGLang parser and failures raise `gyre.engine`'s errors, so the
rest of the proxy sees exactly what `HttpEngineClient` would give it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from gyre.engine import (
    EngineHTTPError,
    EngineProtocolError,
    GenerateResult,
    SamplingParams,
)
from gyre.engine.client import ROUTING_KEY_HEADER, _transport_error, parse_generate, sse_payload
from gyre.engine.wire import WirePool, post_or_raise
from gyre.proxy.tito import CallRecord


@dataclass(frozen=True, slots=True)
class Prompt:
    """Prompt ids as JSON fragments (comma-separated ids, no brackets) and their count."""

    fragments: tuple[bytes, ...]
    length: int

    @classmethod
    def of(cls, ids: Sequence[int]) -> Prompt:
        return cls((_ids_json(ids),) if len(ids) else (), len(ids))

    def ids(self) -> list[int]:
        return json.loads(b"[" + b",".join(self.fragments) + b"]")

    def json(self) -> bytes:
        return b"[" + b",".join(self.fragments) + b"]"


def _ids_json(ids: Sequence[int]) -> bytes:
    return ",".join(map(str, ids)).encode()


def prompt_of(record: CallRecord, extra: Sequence[int] = ()) -> Prompt:
    """`record`'s prompt (plus `extra` ids: the partial output of a continued call) as a `Prompt`."""
    fragments: list[bytes] = []
    for rec, lo, hi in record.spans(0, record.prompt_len):
        if lo == 0 and hi == len(rec.tokens) and rec.finished:
            if not isinstance(rec.wire, bytes):
                rec.wire = _ids_json(rec.tokens)
            piece = rec.wire
        else:
            piece = _ids_json(rec.tokens[lo:hi])
        if piece:
            fragments.append(piece)
    if extra:
        fragments.append(_ids_json(extra))
    return Prompt(tuple(fragments), record.prompt_len + len(extra))


class GenerateEngine(Protocol):
    """What a proxy call needs from an engine. `EngineLink` speaks it over HTTP; tests may fake it."""

    base_url: str

    async def generate(
        self, prompt: Prompt, params: SamplingParams, rid: str, *, routing_key: str | None = None
    ) -> GenerateResult: ...

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams, rid: str, *, routing_key: str | None = None
    ) -> AsyncIterator[GenerateResult]: ...

    async def abort(self, rid: str) -> None: ...

    async def aclose(self) -> None: ...


class EngineLink:
    """HTTP link to one SGLang-speaking engine, with a connection pool sized for hundreds of calls."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float | None = 600.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 1024,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must be http(s), got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._wire = WirePool(self.base_url, max_connections) if self.base_url.startswith("http://") else None

    def _body(self, prompt: Prompt, params: SamplingParams, rid: str, stream: bool) -> bytes:
        """The `/generate` JSON, built with one copy of the (possibly megabytes of) id fragments."""
        rest: dict[str, Any] = {"sampling_params": params.to_wire(), "rid": rid, "return_logprob": True}
        if stream:
            rest["stream"] = True
        parts = [b'{"input_ids":[']
        for fragment in prompt.fragments:
            parts += (fragment, b",")
        if prompt.fragments:
            parts.pop()
        parts.append(b"]," + json.dumps(rest).encode()[1:])
        return b"".join(parts)

    def _headers(self, routing_key: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if routing_key:
            headers[ROUTING_KEY_HEADER] = routing_key
        return headers

    async def generate(
        self, prompt: Prompt, params: SamplingParams, rid: str, *, routing_key: str | None = None
    ) -> GenerateResult:
        start = time.perf_counter()
        body = self._body(prompt, params, rid, False)
        status, content = await self._post("/generate", body, self._headers(routing_key))
        if status >= 400:
            raise EngineHTTPError(self.base_url + "/generate", status, content.decode(errors="replace"))
        try:
            data = json.loads(content)
        except json.JSONDecodeError as e:
            raise EngineProtocolError(f"/generate answered non-JSON: {content[:200]!r}") from e
        return parse_generate(data, rid, time.perf_counter() - start)

    async def _post(
        self, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._wire is None:
            try:
                response = await self._http.post(path, content=body, headers=headers, timeout=timeout_s)
            except httpx.TransportError as e:
                raise _transport_error(e, self.base_url, self.timeout_s) from e
            return response.status_code, response.content
        response = await post_or_raise(self._wire, path, body, headers, timeout_s, self.base_url)
        return response.status, response.body

    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams, rid: str, *, routing_key: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        """Cumulative results as the engine streams them (SGLang's default, non-incremental chunks)."""
        start = time.perf_counter()
        try:
            async with self._http.stream(
                "POST", "/generate", content=self._body(prompt, params, rid, True), headers=self._headers(routing_key)
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise EngineHTTPError(self.base_url + "/generate", response.status_code, response.text)
                async for line in response.aiter_lines():
                    data = sse_payload(line)
                    if data is not None:
                        yield parse_generate(data, rid, time.perf_counter() - start, final=False)
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url, self.timeout_s) from e

    async def context_length(self) -> int | None:
        """The engine's context length from `/get_model_info` (`context_length`), None when it does not say."""
        try:
            response = await self._http.get("/get_model_info", timeout=30.0)
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url, self.timeout_s) from e
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise EngineHTTPError(self.base_url + "/get_model_info", response.status_code, response.text)
        try:
            value = response.json().get("context_length")
        except (json.JSONDecodeError, AttributeError) as e:
            raise EngineProtocolError(f"/get_model_info answered non-JSON: {response.text[:200]!r}") from e
        return value if isinstance(value, int) and value > 1 else None

    async def abort(self, rid: str) -> None:
        status, content = await self._post(
            "/abort_request", json.dumps({"rid": rid}).encode(), {"content-type": "application/json"}, timeout_s=30.0
        )
        if status >= 400:
            raise EngineHTTPError(self.base_url + "/abort_request", status, content.decode(errors="replace"))

    async def aclose(self) -> None:
        if self._wire is not None:
            self._wire.close()
        await self._http.aclose()
