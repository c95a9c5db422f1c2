"""KV migration between two CPU engines (`/gyre/kv/*`): a continuation on the engine that received the pages
equals the continuation on the engine that computed them; mismatches are refused with a clear reason."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from gyre.engine import SyncHttpEngineClient
from gyre.engine.errors import EngineUnreachableError, KvRefusedError
from gyre.engine.kv_client import KvClient
from gyre.engine.kv_protocol import KV_BODY_TYPE, KvCommitResult, KvExportResult, frame_body, ids_bytes
from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.engine.local.kv_port import MAX_OPEN_OFFERS
from gyre.engine.wire import WirePool
from gyre.model import build_tiny_model
from tests.conftest import HANG_S

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(150)]  # 150 ids of the byte vocabulary, no special tokens


def _server(**kw: object) -> LocalEngineServer:
    return LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0, **kw)))  # type: ignore[arg-type]


@pytest.fixture
def pair() -> Iterator[tuple[LocalEngineServer, LocalEngineServer]]:
    a, b = _server(), _server()
    a.start()
    b.start()
    yield a, b
    a.stop()
    b.stop()


def migrate(src: str, dst: str, ids: list[int], rid: str | None = None,
            path: str = "push", wire: bool = False) -> tuple[KvExportResult, KvCommitResult]:
    """Push: reserve on `dst`, export from `src` into it, commit on `dst`. Pull (what the proxy's mover does
    by default): offer on `src`, import on `dst`, release on `src`. Both answer in the push path's terms.
    `wire`: POSTs go through `WirePool`s (as the mover sends them), not httpx."""

    async def run() -> tuple[KvExportResult, KvCommitResult]:
        async with httpx.AsyncClient() as http:
            source = KvClient(src, http, wire=WirePool(src) if wire else None)
            target = KvClient(dst, http, wire=WirePool(dst) if wire else None)
            if path == "pull":
                offer = await source.offer(ids, rid)
                try:
                    done = await target.import_(ids, offer)
                finally:
                    await source.release(offer.offer_id)
                exported = KvExportResult(end=done.end, tokens=done.tokens, pages=done.pages, bytes=done.bytes,
                                          seconds=done.seconds)
                return exported, KvCommitResult(cached_tokens=done.cached_tokens)
            reservation = await target.reserve(ids)
            try:
                exported = await source.export(ids, reservation, rid)
            except KvRefusedError:
                await target.cancel(reservation.reservation_id)
                raise
            return exported, await target.commit(reservation.reservation_id, exported.end)

    return asyncio.run(run())


@pytest.mark.parametrize(("path", "wire"), [("pull", False), ("pull", True), ("push", False)])
def test_continuation_after_migration_equals_continuing_on_the_old_engine(pair, path: str, wire: bool) -> None:
    a, b = pair
    with SyncHttpEngineClient(a.url) as old, SyncHttpEngineClient(b.url) as new:
        first = old.generate(PROMPT, GREEDY)  # A now caches prompt + output[:-1], as after an abort
        ids = PROMPT + first.output_ids
        exported, committed = migrate(a.url, b.url, ids, path=path, wire=wire)
        page = LocalEngineConfig().kv_page_size
        end = len(ids) - 1  # every token but the last, which B computes for its logits
        assert (exported.end, exported.tokens, exported.pages) == (end, end, -(-end // page))
        layout = asyncio.run(_layout(b.url))
        assert exported.bytes == end * layout.bytes_per_token and committed.cached_tokens == end

        on_new = new.generate(ids, GREEDY)
        on_old = old.generate(ids, GREEDY)
    assert on_new.cached_tokens == end  # the prefix came from the moved pages, not a prefill
    assert on_new.output_ids == on_old.output_ids
    assert on_new.output_logprobs == pytest.approx(on_old.output_logprobs, abs=1e-5)


async def _layout(url: str):
    async with httpx.AsyncClient() as http:
        return await KvClient(url, http).layout()


@pytest.mark.parametrize("path", ["pull", "push"])
def test_only_missing_pages_move_and_a_paused_request_exports_its_live_kv(pair, path: str) -> None:
    a, b = pair
    with SyncHttpEngineClient(a.url) as old, SyncHttpEngineClient(b.url) as new:
        new.generate(PROMPT[:64], {"max_new_tokens": 1})  # B now caches these 64 tokens of the prefix
        held = a.engine.scheduler.hold(1)  # A holds after its first token, so the pause lands mid-generation
        stream = old.generate_stream(PROMPT, {**GREEDY, "max_new_tokens": 200}, rid="live")
        chunk = next(stream)  # A has produced output; freeze it with its KV in the running sequence
        assert held.wait(HANG_S)
        old.pause("in_place")
        a.engine.scheduler.release_hold()
        assert a.engine.scheduler.num_running == 1  # still live: paused, not finished
        ids = PROMPT + chunk.output_ids[:2]
        exported, committed = migrate(a.url, b.url, ids, rid="live", path=path)
        old.abort("live")
        old.resume()
        stream.close()
        assert exported.tokens == exported.end - 64 > 0  # B's own 64 tokens did not move again
        assert committed.cached_tokens == exported.end
        on_new = new.generate(ids, GREEDY)
        on_old = old.generate(ids, GREEDY)
    assert on_new.output_ids == on_old.output_ids
    assert on_new.output_logprobs == pytest.approx(on_old.output_logprobs, abs=1e-5)


def test_a_different_policy_version_is_refused_and_the_reservation_dropped(pair) -> None:
    a, b = pair
    with SyncHttpEngineClient(a.url) as old, SyncHttpEngineClient(b.url) as new:
        new.update_weights_from_tensor(dict(build_tiny_model(0).named_parameters()), version="v2")
        ids = PROMPT + old.generate(PROMPT, GREEDY).output_ids
        with pytest.raises(KvRefusedError) as refused:
            migrate(a.url, b.url, ids)
        assert refused.value.field == "reservation.layout.policy_version"
        assert "'v2'" in refused.value.message and "'default'" in refused.value.message
        assert b.engine.kv.endpoint.registered == 0  # the cancelled reservation's memory is released
        assert new.generate(ids, GREEDY).cached_tokens == 0


def test_a_different_page_size_is_refused_with_a_clear_error() -> None:
    a, b = _server(kv_page_size=16), _server(kv_page_size=32)
    with a, b, SyncHttpEngineClient(a.url) as old:
        ids = PROMPT + old.generate(PROMPT, GREEDY).output_ids
        with pytest.raises(KvRefusedError) as refused:
            migrate(a.url, b.url, ids)
    assert refused.value.field == "reservation.layout"
    assert refused.value.message == "KV layout mismatch: page_size is 32 on the receiver but 16 here"


def test_the_pull_path_refuses_a_different_version_or_page_size_naming_the_sender() -> None:
    a, b, c = _server(), _server(), _server(kv_page_size=32)
    with a, b, c, SyncHttpEngineClient(a.url) as old, SyncHttpEngineClient(b.url) as new:
        new.update_weights_from_tensor(dict(build_tiny_model(0).named_parameters()), version="v2")
        ids = PROMPT + old.generate(PROMPT, GREEDY).output_ids
        with pytest.raises(KvRefusedError) as refused:
            migrate(a.url, b.url, ids, path="pull")
        assert refused.value.field == "offer.layout.policy_version"
        assert refused.value.message == (
            "policy version mismatch: the receiver serves 'v2', the sender's KV was computed under 'default'"
        )
        with pytest.raises(KvRefusedError) as refused:
            migrate(a.url, c.url, ids, path="pull")
        assert refused.value.field == "offer.layout"
        assert refused.value.message == "KV layout mismatch: page_size is 32 on the receiver but 16 on the sender"
        assert new.generate(ids, GREEDY).cached_tokens == 0
    # the refusals released their offers, and the receivers registered nothing
    assert a.engine.kv.endpoint.registered == 0
    assert b.engine.kv.endpoint.registered == c.engine.kv.endpoint.registered == 0


def test_an_offer_holds_its_blocks_until_released_and_the_oldest_expire(pair) -> None:
    a, _ = pair
    with SyncHttpEngineClient(a.url) as old:
        ids = PROMPT + old.generate(PROMPT, GREEDY).output_ids

    async def run() -> None:
        async with httpx.AsyncClient() as http:
            source = KvClient(a.url, http)
            offer = await source.offer(ids)
            assert offer.end == len(ids) - 1 and sum(blk.tokens for blk in offer.blocks) == offer.end
            assert a.engine.kv.endpoint.registered == len({blk.addr for blk in offer.blocks}) > 0
            await source.release(offer.offer_id)
            assert a.engine.kv.endpoint.registered == 0
            with pytest.raises(KvRefusedError, match="no open offer"):
                await source.release(offer.offer_id)
            offers = [await source.offer(ids) for _ in range(MAX_OPEN_OFFERS + 3)]
            assert len(a.engine.kv._offers) == MAX_OPEN_OFFERS  # a vanished proxy cannot pin memory forever
            with pytest.raises(KvRefusedError, match="no open offer"):
                await source.release(offers[0].offer_id)
            for o in offers[3:]:
                await source.release(o.offer_id)
            assert a.engine.kv.endpoint.registered == 0

    asyncio.run(run())


def test_kv_routes_take_framed_or_json_bodies_and_name_a_malformed_frame(pair) -> None:
    a, _ = pair
    url = a.url + "/gyre/kv/offer"
    framed = {"content-type": KV_BODY_TYPE}
    with httpx.Client() as http:
        bad = http.post(url, content=frame_body({"rid": None}, ids_bytes(PROMPT))[:-2], headers=framed)
        assert bad.status_code == 400
        assert "not a valid framed KV body" in bad.json()["error"]["message"]
        empty = http.post(url, content=frame_body({}, b""), headers=framed)
        assert empty.status_code == 400 and "at least one token id" in empty.json()["error"]["message"]
        offers = [http.post(url, content=frame_body({}, ids_bytes(PROMPT)), headers=framed),
                  http.post(url, json={"input_ids": PROMPT})]
        for resp in offers:
            assert resp.status_code == 200, resp.text
            assert resp.json()["end"] == 0  # nothing cached on a fresh engine: an empty offer
            assert http.post(a.url + "/gyre/kv/release", json={"offer_id": resp.json()["offer_id"]}).status_code == 200


def test_kv_calls_over_the_wire_pool_raise_the_same_errors_as_over_httpx(pair) -> None:
    """The mover's `WirePool` transport: a refusal (409) is a `KvRefusedError` naming its field, and an engine
    nobody listens on is unreachable, as with httpx."""
    a, _ = pair

    async def run() -> None:
        async with httpx.AsyncClient() as http:
            for wire in (None, WirePool(a.url)):
                client = KvClient(a.url, http, wire=wire)
                with pytest.raises(KvRefusedError) as refused:
                    await client.release("kvo-never-offered")
                assert refused.value.field == "offer_id" and "kvo-never-offered" in refused.value.message
            dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
            for wire in (None, WirePool(dead)):
                with pytest.raises(EngineUnreachableError):
                    await KvClient(dead, http, timeout_s=10.0, wire=wire).offer(PROMPT)

    asyncio.run(run())
