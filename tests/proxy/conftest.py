"""Fixtures: a local CPU engine shared by the module, a scripted engine, and proxies in front of them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.log import LogWriter
from gyre.proxy import Proxy, ProxyConfig, ProxyServer
from gyre.sink import EventSink, LogSink, MemorySink
from tests.conftest import HANG_S
from tests.proxy.proxy_helpers import TOKEN, Engines, Running, Seen, StartProxy, capture
from tests.proxy.scripted_engine import ScriptedEngine


@pytest.fixture(scope="module")
def engine_server() -> Iterator[LocalEngineServer]:
    server = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0)))
    server.start(HANG_S)
    yield server
    server.stop()


@pytest.fixture
def engine_capture(engine_server: LocalEngineServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, Seen]:
    """rid -> what the local engine's scheduler admitted and produced (captured on the engine side)."""
    seen: dict[str, Seen] = {}
    capture(engine_server, monkeypatch, seen)
    return seen


@pytest.fixture
def two_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engines]:
    """Two fresh local engines with the same seed (a redirect's source and target), captured."""
    servers = [LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0))) for _ in range(2)]
    seen: dict[str, Seen] = {}
    for server in servers:
        server.start(HANG_S)
        capture(server, monkeypatch, seen)
    yield servers[0], servers[1], seen
    for server in servers:
        server.stop()


@pytest.fixture
def scripted() -> Iterator[ScriptedEngine]:
    engine = ScriptedEngine()
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator[StartProxy]:
    """Start a proxy on loopback in front of `engines` (cell -> URL) with one registered execution."""
    running: list[Running] = []

    def start(engines: dict[str, str], *, log: bool = False, execution_id: str = "exec-1", **config: Any) -> Running:
        proxy_config = ProxyConfig(engines=engines, **config)
        log_dir = tmp_path / f"log{len(running)}" if log else None
        sink: EventSink = LogSink(LogWriter(log_dir, run_id="test")) if log_dir else MemorySink()
        proxy = Proxy(proxy_config, sink=sink)
        server = ProxyServer(proxy)
        server.start(HANG_S)
        registration = server.register_execution(execution_id, TOKEN)
        item = Running(server, proxy, sink, registration, log_dir)
        running.append(item)
        return item

    yield start
    for item in running:
        item.server.stop()
        item.sink.close()
