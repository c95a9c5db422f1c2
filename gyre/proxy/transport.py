"""The proxy's link to an engine: `gyre.engine`'s `HttpEngineClient`, with the prompt sent as cached JSON.

A call in a 700K-token execution sends 700K ids. Serialising them afresh costs tens of milliseconds of the
proxy's single event loop per call; but all but the newest few are the recorded ids of earlier calls, which
never change. So each call keeps the JSON text of a prefix of its own tokens (`CallRecord.wire`): its prompt
delta once sent, extended by its output to what its children reuse (usually all but the end-of-turn tokens,
which the template renders anew), and a prompt goes out as those fragments joined (a memcpy) plus the JSON of
what is new: O(new tokens) of real work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from gyre.engine import GenerateResult, SamplingParams
from gyre.engine.client import EngineClientConfig, HttpEngineClient, Prompt, ids_json
from gyre.proxy.tito import CallRecord

__all__ = ["GenerateEngine", "Prompt", "engine_link", "prompt_of"]


def prompt_of(record: CallRecord, extra: Sequence[int] = ()) -> Prompt:
    """`record`'s prompt (plus `extra` ids: the partial output of a continued call) as a `Prompt`."""
    fragments: list[bytes] = []
    for rec, lo, hi in record.spans(0, record.prompt_len):
        piece = _leading(rec, hi) if lo == 0 else ids_json(rec.tokens[lo:hi])
        if piece:
            fragments.append(piece)
    if extra:
        fragments.append(ids_json(extra))
    return Prompt(tuple(fragments), record.prompt_len + len(extra))


def _leading(record: CallRecord, n: int) -> bytes:
    """The JSON of `record`'s first `n` tokens, kept in `record.wire` as (n, bytes): a call's own prompt delta
    when it is sent, then (its child reusing all but its end-of-turn tokens) that plus its output, which only
    the new part costs. Tokens are only ever appended to a record, so a kept prefix never goes stale."""
    cached = record.wire
    if isinstance(cached, tuple) and cached[0] <= n:
        have, piece = cached
        if have == n:
            return piece
        rest = ids_json(record.tokens[have:n])
        piece = piece + b"," + rest if piece else rest
    else:
        piece = ids_json(record.tokens[:n])
    record.wire = (n, piece)
    return piece


class GenerateEngine(Protocol):
    """What a proxy call needs from an engine. `engine_link` speaks it over HTTP; tests may fake it (and may
    leave out `context_length`, which the proxy asks only when the engine has it)."""

    base_url: str

    async def generate(
        self, prompt: Prompt, params: SamplingParams, rid: str, *, routing_key: str | None = None
    ) -> GenerateResult: ...

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams, rid: str, *, routing_key: str | None = None
    ) -> AsyncIterator[GenerateResult]: ...

    async def abort(self, rid: str) -> None: ...

    async def aclose(self) -> None: ...


def engine_link(
    base_url: str, *, timeout_s: float | None = 600.0, connect_timeout_s: float = 5.0, max_connections: int = 1024
) -> HttpEngineClient:
    """The proxy's client of one SGLang-speaking engine: a pool sized for hundreds of calls, `/generate` and
    `/abort_request` over `gyre.engine.wire`, 30 s for everything but a generation (`timeout_s`)."""
    return HttpEngineClient(EngineClientConfig(
        base_url=base_url, generate_timeout_s=timeout_s, control_timeout_s=30.0, connect_timeout_s=connect_timeout_s,
        max_connections=max_connections, wire=True))
