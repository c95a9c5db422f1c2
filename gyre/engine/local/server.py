"""HTTP front of the local engine: SGLang's native endpoints (subset) over FastAPI, plus an in-process
server for tests (`LocalEngineServer`: free port, background thread, clean stop).

Errors: a malformed request is a 400 `{"error": {"message", "field", "type"}}` naming the offending
field (dotted path); weight-update failures also carry SGLang's `{"success": false, "message"}`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gyre.engine.errors import EngineError, EngineRequestError, KvRefusedError
from gyre.engine.kv_protocol import (
    KV_BODY_TYPE,
    KvCancelRequest,
    KvCommitRequest,
    KvExportRequest,
    KvImportRequest,
    KvOfferRequest,
    KvReleaseRequest,
    KvReserveRequest,
    unframe_body,
)
from gyre.engine.local.engine import LocalEngine
from gyre.engine.local.scheduler import EngineRequest, RequestOutput
from gyre.engine.local.stopping import visible_text
from gyre.engine.protocol import (
    AbortRequest,
    ContinueRequest,
    GenerateRequest,
    PauseRequest,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from gyre.errors import TransferError
from gyre.http_server import Refusal, Server, ServerLimits, listen, uvicorn_config

M = TypeVar("M", bound=BaseModel)
_DISCONNECT_POLL_S = 0.5
DEFAULT_LIMITS = ServerLimits(max_body_bytes=1 << 30)
"""The engine's HTTP limits: a large body, since `update_weights_from_tensor` carries weights."""
_REFUSAL_TYPES = {"invalid_request": "invalid_request_error", "too_large": "request_too_large",
                  "request_timeout": "request_timeout", "overloaded": "engine_unavailable"}


class _BadRequest(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _error(status: int, field: str, message: str, extra: dict[str, Any] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "field": field, "type": "invalid_request_error"}, **(extra or {})}
    return JSONResponse(body, status_code=status)


