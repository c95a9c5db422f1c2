"""Engine clients: one interface for `gyre.engine.local` and a real SGLang server.

Written against SGLang's documented native API (`/generate` with `input_ids` and `return_logprob`,
admin endpoints; docs/engine.md lists the mapping). Output token ids are read from
`meta_info.output_token_logprobs` when log-probs were requested - the ids the engine actually sampled,
as slime does - and from `output_ids` otherwise. Every failure surfaces as an `EngineError` subclass:
unreachable, timeout, HTTP error (with the body), or a response that breaks the protocol.

`HttpEngineClient` is async (the proxy's); `SyncHttpEngineClient` mirrors it for scripts and tests.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from gyre.engine.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeoutError,
    EngineUnreachableError,
)
from gyre.engine.protocol import (
    FinishReason,
    GenerateResponse,
    ModelInfo,
    PauseMode,
    SamplingParams,
    UpdateWeightsResponse,
)
from gyre.engine.tensors import NamedTensors, encode_named_tensors

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sgl-model-gateway's sticky-routing header


class GenerateResult(BaseModel):
    """What one `/generate` call produced. `finish_reason` is None only in non-final stream chunks."""

    model_config = ConfigDict(frozen=True)

    rid: str
    text: str | None
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | None
    latency: float  # seconds, measured by the client (includes the network)
    e2e_latency: float | None = None  # seconds, as reported by the engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, kw_only=True)
class EngineClientConfig:
    """Where the engine is and how long to wait. `generate_timeout_s=None` waits forever."""

    base_url: str
    generate_timeout_s: float | None = 600.0
    control_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"EngineClientConfig.base_url must be an http(s) URL, got {self.base_url!r}")


@runtime_checkable
class EngineClient(Protocol):
    """The engine operations Gyre needs (async). Implementations: `HttpEngineClient`."""

    base_url: str

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> GenerateResult: ...

    def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> AsyncIterator[GenerateResult]: ...

    async def abort(self, rid: str) -> None: ...

    async def abort_all(self) -> None: ...

    async def pause(self, mode: PauseMode = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(
        self, path: str, version: str | None = None, *, abort_all_requests: bool = False
    ) -> UpdateWeightsResponse: ...

    async def update_weights_from_tensor(
        self,
        named_tensors: NamedTensors,
        version: str | None = None,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsResponse: ...

    async def flush_cache(self) -> None: ...

    async def health(self) -> bool: ...

    async def model_info(self) -> ModelInfo: ...

    async def aclose(self) -> None: ...


# ---- request building and response parsing (shared by both transports) ----------------------------------


def generate_body(
    input_ids: Sequence[int],
    sampling_params: SamplingParams | Mapping[str, Any] | None,
    rid: str,
    return_logprob: bool,
    stream: bool = False,
) -> dict[str, Any]:
    """The `/generate` JSON. A mapping is sent verbatim (for SGLang-only knobs the local engine lacks)."""
    if sampling_params is None:
        params: dict[str, Any] = {}
    elif isinstance(sampling_params, SamplingParams):
        params = sampling_params.to_wire()
    else:
        params = dict(sampling_params)
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": params,
        "rid": rid,
        "return_logprob": return_logprob,
    }
    if stream:
        body["stream"] = True
    return body


def parse_generate(data: Any, rid: str, latency: float, *, final: bool = True) -> GenerateResult:
    """A SGLang `/generate` result (or cumulative stream chunk) as a `GenerateResult`."""
    try:
        resp = GenerateResponse.model_validate(data)
    except ValidationError as e:
        raise EngineProtocolError(f"/generate response does not match SGLang's shape: {e}") from e
    meta = resp.meta_info
    if final and meta.finish_reason is None:
        raise EngineProtocolError("/generate response has no meta_info.finish_reason")
    logprob_entries = meta.output_token_logprobs
    if logprob_entries is not None:
        output_ids = [int(e[1]) for e in logprob_entries]
        logprobs: list[float] | None = [float(e[0]) for e in logprob_entries]
    else:
        output_ids, logprobs = list(resp.output_ids), None
    return GenerateResult(
        rid=meta.id or rid,
        text=resp.text,
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=meta.finish_reason,
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens or len(output_ids),
        cached_tokens=meta.cached_tokens,
        weight_version=meta.weight_version,
        latency=latency,
        e2e_latency=meta.e2e_latency,
    )


def sse_payload(line: str) -> Any | None:
    """The JSON of one SSE `data:` line; None for blank/comment lines and `[DONE]`."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as e:
        raise EngineProtocolError(f"stream chunk is not JSON: {payload[:200]!r}") from e
    if isinstance(data, dict) and "error" in data:
        raise EngineProtocolError(f"engine reported an error mid-stream: {data['error']}")
    return data


