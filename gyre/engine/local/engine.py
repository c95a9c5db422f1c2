"""The local engine: a model, its tokenizer and the scheduler that serves them, plus weight updates."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gyre.emulate import Emulation, Pacer
from gyre.engine.errors import EngineRequestError
from gyre.engine.local.forward import RaggedQwen2
from gyre.engine.local.kv import KvPool
from gyre.engine.local.kv_port import KvPort
from gyre.engine.local.scheduler import Scheduler, SchedulerConfig
from gyre.engine.local.weights import apply_weights, read_checkpoint
from gyre.engine.protocol import (
    ModelInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsResponse,
)
from gyre.engine.tensors import decode_named_tensors
from gyre.model.checkpoint import check_vocabulary
from gyre.transfer import EndpointConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TINY = "tiny"


@dataclass(frozen=True)
class WeightsInstalled:
    """A `LocalEngine.load_weights`: tensors installed, requests running across it (0 after a drain), the
    seconds it waited for the requests in flight to finish and the seconds installing took."""

    tensors: int
    num_running: int
    drain_s: float
    install_s: float


@dataclass(frozen=True, kw_only=True)
class LocalEngineConfig:
    """`model` is `"tiny"` (built in memory from `seed`) or a Qwen2 checkpoint directory."""

    model: str = TINY
    seed: int = 0
    num_threads: int = 1
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_page_size: int = 16
    """Tokens per KV page, the unit of KV export and import (migration needs equal page sizes)."""
    kv_pool_tokens: int | None = None
    """Tokens of KV memory allocated and populated at start for KV imported from other engines (a migration
    reads into it; its radix edges return the pages on eviction). None: the model's context length (the
    tiny model: 128K tokens, 128 MiB); 0: no pool (every import maps fresh memory). An import the pool
    cannot hold, even after evicting older imports, falls back to fresh memory."""
    transfer: EndpointConfig = field(default_factory=EndpointConfig)
    """The Mooncake endpoint KV pages move through (started on the first migration)."""
    emulation: Emulation | None = None
    """An emulated accelerator (`gyre.emulate`): every step takes the time it would take there."""

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.kv_page_size < 1:
            raise ValueError("kv_page_size must be >= 1")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < 0:
            raise ValueError("kv_pool_tokens must be >= 0 (0: no pool)")


def load_model(config: LocalEngineConfig) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The model (eval, float32) and tokenizer the config names; nothing is downloaded."""
    from gyre.model import build_tiny_model, build_tokenizer, load_tiny

    if config.model == TINY:
        return build_tiny_model(config.seed), build_tokenizer()
    model, tokenizer = load_tiny(config.model)
    check_vocabulary(tokenizer, model.config.vocab_size, f"checkpoint {config.model}")
    return model, tokenizer


