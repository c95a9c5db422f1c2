"""Configuration of a proxy: engines per cell, limits, sampling policy, branch markers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from gyre.http_server import ServerLimits
from gyre.proxy.branches import MarkersConfig

DEFAULT_MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class SamplingOverrides:
    """Sampling the trainer imposes whatever the harness asks (None: take the request's value).

    RL wants a known behaviour policy; harnesses set their own temperature (often 0 or 1). Set these to
    make every call sample the same way.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    """Every call generates its whole ``max_tokens`` (an emulated run: the scenario's output counts hold)."""


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    engines: Mapping[str, str]
    """cell id -> engine base URL (SGLang native API)."""
    tokenizer: str = "tiny"
    """`tiny` or a local tokenizer directory: must be the engine model's tokenizer."""
    model_name: str = "gyre-policy"
    """What `GET /v1/models` lists. Requests may name any model; the reply echoes the name they sent."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = 64 << 10
    """Largest request head (request line and headers); more is 413 before the app reads it."""
    header_timeout_s: float = 30.0
    """Time a client has to send a request head; then 408 and the connection is closed."""
    body_timeout_s: float = 300.0
    """Time a client has to send a body once its head arrived (a stalled body is dropped: 408)."""
    max_connections: int = 1024
    """Open connections the server accepts; one more is answered overloaded (529 / 503), which SDKs retry."""
    default_max_tokens: int = 4096
    """OpenAI requests may omit `max_tokens`."""
    max_tokens_cap: int | None = None
    """Clamp every request's `max_tokens` to this (None: no clamp)."""
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    markers: MarkersConfig = field(default_factory=MarkersConfig)
    engine_timeout_s: float | None = 600.0
    engine_abort_retries: int = 3
    """An engine may abort a call on its own (e.g. `pause_generation` in abort mode for a weight update);
    the call then continues from its partial output, at most this many times."""
    engine_lost_wait_s: float = 30.0
    """A call whose engine is lost (connection refused or reset, stream cut) continues on another admitting
    cell; with none, it waits this long for one (a routing update) before the harness is answered a
    retryable error (Anthropic 529 `overloaded_error`, OpenAI 503)."""
    weights_wait_s: float = 300.0
    """A call whose execution's cell does not hold the weights the execution was queued with yet (a cell
    loading a version just published, or one an execution was moved to) waits this long for the cell to
    load them, or for the execution to move, before the harness is answered a retryable error."""
    disconnect_poll_s: float = 0.25
    context_length: int | None = None
    """Longest prompt + 1 the engines can hold; a longer prompt is refused before any byte of the answer.
    None: ask each engine once (`/get_model_info` `context_length`, as `gyre.engine.local` reports it)."""
    kv_mover: Literal["recompute", "mooncake"] = "recompute"
    """What happens to a redirected call's KV: the new engine recomputes it, or its pages move engine to
    engine with the Mooncake Transfer Engine (engines must serve `/gyre/kv/*`: `gyre.engine.local` does)."""

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("ProxyConfig.engines must name at least one cell")
        if self.max_body_bytes < 1024:
            raise ValueError("ProxyConfig.max_body_bytes must be at least 1024")
        if self.default_max_tokens < 1:
            raise ValueError("ProxyConfig.default_max_tokens must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("ProxyConfig.context_length must be >= 2")
        if self.kv_mover not in ("recompute", "mooncake"):
            raise ValueError(f"ProxyConfig.kv_mover must be 'recompute' or 'mooncake', got {self.kv_mover!r}")
        if self.engine_lost_wait_s < 0:
            raise ValueError("ProxyConfig.engine_lost_wait_s must be >= 0")
        if self.weights_wait_s < 0:
            raise ValueError("ProxyConfig.weights_wait_s must be >= 0")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("ProxyConfig.max_tokens_cap must be >= 1")
        try:
            self.server_limits()
        except ValueError as e:
            raise ValueError(f"ProxyConfig: {e}") from e

    def server_limits(self) -> ServerLimits:
        """The HTTP server's limits, from the fields above."""
        return ServerLimits(max_body_bytes=self.max_body_bytes, max_header_bytes=self.max_header_bytes,
                            header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                            max_connections=self.max_connections)
