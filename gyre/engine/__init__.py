"""`gyre.engine`: talking to inference engines through SGLang's native API.

This package (client, wire protocol, errors) imports no torch; the CPU engine lives in
`gyre.engine.local`, which does.
"""

from gyre.engine.client import (
    EngineClient,
    EngineClientConfig,
    GenerateResult,
    HttpEngineClient,
    SyncHttpEngineClient,
)
from gyre.engine.errors import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeoutError,
    EngineUnreachableError,
)
from gyre.engine.protocol import FinishReason, ModelInfo, SamplingParams, UpdateWeightsResponse

__all__ = [
    "EngineClient",
    "EngineClientConfig",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineRequestError",
    "EngineTimeoutError",
    "EngineUnreachableError",
    "FinishReason",
    "GenerateResult",
    "HttpEngineClient",
    "ModelInfo",
    "SamplingParams",
    "SyncHttpEngineClient",
    "UpdateWeightsResponse",
]
