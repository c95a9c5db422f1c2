"""Run on one host (`python -m tests.cluster.kv_across SOURCE_URL TARGET_URL`): a call's KV cache moves from the
engine at SOURCE to the engine at TARGET the way the proxy's mover moves it (offer on the source, import on
the target, which reads the pages over Mooncake), and the continuation on the target must equal the one on
the source. Prints one JSON line: the pages and bytes moved and whether the continuations matched."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

from gyre.engine import SyncHttpEngineClient
from gyre.engine.kv_client import KvClient

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(150)]


async def _move(src: str, dst: str, ids: list[int]) -> tuple[int, int, int, str]:
    async with httpx.AsyncClient() as http:
        source, target = KvClient(src, http), KvClient(dst, http)
        offer = await source.offer(ids, None)
        try:
            done = await target.import_(ids, offer)
        finally:
            await source.release(offer.offer_id)
        return done.pages, done.bytes, done.cached_tokens, offer.session_id


def _wait_up(url: str, timeout_s: float = 120.0) -> None:
    """Until the engine answers /health (it is starting: importing torch, building the model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def main(src: str, dst: str) -> None:
    _wait_up(src)
    _wait_up(dst)
    with SyncHttpEngineClient(src) as old, SyncHttpEngineClient(dst) as new:
        ids = PROMPT + old.generate(PROMPT, GREEDY).output_ids
        pages, nbytes, cached, session = asyncio.run(_move(src, dst, ids))
        there = new.generate(ids, GREEDY)
        here = old.generate(ids, GREEDY)
    print(json.dumps({"pages": pages, "bytes": nbytes, "cached_tokens": cached, "source_session": session,
                      "target_cached": there.cached_tokens, "equal": there.output_ids == here.output_ids}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