class LocalEngine:
    """A real CPU inference engine for Qwen2-architecture models (see docs/engine.md)."""

    def __init__(self, config: LocalEngineConfig | None = None) -> None:
        self.config = config or LocalEngineConfig()
        self.released: set[str] = set()
        """Memory tags released for training (`/release_memory_occupation`), until resumed."""
        torch.set_num_threads(self.config.num_threads)
        self.model, self.tokenizer = load_model(self.config)
        self.model_path = self.config.model
        self.tokenizer_path = self.config.model
        self.runner = RaggedQwen2(self.model)
        pool_tokens = self.config.kv_pool_tokens
        if pool_tokens is None:
            pool_tokens = self.runner.max_positions
        self.kv_pool = KvPool(self.runner.kv_shape, self.config.kv_page_size, pool_tokens) if pool_tokens else None
        self.pacer = Pacer(self.config.emulation) if self.config.emulation is not None else None
        self.scheduler = Scheduler(self.runner, self.decode_all, self._eos_ids(), self.config.scheduler,
                                   pool=self.kv_pool, pacer=self.pacer)
        self.kv = KvPort(self.scheduler, self.runner.kv_shape, self.config.kv_page_size, self.config.transfer,
                         self.kv_pool)

    def _eos_ids(self) -> frozenset[int]:
        """EOS ids from the model config, generation config and tokenizer (Qwen stops on several)."""
        ids: set[int] = set()
        sources = [self.model.config.eos_token_id, self.tokenizer.eos_token_id]
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            sources.append(gen.eos_token_id)
        for src in sources:
            if isinstance(src, int):
                ids.add(src)
            elif src is not None:
                ids.update(int(i) for i in src)
        return frozenset(ids)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def decode_all(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens kept (for stop strings and `no_stop_trim`)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path=self.model_path,
            tokenizer_path=self.tokenizer_path,
            is_generation=True,
            weight_version=self.scheduler.weight_version,
            context_length=self.runner.max_positions,  # extra field: lets a proxy refuse a prompt up front
        )

    def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest) -> Future[UpdateWeightsResponse]:
        """Read the checkpoint here (the caller's thread), install it between two steps."""
        tensors = read_checkpoint(req.model_path)

        def run() -> UpdateWeightsResponse:
            paused = self._install(
                tensors, True, "model_path", req.abort_all_requests, req.flush_cache, req.weight_version
            )
            self.model_path = req.model_path
            return UpdateWeightsResponse(
                success=True, message=f"loaded {len(tensors)} tensors", num_paused_requests=paused
            )

        return self.scheduler.call(run)

    def update_weights_from_tensor(self, req: UpdateWeightsFromTensorRequest) -> Future[UpdateWeightsResponse]:
        """Decode the tensors here (the caller's thread), install them between two steps."""
        tensors = decode_named_tensors(req.serialized_named_tensors)

        def run() -> UpdateWeightsResponse:
            paused = self._install(
                tensors, False, "serialized_named_tensors", req.abort_all_requests, req.flush_cache, req.weight_version
            )
            return UpdateWeightsResponse(
                success=True, message=f"updated {len(tensors)} tensors", num_paused_requests=paused
            )

        return self.scheduler.call(run)

    def load_weights(self, tensors: dict[str, torch.Tensor], version: str | None = None, *,
                     drain: bool = False) -> WeightsInstalled:
        """Install every parameter from tensors already in this process (a cell that pulled them over
        Mooncake): no file and no HTTP body in between. Waits until they are installed.

        ``drain``: first let every request in flight finish on the weights that began it, admitting none
        meanwhile (`Scheduler.call_when_idle`), so that each call is served by one version and reports it;
        without it requests still running continue under the new weights."""
        asked = time.perf_counter()
        began: list[float] = []

        def run() -> int:
            began.append(time.perf_counter())
            return self._install(tensors, True, "tensors", False, True, version)

        future = self.scheduler.call_when_idle(run) if drain else self.scheduler.call(run)
        running = future.result()
        return WeightsInstalled(tensors=len(tensors), num_running=running, drain_s=began[0] - asked,
                                install_s=time.perf_counter() - began[0])

    def set_weight_version(self, version: str) -> None:
        """Name the weights the engine holds now (SGLang's `/update_weight_version`): a cell's engine starts
        on version 0, so that every call it serves reports the version it ran on."""
        self.scheduler.call(lambda: setattr(self.scheduler, "weight_version", version)).result()

    def _install(
        self,
        tensors: dict[str, torch.Tensor],
        require_all: bool,
        field_name: str,
        abort_all: bool,
        flush: bool,
        version: str | None,
    ) -> int:
        """Runs on the scheduler thread, between steps. Requests still running continue under the new
        weights (their earlier tokens and KV came from the old ones); pause first to avoid mixing."""
        if not tensors:
            raise EngineRequestError(field_name, "no tensors to load")
        apply_weights(self.model, tensors, require_all=require_all, field=field_name)
        if abort_all:
            self.scheduler.abort_all_running()
        if flush:
            self.scheduler.cache.clear()
        if version is not None:
            self.scheduler.weight_version = version
        return self.scheduler.num_running