def _refusal(_path: str | None, refusal: Refusal) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP server's refusals (bad framing, limits, timeouts) in the engine's error shape."""
    body = {"error": {"message": refusal.message, "field": "request", "type": _REFUSAL_TYPES[refusal.kind]}}
    return refusal.status, body, {}


def _field_path(loc: tuple[int | str, ...]) -> str:
    """Dotted field path of a pydantic error, without the union-branch tags pydantic inserts
    (`list[int]`, `SamplingParams`, `int`, ...); real field names are snake_case."""
    tags = {"int", "str", "float", "bool", "none"}
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p[:1].isupper() or p in tags))]
    return ".".join(parts) or "body"


async def _parse(request: Request, model: type[M], *, optional_body: bool = False) -> M:
    raw = await request.body()
    if not raw.strip() and optional_body:
        return model()
    framed = request.headers.get("content-type", "").split(";")[0].strip() == KV_BODY_TYPE
    if not framed:
        try:  # pydantic's own JSON parser: at 100K prompt ids ~3 ms against ~10 ms for json.loads + validate
            return model.model_validate_json(raw)
        except ValidationError:
            pass  # the path below names what is wrong, in the engine's words
    try:
        data = unframe_body(raw) if framed else json.loads(raw)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        what = "a valid framed KV body" if framed else "valid JSON"
        raise _BadRequest("body", f"request body is not {what}: {e}") from e
    if not isinstance(data, dict):
        raise _BadRequest("body", "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise _BadRequest(_field_path(tuple(first["loc"])), first["msg"]) from e


def _items(req: GenerateRequest, engine: LocalEngine) -> list[tuple[str, list[int], SamplingParams]]:
    """One `(rid, input_ids, params)` per prompt of a single or batch request."""
    source = "input_ids" if req.input_ids is not None else "text"
    if req.input_ids is not None:
        prompts = cast(list[list[int]], req.input_ids) if req.is_batch else [cast(list[int], req.input_ids)]
    else:
        texts = req.text if isinstance(req.text, list) else [req.text or ""]
        prompts = [engine.encode(t) for t in texts]
    n = len(prompts)
    if n == 0:
        raise _BadRequest(source, "batch must not be empty")
    if isinstance(req.rid, list):
        if len(req.rid) != n:
            raise _BadRequest("rid", f"batch of {n} prompts needs {n} rids, got {len(req.rid)}")
        rids = req.rid
    elif req.rid is not None:
        rids = [req.rid] if n == 1 else [f"{req.rid}-{i}" for i in range(n)]
    else:
        rids = [uuid.uuid4().hex for _ in range(n)]
    if len(set(rids)) != n:
        raise _BadRequest("rid", "rids in one batch must be distinct")
    for i, ids in enumerate(prompts):  # all or nothing: no prompt of a bad batch starts
        try:
            engine.scheduler.validate_prompt(ids)
        except EngineRequestError as e:
            raise _BadRequest(f"{source}.{i}" if req.is_batch else source, e.message) from e
    if isinstance(req.sampling_params, list):
        if len(req.sampling_params) != n:
            raise _BadRequest("sampling_params", f"batch of {n} prompts needs {n} sampling_params")
        params = req.sampling_params
    else:
        params = [req.sampling_params] * n
    return list(zip(rids, prompts, params, strict=True))


def _render(engine: LocalEngine, out: RequestOutput, params: SamplingParams, req: GenerateRequest) -> dict[str, Any]:
    """One SGLang-shaped result (`text`, `output_ids`, `meta_info`)."""
    text = visible_text(
        out.output_ids, out.finish_reason, params, lambda ids: engine.decode(ids, params.skip_special_tokens)
    )
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason.model_dump() if out.finish_reason else None,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
        "e2e_latency": out.e2e_latency,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, engine.decode([tid], False) if req.return_text_in_logprobs else None]
            for lp, tid in zip(out.output_logprobs, out.output_ids, strict=True)
        ]
    return {"text": text, "output_ids": out.output_ids, "meta_info": meta}


def build_app(engine: LocalEngine) -> FastAPI:
    """The FastAPI app serving `engine` (the engine must be started separately)."""
    app = FastAPI(title="gyre local engine", docs_url=None, redoc_url=None)

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, e: _BadRequest) -> JSONResponse:
        return _error(400, e.field, e.message)

    @app.exception_handler(EngineRequestError)
    async def _engine_request(request: Request, e: EngineRequestError) -> JSONResponse:
        extra = {"success": False, "message": str(e)} if request.url.path.startswith("/update_weights") else {}
        return _error(400, e.field, e.message, extra)

    @app.exception_handler(EngineError)
    async def _engine_down(_: Request, e: EngineError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e), "type": "engine_unavailable"}}, status_code=503)

    @app.exception_handler(KvRefusedError)
    async def _kv_refused(_: Request, e: KvRefusedError) -> JSONResponse:
        body = {"error": {"message": e.message, "field": e.field, "type": "kv_refused"}}
        return JSONResponse(body, status_code=409)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, "path", f"{request.method} {request.url.path}: {e.detail}")

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left, or a stalled body was refused

    @app.exception_handler(TransferError)
    async def _transfer_failed(_: Request, e: TransferError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e), "type": "transfer_failed"}}, status_code=502)

    def submit(rid: str, ids: list[int], params: SamplingParams, stream: bool) -> asyncio.Queue[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:  # scheduler thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop is closed: the server stopped, nobody is listening
                return

        engine.scheduler.submit(EngineRequest(rid=rid, input_ids=ids, params=params, sink=sink, stream=stream))
        return queue

    async def final(queue: asyncio.Queue[RequestOutput]) -> RequestOutput:
        while True:
            out = await queue.get()
            if out.finished:
                return out

    async def wait_or_abort(request: Request, rid: str, queue: asyncio.Queue[RequestOutput]) -> RequestOutput:
        """Final output of `rid`; if the client hangs up first, abort it (as SGLang does)."""
        task = asyncio.ensure_future(final(queue))
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                engine.scheduler.abort(rid)
                return await task

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = await _parse(request, GenerateRequest)
        items = _items(req, engine)
        if req.stream:
            if req.is_batch:
                raise _BadRequest("stream", "streaming is supported for single requests only")
            rid, ids, params = items[0]
            queue = submit(rid, ids, params, stream=True)
            return StreamingResponse(_sse(engine, rid, queue, params, req), media_type="text/event-stream")
        queues = [(rid, params, submit(rid, ids, params, stream=False)) for rid, ids, params in items]
        outs = await asyncio.gather(*(wait_or_abort(request, rid, q) for rid, _, q in queues))
        rendered = [_render(engine, out, params, req) for out, (_, params, _) in zip(outs, queues, strict=True)]
        return JSONResponse(rendered if req.is_batch else rendered[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        req = await _parse(request, AbortRequest)
        if not req.rid and not req.abort_all:
            raise _BadRequest("rid", "give a rid or abort_all=true")
        count = await asyncio.wrap_future(engine.scheduler.abort(req.rid, req.abort_all))
        return JSONResponse({"success": True, "aborted": count})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        req = await _parse(request, PauseRequest, optional_body=True)
        paused = await asyncio.wrap_future(engine.scheduler.pause(req.mode))
        return JSONResponse(
            {"message": "Generation paused successfully.", "status": "ok", "num_paused_requests": paused}
        )

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await _parse(request, ContinueRequest, optional_body=True)
        await asyncio.wrap_future(engine.scheduler.resume())
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    # The two weight loads: decoding files or tensors may be large, so it runs off the loop; the engine then
    # swaps the weights between scheduler steps.
    for path, model, load in (
        ("/update_weights_from_disk", UpdateWeightsFromDiskRequest, engine.update_weights_from_disk),
        ("/update_weights_from_tensor", UpdateWeightsFromTensorRequest, engine.update_weights_from_tensor),
    ):
        app.add_api_route(path, _weights_route(model, load), methods=["POST"], name=path[1:])

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        req = await _parse(request, UpdateWeightVersionRequest)
        if req.abort_all_requests:
            await asyncio.wrap_future(engine.scheduler.abort("", abort_all=True))
        await asyncio.to_thread(engine.set_weight_version, req.new_version)
        return JSONResponse({"success": True, "message": f"weight version is {req.new_version}"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        await asyncio.wrap_future(engine.scheduler.flush_cache())
        return Response("Cache flushed.\n", status_code=200)

    # SGLang's memory release around training (`{"tags": ["weights", "kv_cache"]}`, optional). The CPU engine
    # frees what it can: its KV cache (the radix cache is flushed); its weights stay resident (host memory is
    # not what a CPU cell lends to training), and it reports the tags it holds as released.
    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> JSONResponse:
        tags = await _memory_tags(request)
        await asyncio.wrap_future(engine.scheduler.flush_cache())
        engine.released |= tags
        return JSONResponse({"success": True, "message": f"released {sorted(tags)}"})

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        tags = await _memory_tags(request)
        engine.released -= tags
        return JSONResponse({"success": True, "message": f"resumed {sorted(tags)}"})

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if engine.scheduler.healthy else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(engine.model_info().model_dump())

    # Gyre-only: KV migration (gyre.engine.kv_protocol). Transfers block, so they run off the event loop.
    # One route per port operation: parse its request, run it, answer its result (`{"success": true}` for
    # the operations that return nothing).
    kv_routes: dict[str, tuple[type[BaseModel] | None, Callable[[Any], BaseModel | None]]] = {
        "layout": (None, lambda _: engine.kv.layout()),
        "offer": (KvOfferRequest, lambda req: engine.kv.offer(req)),
        "import": (KvImportRequest, lambda req: engine.kv.import_(req)),
        "release": (KvReleaseRequest, lambda req: engine.kv.release(req.offer_id)),
        "reserve": (KvReserveRequest, lambda req: engine.kv.reserve(req)),
        "export": (KvExportRequest, lambda req: engine.kv.export(req)),
        "commit": (KvCommitRequest, lambda req: engine.kv.commit(req)),
        "cancel": (KvCancelRequest, lambda req: engine.kv.cancel(req.reservation_id)),
    }
    for name, (model, operation) in kv_routes.items():
        app.add_api_route(f"/gyre/kv/{name}", _kv_route(model, operation), methods=["POST" if model else "GET"],
                          name=f"kv_{name}")

    @app.get("/gyre/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(engine.scheduler.snapshot())

    return app


async def _sse(
    engine: LocalEngine, rid: str, queue: asyncio.Queue[RequestOutput], params: SamplingParams, req: GenerateRequest
) -> AsyncIterator[str]:
    """Cumulative chunks (SGLang's default), then `data: [DONE]`. Closing early aborts the request."""
    finished = False
    try:
        while not finished:
            out = await queue.get()
            finished = out.finished
            yield f"data: {json.dumps(_render(engine, out, params, req))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.scheduler.abort(rid)


def _weights_route(model: type[M], load: Callable[[M], Future[Any]]) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def route(request: Request) -> JSONResponse:
        req = await _parse(request, model)
        pending = await asyncio.to_thread(load, req)
        return JSONResponse((await asyncio.wrap_future(pending)).model_dump())

    return route


def _kv_route(
    model: type[BaseModel] | None, operation: Callable[[Any], BaseModel | None]
) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def route(request: Request) -> JSONResponse:
        req = None if model is None else await _parse(request, model)
        result = await asyncio.to_thread(operation, req)
        return JSONResponse({"success": True} if result is None else result.model_dump())

    return route


MEMORY_TAGS = frozenset({"weights", "kv_cache"})


async def _memory_tags(request: Request) -> set[str]:
    """The tags of a memory release/resume body (all of them when the body or its `tags` is absent)."""
    raw = await request.body()
    if not raw.strip():
        return set(MEMORY_TAGS)
    try:
        body = json.loads(raw)
    except ValueError:
        raise EngineRequestError("body", "is not valid JSON") from None
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is None:
        return set(MEMORY_TAGS)
    if not isinstance(tags, list) or not set(tags) <= MEMORY_TAGS:
        raise EngineRequestError("tags", f"must be a list of {sorted(MEMORY_TAGS)}, got {tags!r}")
    return set(tags)


class LocalEngineServer:
    """Engine + HTTP server in this process, on a background thread; for tests and embedding.

    `with LocalEngineServer(LocalEngine()) as url: ...` starts both and stops both on exit.
    """

    def __init__(self, engine: LocalEngine, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits = DEFAULT_LIMITS) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.limits = limits
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Start engine and server; returns the base URL once the server accepts connections."""
        sock = listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        self.engine.start()
        self._server = Server(uvicorn_config(build_app(self.engine), self.limits, _refusal,
                                             log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="gyre-engine-http", daemon=True
        )
        self._thread.start()
        _wait_until(lambda: self._server is not None and self._server.started, timeout_s, "engine HTTP server")
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.engine.stop()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise EngineError(f"{what} did not start within {timeout_s} s")
        time.sleep(0.01)


def serve(engine: LocalEngine, host: str = "127.0.0.1", port: int = 30000,
          limits: ServerLimits = DEFAULT_LIMITS) -> None:
    """Run the engine server in the foreground until interrupted (the CLI entry). Once bound it prints
    `gyre engine: serving on URL` on stdout: with `port` 0 the system picks a free port, and a launcher reads
    the URL there instead of probing for a free port that another process may take before the engine binds."""
    sock = listen(host, port)
    print(f"gyre engine: serving on http://{host}:{sock.getsockname()[1]}", flush=True)
    engine.start()
    try:
        Server(uvicorn_config(build_app(engine), limits, _refusal, log_level="info")).run(sockets=[sock])
    finally:
        engine.stop()
