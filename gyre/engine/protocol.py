"""Wire models for the subset of SGLang's native HTTP API that Gyre uses.

Field names and defaults follow SGLang's `GenerateReqInput` / `SamplingParams` (io_struct.py,
sampling_params.py) so the same JSON works against a real SGLang server and `gyre.engine.local`.
Request models are strict (`extra="forbid"`: a field the local engine does not implement is a 400 that
names it, never silently ignored); response models are lenient because SGLang adds fields over time.
This module imports only pydantic, so the proxy can use it without torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

#: SGLang turns any temperature below this into greedy decoding (temperature 1, top_k 1).
GREEDY_TEMPERATURE_EPS = 1e-6
DEFAULT_WEIGHT_VERSION = "default"
INITIAL_WEIGHT_VERSION = "0"
"""The name Gyre gives an engine's starting weights (policy version 0), so that every call reports the version
it ran on; a load names the version it installs."""


class SamplingParams(BaseModel):
    """Per-request sampling parameters (SGLang names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: Literal[1] = 1

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be -1 (disabled) or at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def to_wire(self) -> dict[str, Any]:
        """Only the fields the caller set, so a real SGLang server applies its own defaults to the rest."""
        return self.model_dump(exclude_unset=True)


class GenerateRequest(BaseModel):
    """`POST /generate` body. Exactly one of `text` / `input_ids`; either may be a batch (list)."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: Literal[-1] = -1
    top_logprobs_num: Literal[0] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("send exactly one of `text` or `input_ids`")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        assert self.input_ids is not None
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class FinishReason(BaseModel):
    """`meta_info.finish_reason`: `{"type": "stop", "matched": id|str}`, `{"type": "length", "length": n}`
    or `{"type": "abort", "message": ...}`. Unset keys are omitted on the wire, as SGLang does."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class MetaInfo(BaseModel):
    """`meta_info` of a generate response (the keys Gyre reads; others are kept as extras)."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class GenerateResponse(BaseModel):
    """One non-streamed `/generate` result (or one cumulative stream chunk)."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


PauseMode = Literal["abort", "retract", "in_place"]


class PauseRequest(BaseModel):
    """`abort` (SGLang's default) aborts in-flight requests; `in_place` freezes them with their KV;
    `retract` frees their KV and recomputes it on continue (so it is computed with the new weights)."""

    model_config = ConfigDict(extra="forbid")

    mode: PauseMode = "abort"


class ContinueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    torch_empty_cache: bool = False


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightVersionRequest(BaseModel):
    """SGLang's `/update_weight_version`: name the weights the engine holds (no weights move)."""

    model_config = ConfigDict(extra="forbid")

    new_version: str = Field(min_length=1)
    abort_all_requests: bool = False


class UpdateWeightsFromTensorRequest(BaseModel):
    """Gyre's encoding of SGLang's `serialized_named_tensors`: each entry is base64 of a safetensors blob
    (`safetensors.torch.save({name: tensor})`); entries are merged, so they may be shards of one update.
    SGLang's own format is a pickle of tensor handles that only works on the same host; see docs/engine.md.
    """

    model_config = ConfigDict(extra="forbid")

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Literal["safetensors"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    success: bool
    message: str = ""
    num_paused_requests: int = 0


class ModelInfo(BaseModel):
    """`GET /get_model_info`."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | dict[str, Any] | None = None
    weight_version: str | None = None
