"""A test engine that speaks SGLang's `/generate` but answers from a script, so a test can make the
(random) model "write" a tool call. It records every request it receives; its log-probs are made up."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gyre.model.tokenizer import build_tokenizer

EOS = 258


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """What the scripted model says to call a tool: the chat template's tool-call syntax."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedEngine:
    def __init__(self, tokenizer: Any = None, eos: int = EOS) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
        self.eos = eos
        self.replies: deque[list[int]] = deque()
        self.respond: Callable[[str], str | None] | None = None
        """Optional: the reply to a prompt (its decoded text), for agents whose calls interleave (a harness
        running a sub-agent beside its main agent); None falls back to the queued replies."""
        self.requests: list[dict[str, Any]] = []
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def say(self, *texts: str, eos: bool = True) -> None:
        """Queue replies: each text, encoded, then `<|im_end|>` (as the model would stop)."""
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.replies.append([*ids, self.eos] if eos else ids)

    def _reply(self, prompt: list[int]) -> list[int]:
        if self.respond is not None:
            text = self.respond(self.tokenizer.decode(prompt))
            if text is not None:
                return [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]
        return self.replies.popleft() if self.replies else [self.eos]

    def _result(self, rid: str, prompt: list[int], ids: list[int], params: dict[str, Any], done: bool) -> dict:
        limit = params.get("max_new_tokens", 128)
        finish = None
        if done:
            finish = (
                {"type": "stop", "matched": self.eos}
                if ids and ids[-1] == self.eos
                else {"type": "length", "length": len(ids)}
            )
            if len(ids) >= limit and ids[-1] != self.eos:
                finish = {"type": "length", "length": len(ids)}
        return {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "weight_version": "7",
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
            },
        }

    async def generate(self, body: dict[str, Any]) -> Any:
        """The reply to one `/generate` request (already recorded in `requests`); a subclass that fails or
        holds calls overrides it."""
        params = body.get("sampling_params", {})
        reply = self._reply(body["input_ids"])
        ids = reply[: params.get("max_new_tokens", 128)]
        rid, prompt = body["rid"], body["input_ids"]
        if not body.get("stream"):
            return JSONResponse(self._result(rid, prompt, ids, params, True))

        async def chunks():
            for k in range(1, len(ids) + 1):
                yield f"data: {json.dumps(self._result(rid, prompt, ids[:k], params, k == len(ids)))}\n\n"
                await asyncio.sleep(0)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def abort(self, body: dict[str, Any]) -> Any:
        """The reply to one `/abort_request`."""
        return {"success": True, "aborted": 0}

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = json.loads(await request.body())
            self.requests.append(body)
            return await self.generate(body)

        @app.post("/abort_request")
        async def abort(request: Request) -> Any:
            return await self.abort(json.loads(await request.body() or b"{}"))

        return app

    def start(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "scripted engine did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)
