"""Fixtures for engine tests: a fresh in-process engine server per test, and plain-HF references."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from gyre.engine import SyncHttpEngineClient
from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.model import build_tiny_model, build_tokenizer
from tests.conftest import HANG_S


@pytest.fixture
def server() -> Iterator[LocalEngineServer]:
    srv = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0)))
    srv.start(HANG_S)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: LocalEngineServer) -> Iterator[SyncHttpEngineClient]:
    with SyncHttpEngineClient(server.url) as c:
        yield c


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="session")
def ref_model() -> torch.nn.Module:
    """An independent copy of the engine's seed-0 model."""
    return build_tiny_model(0)


@pytest.fixture(scope="session")
def prompt(tok) -> Callable[[str], list[int]]:
    def render(text: str) -> list[int]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok.encode(chat, add_special_tokens=False)

    return render
