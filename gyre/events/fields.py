"""Field types shared by the event models, each carrying the Arrow type it is stored as."""

from dataclasses import dataclass
from typing import Annotated, Literal

import pyarrow as pa
from pydantic import Field


@dataclass(frozen=True)
class ArrowType:
    """Annotation marker: store this field with exactly this Arrow type (overrides the default mapping)."""

    type: pa.DataType


INT32_MAX = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], ArrowType(pa.list_(pa.int32()))]
"""Token ids: non-negative, stored as list<int32>."""

LogProbs = Annotated[list[float], ArrowType(pa.list_(pa.float32()))]
"""Per-token log-probabilities, stored as list<float32>."""

Role = Literal["rollout", "training", "idle"]
BranchKind = Literal["main", "main-summary", "sub-agent", "sub-agent-summary"]
ExecutionStatus = Literal["completed", "timed_out", "harness_error"]
FinishReason = Literal["stop", "length", "abort"]
EvaluationFailure = Literal["crash", "timeout", "infrastructure"]
RunStatus = Literal["completed", "failed", "interrupted"]
