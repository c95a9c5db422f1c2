"""Engine clients: one interface for `gyre.engine.local` and a real SGLang server.

Written against SGLang's documented native API (`/generate` with `input_ids` and `return_logprob`,
admin endpoints; docs/engine.md lists the mapping). Output token ids are read from
`meta_info.output_token_logprobs` when log-probs were requested - the ids the engine actually sampled,
as slime does - and from `output_ids` otherwise. Every failure surfaces as an `EngineError` subclass:
unreachable, timeout, HTTP error (with the body), or a response that breaks the protocol.

One implementation, two faces: `_EngineCalls` builds every request (`_Call`: method, path, body, how to read
the answer) and reads every answer; `HttpEngineClient` (async: the proxy's) and
`SyncHttpEngineClient` (blocking: cells, scripts, tests) only move bytes. So an endpoint, a field or an
error rule is written once and both faces have it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, Union, runtime_checkable

import httpx
import orjson
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
from gyre.engine.wire import WirePool, post_or_raise

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
    """Where the engine is and how long to wait. `generate_timeout_s=None` waits forever.

    `max_connections`: the connection pool's size (None: httpx's default), for a caller with hundreds of
    calls in flight. `wire`: the async client sends its POSTs that do not stream over `gyre.engine.wire`
    (plain http only; about 0.1 ms of CPU a call against httpx's 0.9, on the proxy's single event loop).
    """

    base_url: str
    generate_timeout_s: float | None = 600.0
    control_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)
    max_connections: int | None = None
    wire: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"EngineClientConfig.base_url must be an http(s) URL, got {self.base_url!r}")


@runtime_checkable
class EngineClient(Protocol):
    """The engine operations Gyre needs (async). Implementations: `HttpEngineClient`."""

    base_url: str

    async def generate(
        self,
        input_ids: Sequence[int] | Prompt,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> GenerateResult: ...

    def generate_stream(
        self,
        input_ids: Sequence[int] | Prompt,
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


@dataclass(frozen=True, slots=True)
class Prompt:
    """Prompt ids as JSON fragments (comma-separated ids, no brackets) and their count.

    A call in a 700K-token execution sends 700K ids; the proxy keeps the JSON of each recorded call's ids
    and sends a prompt as those fragments joined (a memcpy) plus the JSON of what is new."""

    fragments: tuple[bytes, ...]
    length: int

    @classmethod
    def of(cls, ids: Sequence[int]) -> Prompt:
        return cls((ids_json(ids),) if len(ids) else (), len(ids))

    def ids(self) -> list[int]:
        return json.loads(self.json())

    def json(self) -> bytes:
        return b"[" + b",".join(self.fragments) + b"]"


def ids_json(ids: Sequence[int]) -> bytes:
    """Token ids as one `Prompt` fragment (orjson: ~20x joining `str`s, ~40 us a call's 500 new ids)."""
    if not isinstance(ids, list):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # array.array, numpy
    try:
        return orjson.dumps(ids)[1:-1]
    except TypeError:  # ids that are not Python ints (numpy scalars in a list): what `str` makes of them
        return ",".join(map(str, ids)).encode()


# ---- request building and response parsing (shared by both faces) ----------------------------------------


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


def generate_json(
    input_ids: Sequence[int] | Prompt,
    sampling_params: SamplingParams | Mapping[str, Any] | None,
    rid: str,
    return_logprob: bool,
    stream: bool = False,
) -> bytes:
    """`generate_body` as JSON bytes, with a `Prompt`'s fragments copied once into it."""
    if not isinstance(input_ids, Prompt):
        return orjson.dumps(generate_body(input_ids, sampling_params, rid, return_logprob, stream))
    rest = generate_body((), sampling_params, rid, return_logprob, stream)
    del rest["input_ids"]
    parts = [b'{"input_ids":[']
    for fragment in input_ids.fragments:
        parts += (fragment, b",")
    if input_ids.fragments:
        parts.pop()
    parts.append(b"]," + orjson.dumps(rest)[1:])
    return b"".join(parts)


T = TypeVar("T")
BaseModelT = TypeVar("BaseModelT", bound=BaseModel)
_Reply = Union[T, Awaitable[T]]  # noqa: UP007 - a generic alias: `_Reply[X]`
"""What an operation returns: the value from `SyncHttpEngineClient`, an awaitable of it from `HttpEngineClient`."""
_JSON = {"content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class _Answer:
    """An engine's answer to one request, whichever face sent it."""

    url: str
    status: int
    content: bytes
    latency: float  # seconds from sending to the whole answer read

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def ok(self) -> _Answer:
        if self.status >= 400:
            raise EngineHTTPError(self.url, self.status, self.text)
        return self

    def json(self) -> Any:
        content = self.ok().content
        try:
            return orjson.loads(content)  # ~4x json.loads on a /generate answer
        except orjson.JSONDecodeError:
            pass  # perhaps NaN or Infinity, which Python's json writes and orjson refuses
        try:
            return json.loads(content)
        except ValueError as e:
            raise EngineProtocolError(f"{self.url} answered non-JSON: {self.text[:200]!r}") from e


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """One request and how to read its answer. `soft` (a GET): an engine that is down answers `read(None)`."""

    method: str
    path: str
    read: Callable[[Any], T]
    body: bytes | None = None
    generate: bool = False  # runs under the generate timeout, not the control one
    soft: bool = False
    routing_key: str | None = None

    def headers(self) -> dict[str, str]:
        headers = dict(_JSON) if self.body is not None else {}
        if self.routing_key:
            headers[ROUTING_KEY_HEADER] = self.routing_key
        return headers


def _no_content(answer: _Answer) -> None:
    answer.ok()


def _post(path: str, body: Any = None, read: Callable[[_Answer], Any] = _no_content) -> _Call[Any]:
    return _Call("POST", path, read, None if body is None else json.dumps(body).encode())


def _model(model: type[BaseModelT], what: str) -> Callable[[_Answer], BaseModelT]:
    def read(answer: _Answer) -> BaseModelT:
        try:
            return model.model_validate(answer.json())
        except ValidationError as e:
            raise EngineProtocolError(f"{what} response does not match SGLang's shape: {e}") from e

    return read


def _weights_result(answer: _Answer) -> UpdateWeightsResponse:
    result = _model(UpdateWeightsResponse, "weight update")(answer)
    if not result.success:
        raise EngineProtocolError(f"engine refused the weight update: {result.message}")
    return result


def _context_length(answer: _Answer) -> int | None:
    if answer.status == 404:
        return None
    data = answer.json()
    if not isinstance(data, dict):
        raise EngineProtocolError(f"{answer.url} answered non-JSON: {answer.text[:200]!r}")
    value = data.get("context_length")
    return value if isinstance(value, int) and value > 1 else None


def _transport_error(e: httpx.TransportError, url: str, timeout_s: float | None) -> EngineError:
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return EngineUnreachableError(url, str(e) or type(e).__name__)
    if isinstance(e, httpx.TimeoutException):
        return EngineTimeoutError(url, timeout_s)
    return EngineUnreachableError(url, f"{type(e).__name__}: {e}")  # connection dropped mid-request


def _memory_body(tags: Sequence[str] | None) -> dict[str, Any]:
    return {} if tags is None else {"tags": list(tags)}


# ---- the one implementation ------------------------------------------------------------------------------


class _EngineCalls:
    """Every engine operation, written once as a `_Call`; a face runs it (`_run`, `_stream`)."""

    def __init__(self, config: EngineClientConfig | str) -> None:
        self.config = EngineClientConfig(base_url=config) if isinstance(config, str) else config
        self.base_url = self.config.base_url.rstrip("/")

    def _http_options(self) -> dict[str, Any]:
        c = self.config
        limits = {} if c.max_connections is None else {"limits": httpx.Limits(
            max_connections=c.max_connections, max_keepalive_connections=c.max_connections)}
        return {"base_url": self.base_url, "headers": dict(c.headers),
                "timeout": httpx.Timeout(c.control_timeout_s, connect=c.connect_timeout_s), **limits}

    def _timeout_s(self, call: _Call[Any]) -> float | None:
        return self.config.generate_timeout_s if call.generate else self.config.control_timeout_s

    def _httpx_timeout(self, call: _Call[Any]) -> httpx.Timeout | Any:
        if not call.generate:
            return httpx.USE_CLIENT_DEFAULT
        return httpx.Timeout(self.config.generate_timeout_s, connect=self.config.connect_timeout_s)

    def _run(self, call: _Call[T]) -> _Reply[T]:
        raise NotImplementedError

    def _stream(self, call: _Call[T]) -> Iterator[T] | AsyncIterator[T]:
        raise NotImplementedError

    @staticmethod
    def _generate_call(
        input_ids: Sequence[int] | Prompt,
        sampling_params: SamplingParams | Mapping[str, Any] | None,
        rid: str | None,
        return_logprob: bool,
        routing_key: str | None,
        stream: bool,
    ) -> _Call[Any]:
        rid = rid or uuid.uuid4().hex
        body = generate_json(input_ids, sampling_params, rid, return_logprob, stream)
        if stream:  # a stream's `read` takes one SSE line and the time since sending
            def read(line: str, latency: float) -> GenerateResult | None:
                data = sse_payload(line)
                return None if data is None else parse_generate(data, rid, latency, final=False)

            return _Call("POST", "/generate", read, body, generate=True, routing_key=routing_key)
        return _Call("POST", "/generate", lambda a: parse_generate(a.json(), rid, a.latency), body,
                     generate=True, routing_key=routing_key)

    def generate(
        self,
        input_ids: Sequence[int] | Prompt,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> _Reply[GenerateResult]:
        return self._run(self._generate_call(input_ids, sampling_params, rid, return_logprob, routing_key, False))

    def generate_stream(
        self,
        input_ids: Sequence[int] | Prompt,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None,
        *,
        return_logprob: bool = True,
        routing_key: str | None = None,
    ) -> Iterator[GenerateResult] | AsyncIterator[GenerateResult]:
        """Cumulative results as the engine streams them (SGLang's default, non-incremental mode)."""
        return self._stream(self._generate_call(input_ids, sampling_params, rid, return_logprob, routing_key, True))

    def abort(self, rid: str) -> _Reply[None]:
        return self._run(_post("/abort_request", {"rid": rid}))

    def abort_all(self) -> _Reply[None]:
        return self._run(_post("/abort_request", {"abort_all": True}))

    def pause(self, mode: PauseMode = "abort") -> _Reply[None]:
        return self._run(_post("/pause_generation", {"mode": mode}))

    def resume(self) -> _Reply[None]:
        return self._run(_post("/continue_generation", {}))

    def update_weights_from_disk(
        self, path: str, version: str | None = None, *, abort_all_requests: bool = False
    ) -> _Reply[UpdateWeightsResponse]:
        body = {"model_path": path, "weight_version": version, "abort_all_requests": abort_all_requests}
        return self._run(_post("/update_weights_from_disk", body, _weights_result))

    def update_weights_from_tensor(
        self,
        named_tensors: NamedTensors,
        version: str | None = None,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> _Reply[UpdateWeightsResponse]:
        body = {
            "serialized_named_tensors": [encode_named_tensors(named_tensors)],
            "load_format": "safetensors",
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": version,
        }
        return self._run(_post("/update_weights_from_tensor", body, _weights_result))

    def update_weight_version(self, version: str) -> _Reply[None]:
        """Name the weights the engine holds (SGLang's `/update_weight_version`; requests keep running)."""
        return self._run(_post("/update_weight_version", {"new_version": version, "abort_all_requests": False}))

    def flush_cache(self) -> _Reply[None]:
        return self._run(_post("/flush_cache"))

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> _Reply[None]:
        """SGLang's release of GPU memory before a cell trains (``tags``: "weights", "kv_cache"; None: both)."""
        return self._run(_post("/release_memory_occupation", _memory_body(tags)))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> _Reply[None]:
        return self._run(_post("/resume_memory_occupation", _memory_body(tags)))

    def health(self) -> _Reply[bool]:
        """True when the engine answers `/health` with 200; False when it is down or unhealthy."""
        return self._run(_Call("GET", "/health", lambda a: a is not None and a.status < 400, soft=True))

    def model_info(self) -> _Reply[ModelInfo]:
        return self._run(_Call("GET", "/get_model_info", _model(ModelInfo, "/get_model_info")))

    def context_length(self) -> _Reply[int | None]:
        """The engine's context length from `/get_model_info` (`context_length`), None when it does not say."""
        return self._run(_Call("GET", "/get_model_info", _context_length))


class HttpEngineClient(_EngineCalls):
    """Async HTTP client of one engine (local or SGLang). Close with `aclose()` or `async with`."""

    def __init__(self, config: EngineClientConfig | str) -> None:
        super().__init__(config)
        self._http = httpx.AsyncClient(**self._http_options())
        wire = self.config.wire and self.base_url.startswith("http://")
        self._wire = WirePool(self.base_url, self.config.max_connections or 1024) if wire else None

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._wire is not None:
            self._wire.close()
        await self._http.aclose()

    async def _run(self, call: _Call[T]) -> T:
        url, timeout_s, start = self.base_url + call.path, self._timeout_s(call), time.perf_counter()
        if self._wire is not None and call.method == "POST":  # soft calls are GETs: never here
            headers = {**self.config.headers, **call.headers()}
            r = await post_or_raise(self._wire, call.path, call.body or b"", headers, timeout_s, url)
            return call.read(_Answer(url, r.status, r.body, time.perf_counter() - start))
        try:
            resp = await self._http.request(call.method, call.path, content=call.body, headers=call.headers(),
                                            timeout=self._httpx_timeout(call))
        except httpx.TransportError as e:
            if call.soft:
                return call.read(None)
            raise _transport_error(e, url, timeout_s) from e
        return call.read(_Answer(url, resp.status_code, resp.content, time.perf_counter() - start))

    async def _stream(self, call: _Call[T]) -> AsyncIterator[T]:
        url, start = self.base_url + call.path, time.perf_counter()
        try:
            async with self._http.stream(call.method, call.path, content=call.body, headers=call.headers(),
                                         timeout=self._httpx_timeout(call)) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise EngineHTTPError(url, resp.status_code, resp.text)
                async for line in resp.aiter_lines():
                    if (result := call.read(line, time.perf_counter() - start)) is not None:
                        yield result
        except httpx.TransportError as e:
            raise _transport_error(e, url, self._timeout_s(call)) from e


class SyncHttpEngineClient(_EngineCalls):
    """Blocking face of the same client (same methods, same errors) for cells, scripts and tests."""

    def __init__(self, config: EngineClientConfig | str) -> None:
        super().__init__(config)
        self._http = httpx.Client(**self._http_options())

    def __enter__(self) -> SyncHttpEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _run(self, call: _Call[T]) -> T:
        url, timeout_s, start = self.base_url + call.path, self._timeout_s(call), time.perf_counter()
        try:
            resp = self._http.request(call.method, call.path, content=call.body, headers=call.headers(),
                                      timeout=self._httpx_timeout(call))
        except httpx.TransportError as e:
            if call.soft:
                return call.read(None)
            raise _transport_error(e, url, timeout_s) from e
        return call.read(_Answer(url, resp.status_code, resp.content, time.perf_counter() - start))

    def _stream(self, call: _Call[T]) -> Iterator[T]:
        url, start = self.base_url + call.path, time.perf_counter()
        try:
            with self._http.stream(call.method, call.path, content=call.body, headers=call.headers(),
                                   timeout=self._httpx_timeout(call)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise EngineHTTPError(url, resp.status_code, resp.text)
                for line in resp.iter_lines():
                    if (result := call.read(line, time.perf_counter() - start)) is not None:
                        yield result
        except httpx.TransportError as e:
            raise _transport_error(e, url, self._timeout_s(call)) from e
