"""Shared by the proxy tests: the test token, engine-side request capture, a running proxy's handle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gyre.engine.local import LocalEngineServer
from gyre.proxy import Proxy, ProxyServer, Registration
from gyre.sink import EventSink, MemorySink

TOKEN = "test-token-0123456789abcdef"


@dataclass
class Seen:
    """One request as the engine's scheduler saw it, and its final output."""

    input_ids: list[int]
    output_ids: list[int] | None = None
    output_logprobs: list[float] | None = None


def capture(server: LocalEngineServer, monkeypatch: pytest.MonkeyPatch, seen: dict[str, Seen]) -> None:
    """Record into `seen` (by rid) what the engine's scheduler admits and what each request finally produced."""
    scheduler = server.engine.scheduler
    original = scheduler.submit

    def submit(request: Any) -> Any:
        record = seen[request.rid] = Seen(list(request.input_ids))
        inner = request.sink

        def sink(out: Any) -> None:
            if out.finished:
                record.output_ids, record.output_logprobs = list(out.output_ids), list(out.output_logprobs)
            inner(out)

        return original(dataclasses.replace(request, sink=sink))

    monkeypatch.setattr(scheduler, "submit", submit)


@dataclass
class Running:
    server: ProxyServer
    proxy: Proxy
    sink: EventSink
    registration: Registration
    log_dir: Path | None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def token(self) -> str:
        return self.registration.token

    def events(self, kind: str) -> list[Any]:
        assert isinstance(self.sink, MemorySink)
        return [e for e in self.sink.events if e.kind == kind]


StartProxy = Callable[..., Running]
Engines = tuple[LocalEngineServer, LocalEngineServer, dict[str, Seen]]
"""Two local engines (`two_engines`) and what each admitted and produced, by rid."""
