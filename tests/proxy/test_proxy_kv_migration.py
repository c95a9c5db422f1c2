"""Redirect with KV migration (`kv_mover="mooncake"`): the new engine continues from pages moved out of the
old engine's cache, the reply equals an uninterrupted greedy run on the old engine, and `call_redirected`
records what moved (or why nothing did) in the log's `call_redirects` view."""

from __future__ import annotations

import asyncio

import openai
import pytest

from gyre.engine import SyncHttpEngineClient
from gyre.engine.local import LocalEngineConfig, LocalEngineServer
from gyre.log import LogReader
from gyre.model import build_tiny_model
from gyre.proxy.kv_mover import MooncakeKvMover
from gyre.proxy.routing import KvMove, KvMoveResult
from tests.conftest import HANG_S, Threads, refused_url
from tests.proxy.proxy_helpers import TOKEN, Engines, Running, StartProxy
from tests.proxy.test_proxy_redirect import _freeze_after_first_token

MESSAGES = [{"role": "user", "content": "Write a long answer about caches, pages and engines. " * 4}]
MAX_TOKENS = 48


def _redirect_mid_stream(p: Running, old: LocalEngineServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stream a greedy reply; freeze engine `a` right after its first token (from its scheduler thread, so the
    call is mid-generation however slow the machine) and move the execution to `b`."""
    frozen = _freeze_after_first_token(old, monkeypatch)
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=HANG_S)

    def consume() -> None:
        for _ in client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True):
            pass

    consumer = Threads(consume)
    assert frozen.wait(HANG_S), "engine a never streamed a token"
    assert p.server.redirect("a", ["b"]) == {"exec-1": "b"}
    with SyncHttpEngineClient(old.url) as engine_a:
        engine_a.resume()
    consumer.join(HANG_S)


def _view(p: Running, sql: str) -> list[tuple]:
    assert p.log_dir is not None
    return LogReader(p.log_dir).duckdb().execute(sql).fetchall()


def test_redirect_moves_kv_and_continues_as_the_old_engine_would(
    two_engines: Engines, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url}, kv_mover="mooncake", log=True)
    _redirect_mid_stream(p, a, monkeypatch)
    ((call_id, output_ids, logprobs, cell),) = _view(
        p, "select call_id, output_ids, output_logprobs, cell_id from model_calls"
    )
    ((tokens, pages, nbytes, recomputed, refused, transfer_s, move_s),) = _view(
        p,
        "select kv_tokens, kv_blocks, kv_bytes, tokens_recomputed, kv_refused, kv_transfer_seconds, kv_seconds "
        "from call_redirects",
    )
    first, second = seen[f"{call_id}#0"], seen[f"{call_id}#1"]
    assert cell == "b" and second.input_ids == first.input_ids + first.output_ids
    resumed = len(second.input_ids)
    page = LocalEngineConfig().kv_page_size
    assert tokens == resumed - 1 and pages == -(-tokens // page)
    assert nbytes == tokens * b.engine.kv.layout().bytes_per_token
    assert recomputed == 1 and refused is None and 0 < transfer_s <= move_s
    assert b.engine.scheduler.stats.cached_tokens == tokens  # the resubmitted request hit the moved pages

    with SyncHttpEngineClient(a.url) as old:  # the same call, uninterrupted, on the old engine
        reference = old.generate(first.input_ids, {"temperature": 0, "max_new_tokens": MAX_TOKENS})
    n = len(output_ids)
    assert output_ids == reference.output_ids[:n]
    assert logprobs == pytest.approx(reference.output_logprobs[:n], abs=1e-4)


def test_a_policy_version_mismatch_recomputes_and_says_why(
    two_engines: Engines, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, seen = two_engines
    with SyncHttpEngineClient(b.url) as new:
        new.update_weights_from_tensor(dict(build_tiny_model(0).named_parameters()), version="v7")
    p = start_proxy({"a": a.url, "b": b.url}, kv_mover="mooncake", log=True)
    _redirect_mid_stream(p, a, monkeypatch)
    ((call_id,),) = _view(p, "select call_id from model_calls")
    ((tokens, nbytes, recomputed, refused),) = _view(
        p, "select kv_tokens, kv_bytes, tokens_recomputed, kv_refused from call_redirects"
    )
    assert (tokens, nbytes) == (0, 0) and recomputed == len(seen[f"{call_id}#1"].input_ids)
    assert refused.startswith("offer.layout.policy_version: policy version mismatch")  # the mover's pull path
    assert "'v7'" in refused and b.engine.scheduler.stats.cached_tokens == 0


def test_an_unreachable_or_unknown_cell_is_a_refusal_not_an_error() -> None:
    async def run() -> tuple[KvMoveResult, KvMoveResult]:
        with refused_url() as closed:
            mover = MooncakeKvMover({"a": closed, "b": "http://127.0.0.1:1"})
            try:
                dead = await mover.move(KvMove("e", "c", "a", "b", [1, 2, 3]))
                unknown = await mover.move(KvMove("e", "c", "a", "nowhere", [1, 2, 3]))
            finally:
                await mover.aclose()
        return dead, unknown

    dead, unknown = asyncio.run(run())
    assert dead.refused is not None and "unreachable" in dead.refused
    assert (dead.tokens, dead.tokens_recomputed) == (0, 3)
    assert unknown.refused is not None and "'nowhere'" in unknown.refused