def _check(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        raise EngineHTTPError(str(resp.request.url), resp.status_code, resp.text)
    return resp


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except json.JSONDecodeError as e:
        raise EngineProtocolError(f"{resp.request.url} answered non-JSON: {resp.text[:200]!r}") from e


def _weights_result(resp: httpx.Response) -> UpdateWeightsResponse:
    try:
        result = UpdateWeightsResponse.model_validate(_json(resp))
    except ValidationError as e:
        raise EngineProtocolError(f"weight update response does not match SGLang's shape: {e}") from e
    if not result.success:
        raise EngineProtocolError(f"engine refused the weight update: {result.message}")
    return result


def _transport_error(e: httpx.TransportError, url: str, timeout_s: float | None) -> EngineError:
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return EngineUnreachableError(url, str(e) or type(e).__name__)
    if isinstance(e, httpx.TimeoutException):
        return EngineTimeoutError(url, timeout_s)
    return EngineUnreachableError(url, f"{type(e).__name__}: {e}")  # connection dropped mid-request


def _tensor_body(
    named_tensors: NamedTensors, version: str | None, flush_cache: bool, abort_all_requests: bool
) -> dict[str, Any]:
    return {
        "serialized_named_tensors": [encode_named_tensors(named_tensors)],
        "load_format": "safetensors",
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": version,
    }


def _disk_body(path: str, version: str | None, abort_all_requests: bool) -> dict[str, Any]:
    return {"model_path": path, "weight_version": version, "abort_all_requests": abort_all_requests}


# ---- async client ----------------------------------------------------------------------------------------


class HttpEngineClient:
    """Async HTTP client of one engine (local or SGLang). Close with `aclose()` or `async with`."""

    def __init__(self, config: EngineClientConfig | str) -> None:
        self.config = EngineClientConfig(base_url=config) if isinstance(config, str) else config
        self.base_url = self.config.base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=dict(self.config.headers),
            timeout=httpx.Timeout(self.config.control_timeout_s, connect=self.config.connect_timeout_s),
        )

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _gen_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.config.generate_timeout_s, connect=self.config.connect_timeout_s)

    async def _request(self, method: str, path: str, *, body: Any = None, generate: bool = False) -> httpx.Response:
        timeout_s = self.config.generate_timeout_s if generate else self.config.control_timeout_s
        try:
            resp = await self._http.request(
                method, path, json=body, timeout=self._gen_timeout() if generate else httpx.USE_CLIENT_DEFAULT
            )
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url + path, timeout_s) from e
        return _check(resp)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> GenerateResult:
        rid = rid or uuid.uuid4().hex
        body = generate_body(input_ids, sampling_params, rid, return_logprob)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        start = time.perf_counter()
        try:
            resp = await self._http.post("/generate", json=body, headers=headers, timeout=self._gen_timeout())
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url + "/generate", self.config.generate_timeout_s) from e
        return parse_generate(_json(_check(resp)), rid, time.perf_counter() - start)

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """Cumulative results as the engine streams them (SGLang's default, non-incremental mode)."""
        rid = rid or uuid.uuid4().hex
        body = generate_body(input_ids, sampling_params, rid, return_logprob, stream=True)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        start = time.perf_counter()
        url = self.base_url + "/generate"
        try:
            async with self._http.stream(
                "POST", "/generate", json=body, headers=headers, timeout=self._gen_timeout()
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    _check(resp)
                async for line in resp.aiter_lines():
                    data = sse_payload(line)
                    if data is not None:
                        result = parse_generate(data, rid, time.perf_counter() - start, final=False)
                        yield result
        except httpx.TransportError as e:
            raise _transport_error(e, url, self.config.generate_timeout_s) from e

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", body={"rid": rid})

    async def abort_all(self) -> None:
        await self._request("POST", "/abort_request", body={"abort_all": True})

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", "/pause_generation", body={"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", body={})

    async def update_weights_from_disk(
        self, path: str, version: str | None = None, *, abort_all_requests: bool = False
    ) -> UpdateWeightsResponse:
        resp = await self._request(
            "POST", "/update_weights_from_disk", body=_disk_body(path, version, abort_all_requests)
        )
        return _weights_result(resp)

    async def update_weights_from_tensor(
        self,
        named_tensors: NamedTensors,
        version: str | None = None,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsResponse:
        body = _tensor_body(named_tensors, version, flush_cache, abort_all_requests)
        return _weights_result(await self._request("POST", "/update_weights_from_tensor", body=body))

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def health(self) -> bool:
        """True when the engine answers `/health` with 200; False when it is down or unhealthy."""
        try:
            await self._request("GET", "/health")
        except (EngineHTTPError, EngineUnreachableError, EngineTimeoutError):
            return False
        return True

    async def model_info(self) -> ModelInfo:
        resp = await self._request("GET", "/get_model_info")
        try:
            return ModelInfo.model_validate(_json(resp))
        except ValidationError as e:
            raise EngineProtocolError(f"/get_model_info response does not match SGLang's shape: {e}") from e


# ---- sync client -----------------------------------------------------------------------------------------


class SyncHttpEngineClient:
    """Blocking twin of `HttpEngineClient` (same methods, same errors) for scripts and tests."""

    def __init__(self, config: EngineClientConfig | str) -> None:
        self.config = EngineClientConfig(base_url=config) if isinstance(config, str) else config
        self.base_url = self.config.base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=dict(self.config.headers),
            timeout=httpx.Timeout(self.config.control_timeout_s, connect=self.config.connect_timeout_s),
        )

    def __enter__(self) -> SyncHttpEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _gen_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.config.generate_timeout_s, connect=self.config.connect_timeout_s)

    def _request(self, method: str, path: str, *, body: Any = None) -> httpx.Response:
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url + path, self.config.control_timeout_s) from e
        return _check(resp)

    def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> GenerateResult:
        rid = rid or uuid.uuid4().hex
        body = generate_body(input_ids, sampling_params, rid, return_logprob)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        start = time.perf_counter()
        try:
            resp = self._http.post("/generate", json=body, headers=headers, timeout=self._gen_timeout())
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url + "/generate", self.config.generate_timeout_s) from e
        return parse_generate(_json(_check(resp)), rid, time.perf_counter() - start)

    def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> Iterator[GenerateResult]:
        rid = rid or uuid.uuid4().hex
        body = generate_body(input_ids, sampling_params, rid, return_logprob, stream=True)
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        start = time.perf_counter()
        try:
            with self._http.stream(
                "POST", "/generate", json=body, headers=headers, timeout=self._gen_timeout()
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _check(resp)
                for line in resp.iter_lines():
                    data = sse_payload(line)
                    if data is not None:
                        yield parse_generate(data, rid, time.perf_counter() - start, final=False)
        except httpx.TransportError as e:
            raise _transport_error(e, self.base_url + "/generate", self.config.generate_timeout_s) from e

    def abort(self, rid: str) -> None:
        self._request("POST", "/abort_request", body={"rid": rid})

    def abort_all(self) -> None:
        self._request("POST", "/abort_request", body={"abort_all": True})

    def pause(self, mode: PauseMode = "abort") -> None:
        self._request("POST", "/pause_generation", body={"mode": mode})

    def resume(self) -> None:
        self._request("POST", "/continue_generation", body={})

    def update_weights_from_disk(
        self, path: str, version: str | None = None, *, abort_all_requests: bool = False
    ) -> UpdateWeightsResponse:
        return _weights_result(
            self._request("POST", "/update_weights_from_disk", body=_disk_body(path, version, abort_all_requests))
        )

    def update_weight_version(self, version: str) -> None:
        """Name the weights the engine holds (SGLang's `/update_weight_version`; requests keep running)."""
        self._request("POST", "/update_weight_version", body={"new_version": version, "abort_all_requests": False})

    def update_weights_from_tensor(
        self,
        named_tensors: NamedTensors,
        version: str | None = None,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsResponse:
        body = _tensor_body(named_tensors, version, flush_cache, abort_all_requests)
        return _weights_result(self._request("POST", "/update_weights_from_tensor", body=body))

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's release of GPU memory before a cell trains (``tags``: "weights", "kv_cache"; None: both)."""
        self._request("POST", "/release_memory_occupation", body={} if tags is None else {"tags": list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self._request("POST", "/resume_memory_occupation", body={} if tags is None else {"tags": list(tags)})

    def health(self) -> bool:
        try:
            self._request("GET", "/health")
        except (EngineHTTPError, EngineUnreachableError, EngineTimeoutError):
            return False
        return True

    def model_info(self) -> ModelInfo:
        resp = self._request("GET", "/get_model_info")
        try:
            return ModelInfo.model_validate(_json(resp))
        except ValidationError as e:
            raise EngineProtocolError(f"/get_model_info response does not match SGLang's shape: {e}") from e
