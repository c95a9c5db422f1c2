"""`gyre.proxy`: a token-in/token-out proxy that unmodified harnesses call as Anthropic or OpenAI.

A runner registers an execution (`Proxy.register_execution` -> token), hands the harness `harness_env`,
and the proxy records every call as `model_call_started` / `model_call_finished` events with the exact ids
the engine saw and sampled. See docs/proxy.md.
"""

from gyre.proxy.branches import MarkersConfig
from gyre.proxy.config import ProxyConfig, SamplingOverrides
from gyre.proxy.core import ActiveCall, CallSettings, Proxy, harness_env
from gyre.proxy.errors import ApiError, ProxyError, UnknownCellError, UnknownExecutionError
from gyre.proxy.registry import Registration
from gyre.proxy.routing import KvMove, KvMover, KvMoveResult, RecomputeKv
from gyre.proxy.server import ProxyServer, serve
from gyre.proxy.transport import GenerateEngine, Prompt, engine_link

__all__ = [
    "ActiveCall",
    "ApiError",
    "CallSettings",
    "GenerateEngine",
    "KvMove",
    "KvMoveResult",
    "KvMover",
    "MarkersConfig",
    "Prompt",
    "Proxy",
    "ProxyConfig",
    "ProxyError",
    "ProxyServer",
    "RecomputeKv",
    "Registration",
    "SamplingOverrides",
    "UnknownCellError",
    "UnknownExecutionError",
    "engine_link",
    "harness_env",
    "serve",
]
