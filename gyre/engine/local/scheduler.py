"""The scheduler thread: admits requests, batches every active sequence into each forward step, samples,
finishes, and applies control commands (abort, pause, weight updates) between steps.

Invariants:
- Only the scheduler thread touches model weights, KV buffers and the prefix cache; other threads talk to
  it through `submit` and `call` (a locked inbox), so no step ever sees half-updated weights.
- Each step feeds every running sequence its pending tokens: one for a decoding sequence, a chunk of the
  prompt (within `max_step_tokens`) for one still in prefill. Decodes are planned first, so long prompts
  never stall generation for the others.
- A sequence's KV always covers `prompt + output[:-1]`; the last sampled token is its pending input.
- Results reach callers through a sink callback (called on this thread; it must not block).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from gyre.emulate import Pacer
from gyre.engine.errors import EngineError, EngineRequestError
from gyre.engine.local.forward import RaggedQwen2, StepInput
from gyre.engine.local.kv import KvPool, SequenceBuffers, SequenceKV
from gyre.engine.local.radix import RadixCache
from gyre.engine.local.sampling import TokenFilter, draw, sampling_logprobs
from gyre.engine.local.stopping import StopChecker
from gyre.engine.protocol import DEFAULT_WEIGHT_VERSION, FinishReason, PauseMode, SamplingParams

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Batching and cache limits of one engine."""

    max_running_requests: int = 64
    max_step_tokens: int = 2048
    cache_capacity_tokens: int = 131072
    seed: int = 0
    recycled_kv_tokens: int = 131072
    """Tokens (summed over capacities) of finished sequences' KV buffers kept for the next sequences, so a
    continuation copies its cached prefix into memory already touched, not fresh memory (0: keep none)."""

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_step_tokens < self.max_running_requests:
            raise ValueError("max_step_tokens must be >= max_running_requests (every decode needs a slot)")
        if self.cache_capacity_tokens < 0:
            raise ValueError("cache_capacity_tokens must be >= 0")
        if self.recycled_kv_tokens < 0:
            raise ValueError("recycled_kv_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """Snapshot of one request, handed to its sink (cumulative, like SGLang's default stream)."""

    rid: str
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason | None
    weight_version: str
    e2e_latency: float

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class EngineRequest:
    """A validated request as the scheduler sees it."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    sink: Sink
    stream: bool = False
    arrival: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class _Sequence:
    req: EngineRequest
    prompt: np.ndarray
    """`req.input_ids` as int64, the radix cache's key type: converted once, not at every lookup and insert
    (each conversion of a 100K-id list cost ~3 ms of the scheduler thread)."""
    token_filter: TokenFilter
    generator: torch.Generator
    stop: StopChecker
    kv: SequenceKV
    pending: list[int]
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    retracted: bool = False
    prompt_cached: bool = False

    def computed_ids(self) -> np.ndarray:
        """The ids whose KV the sequence holds (prompt and output, up to `kv.length`)."""
        n = self.kv.length
        if n <= len(self.prompt):
            return self.prompt[:n]
        return np.concatenate((self.prompt, np.asarray(self.output_ids[: n - len(self.prompt)], dtype=np.int64)))


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    max_batch_size: int = 0
    forward_tokens: int = 0
    cached_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0


class Scheduler:
    """Owns the model runner, the prefix cache and the thread that drives them."""

    def __init__(
        self,
        runner: RaggedQwen2,
        decode: Callable[[Sequence[int]], str],
        eos_ids: frozenset[int],
        config: SchedulerConfig | None = None,
        pool: KvPool | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.runner = runner
        self.pacer = pacer
        """An emulated accelerator (`gyre.emulate`): each step then lasts what it would take there."""
        self.pool = pool
        """The engine's KV page pool (imported KV lives there; its counters go into `snapshot`)."""
        self.config = config or SchedulerConfig()
        self.cache = RadixCache(self.config.cache_capacity_tokens)
        kept = self.config.recycled_kv_tokens * runner.kv_shape.bytes_per_token()
        self.kv_buffers = SequenceBuffers(runner.kv_shape, kept)
        """Finished sequences' KV buffers, handed to the next sequences (see `SequenceBuffers`)."""
        self.stats = SchedulerStats()
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._decode = decode
        self._eos_ids = eos_ids
        self._seeds = torch.Generator().manual_seed(self.config.seed)
        self._cond = threading.Condition()
        self._inbox: deque[EngineRequest] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._idle_calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        """Calls that run once no request is running (`call_when_idle`); none is admitted meanwhile."""
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[_Sequence] = []
        self._in_flight: set[str] = set()  # rids submitted and not yet finished (guarded by _cond)
        self._paused = False
        self._hold_at: int | None = None
        """`hold`: the step count at which the loop stops stepping until `release_hold` (None: no hold)."""
        self._held = threading.Event()
        self._stopping = False
        self._fatal: BaseException | None = None
        self._free_since: float | None = None
        """With a pacer: when the emulated accelerator finished its last step, while steps follow each other
        without the loop waiting for work (None otherwise). The next step's emulated time counts from there, so
        the host's work between steps (sampling, replies, admission) is inside the accelerator's time, not
        added to it; an accelerator decodes back to back."""
        self._thread = threading.Thread(target=self._loop, name="gyre-engine-scheduler", daemon=True)

    # ---- thread-safe API -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self._fatal is None and not self._stopping

    def validate_prompt(self, input_ids: list[int]) -> None:
        """Raise `EngineRequestError` naming `input_ids` if this prompt cannot be served."""
        if not input_ids:
            raise EngineRequestError("input_ids", "must not be empty")
        vocab = self.runner.vocab_size
        bad = next((t for t in input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineRequestError("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(input_ids) >= self.runner.max_positions:
            raise EngineRequestError(
                "input_ids", f"{len(input_ids)} tokens exceed the context length {self.runner.max_positions}"
            )

    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises `EngineRequestError` for a rid already in flight or a bad prompt."""
        self.validate_prompt(req.input_ids)
        with self._cond:
            if not self.healthy:
                raise EngineError("engine scheduler is not running")
            if req.rid in self._in_flight:
                raise EngineRequestError("rid", f"request {req.rid!r} is already in flight")
            self._in_flight.add(req.rid)
            self._inbox.append(req)
            self._cond.notify_all()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the scheduler thread between two steps (works while paused)."""
        fut: Future[T] = Future()
        with self._cond:
            if not self.healthy:
                fut.set_exception(EngineError("engine scheduler is not running"))
                return fut
            self._calls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def call_when_idle(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the scheduler thread once no request is running (at once while paused: nothing
        advances then); requests that arrive meanwhile wait, not admitted. A weight update's drain: every
        request in flight finishes on the weights that began it, as SGLang's model-update lock makes an
        update wait for its generate requests."""
        fut: Future[T] = Future()
        with self._cond:
            if not self.healthy:
                fut.set_exception(EngineError("engine scheduler is not running"))
                return fut
            self._idle_calls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def abort(self, rid: str, abort_all: bool = False) -> Future[int]:
        return self.call(lambda: self._abort(rid, abort_all))

    def pause(self, mode: PauseMode) -> Future[int]:
        return self.call(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        return self.call(self._resume)

    def flush_cache(self) -> Future[None]:
        return self.call(self.cache.clear)

    def hold(self, steps: int) -> threading.Event:
        """A test seam: take at most `steps` more forward steps, then hold — admit and step nothing — until
        `release_hold`. Control calls (abort, pause, weight loads, KV moves) still run while held, and nothing
        reports the hold: to a client the requests are running. Returns an event set once the loop holds.

        Why: a test that acts on a request mid-generation (aborts, pauses or redirects it) must act before the
        reply ends. Waiting on a step counter and then sending the call races the generation on a loaded
        machine; holding the loop orders the two whatever the machine's speed."""
        if steps < 0:
            raise ValueError("steps must be >= 0")
        with self._cond:
            self._hold_at = self.stats.steps + steps
            self._held.clear()
            if steps == 0:
                self._held.set()
        return self._held

    def release_hold(self) -> None:
        """End a `hold`: the loop admits and steps again."""
        with self._cond:
            self._hold_at = None
            self._cond.notify_all()

    def _holding(self) -> bool:
        return self._hold_at is not None and self.stats.steps >= self._hold_at

    def snapshot(self) -> dict[str, Any]:
        """Counters for `/gyre/stats` (read without locking; values may be one step stale)."""
        s = self.stats
        return {
            "steps": s.steps,
            "max_batch_size": s.max_batch_size,
            "forward_tokens": s.forward_tokens,
            "cached_tokens": s.cached_tokens,
            "finished_requests": s.finished_requests,
            "aborted_requests": s.aborted_requests,
            "running": len(self._running),
            "waiting": len(self._waiting) + len(self._inbox),
            "paused": self._paused,
            "draining": bool(self._idle_calls),
            "weight_version": self.weight_version,
            "cache_tokens": self.cache.tokens,
            "cache_hits": self.cache.stats.hits,
            "cache_lookups": self.cache.stats.lookups,
            "kv_buffers": self.kv_buffers.snapshot(),
            **({"kv_pool": self.pool.snapshot()} if self.pool is not None else {}),
            **({"emulation": self.pacer.snapshot()} if self.pacer is not None else {}),
        }

    # ---- scheduler thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._stopping
                        or self._calls
                        or self._inbox
                        or (self._idle_calls and (self._paused or not self._running))
                        or (not self._paused and not self._holding()
                            and (self._running or (self._waiting and not self._idle_calls)))
                    ):
                        self._free_since = None  # idle: the next step starts when its work arrives
                        self._cond.wait()
                    if self._stopping:
                        break
                    calls = list(self._calls)
                    self._calls.clear()
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                    if self._idle_calls and (self._paused or not self._running):
                        calls.extend(self._idle_calls)
                        self._idle_calls.clear()
                if calls:
                    self._free_since = None  # control calls (weights, pause, KV moves) are paced by their callers
                for fn, fut in calls:
                    self._run_call(fn, fut)
                if not self._paused and not self._holding():
                    with self._cond:
                        draining = bool(self._idle_calls)
                    if not draining:
                        self._admit()
                    if self._running:
                        self._step()
        except BaseException as e:
            self._fatal = e
            raise
        finally:
            self._shutdown()

    @staticmethod
    def _run_call(fn: Callable[[], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except (EngineError, ValueError, OSError) as e:  # the caller's problem: reported to the caller
            fut.set_exception(e)
            return
        except BaseException as e:  # a bug: tell the caller, then let it stop the engine loudly
            fut.set_exception(e)
            raise
        fut.set_result(result)

    def _shutdown(self) -> None:
        reason = f"engine stopped: {self._fatal!r}" if self._fatal else "engine shutting down"
        with self._cond:
            self._stopping = True
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            calls = [*self._calls, *self._idle_calls]
            self._calls.clear()
            self._idle_calls.clear()
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineError(reason))
        for seq in list(self._running):
            self._finish(seq, FinishReason(type="abort", message=reason))
        while self._waiting:
            self._finish_unstarted(self._waiting.popleft(), reason)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running_requests:
            req = self._waiting.popleft()
            seq = self._new_sequence(req)
            if req.params.max_new_tokens == 0:
                self._finish(seq, FinishReason(type="length", length=0))
                continue
            self._running.append(seq)

    def _new_sequence(self, req: EngineRequest) -> _Sequence:
        f = TokenFilter.from_params(req.params)
        seed = req.params.sampling_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._seeds))
        kv = SequenceKV(self.runner.kv_shape, len(req.input_ids) + min(req.params.max_new_tokens, 256),
                        self.kv_buffers)
        seq = _Sequence(
            req=req,
            prompt=np.fromiter(req.input_ids, dtype=np.int64, count=len(req.input_ids)),
            token_filter=f,
            generator=torch.Generator().manual_seed(seed),
            stop=StopChecker(req.params, self._eos_ids, self._decode),
            kv=kv,
            pending=[],
            cached_tokens=0,
        )
        seq.cached_tokens = self._load_prefix(seq, seq.prompt)
        self.stats.cached_tokens += seq.cached_tokens
        return seq

    def _load_prefix(self, seq: _Sequence, tokens: np.ndarray | list[int]) -> int:
        """Copy the longest cached prefix of `tokens` into `seq.kv` (leaving >= 1 token to compute, whose
        logits are needed) and make the rest pending. Returns the number of reused tokens."""
        match = self.cache.match(tokens, limit=len(tokens) - 1)
        seq.kv.reset()
        for segment in match.segments:
            seq.kv.append_segment(segment)
        rest = tokens[match.length :]
        seq.pending = rest.tolist() if isinstance(rest, np.ndarray) else list(rest)
        return match.length

    def _plan(self) -> list[tuple[_Sequence, int]]:
        budget = self.config.max_step_tokens
        plan: list[tuple[_Sequence, int]] = []
        for seq in sorted(self._running, key=lambda s: len(s.pending)):  # decodes (1 token) first
            if budget <= 0:
                break
            take = min(len(seq.pending), budget)
            plan.append((seq, take))
            budget -= take
        return plan

    def _step(self) -> None:
        started = self.pacer.clock() if self.pacer is not None else 0.0
        plan = self._plan()
        inputs = [StepInput(seq.kv, seq.pending[:take], take == len(seq.pending)) for seq, take in plan]
        decoding = [seq for seq, _ in plan if seq.output_ids]  # a token each; the others compute their prompt
        logits = self.runner.step(inputs)
        if self.pacer is not None:
            context = sum(seq.kv.length for seq in decoding)
            prefill = sum(take for seq, take in plan if not seq.output_ids)
            since = started if self._free_since is None else self._free_since
            self.pacer.hold(since, self.pacer.emulation.engine_step_s(len(decoding), context, prefill))
            self._free_since = self.pacer.clock()
        self.stats.steps += 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(plan))
        self.stats.forward_tokens += sum(take for _, take in plan)
        for (seq, take), row in zip(plan, logits, strict=True):
            seq.pending = seq.pending[take:]
            if row is not None:
                self._sample(seq, row)
        if self._holding():
            self._held.set()  # after the step's tokens reached their sinks

    def _sample(self, seq: _Sequence, logits: torch.Tensor) -> None:
        if not seq.prompt_cached and not seq.output_ids:
            self.cache.insert(seq.prompt, seq.kv)  # concurrent requests can share this prompt now
            seq.prompt_cached = True
        logprobs = sampling_logprobs(logits, seq.token_filter)
        token = draw(logprobs, seq.token_filter, seq.generator)
        seq.output_ids.append(token)
        seq.output_logprobs.append(float(logprobs[token]))
        finish = seq.stop.check(seq.output_ids)
        if finish is None and seq.kv.length + 1 >= self.runner.max_positions:
            finish = FinishReason(type="length", length=len(seq.output_ids))
        if finish is not None:
            self._finish(seq, finish)
            return
        seq.pending = [token]
        if seq.req.stream:
            self._emit(seq, None)

    def _finish(self, seq: _Sequence, finish: FinishReason) -> None:
        if seq in self._running:
            self._running.remove(seq)
        self.cache.insert(seq.computed_ids(), seq.kv)
        seq.kv.release()  # the cache copied what it keeps; the next sequence reuses the buffer
        if finish.type == "abort":
            self.stats.aborted_requests += 1
        else:
            self.stats.finished_requests += 1
        with self._cond:
            self._in_flight.discard(seq.req.rid)
        self._emit(seq, finish)

    def _finish_unstarted(self, req: EngineRequest, message: str) -> None:
        with self._cond:
            self._in_flight.discard(req.rid)
        self.stats.aborted_requests += 1
        req.sink(
            RequestOutput(
                rid=req.rid,
                prompt_tokens=len(req.input_ids),
                cached_tokens=0,
                output_ids=[],
                output_logprobs=[],
                finish_reason=FinishReason(type="abort", message=message),
                weight_version=self.weight_version,
                e2e_latency=time.perf_counter() - req.arrival,
            )
        )

    def _emit(self, seq: _Sequence, finish: FinishReason | None) -> None:
        seq.req.sink(
            RequestOutput(
                rid=seq.req.rid,
                prompt_tokens=len(seq.req.input_ids),
                cached_tokens=seq.cached_tokens,
                output_ids=list(seq.output_ids),
                output_logprobs=list(seq.output_logprobs),
                finish_reason=finish,
                weight_version=self.weight_version,
                e2e_latency=time.perf_counter() - seq.req.arrival,
            )
        )

    def _abort(self, rid: str, abort_all: bool) -> int:
        with self._cond:  # requests still in the inbox are moved first so they can be aborted too
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        count = 0
        for req in [r for r in self._waiting if abort_all or r.rid == rid]:
            self._waiting.remove(req)
            self._finish_unstarted(req, "aborted before it started")
            count += 1
        for seq in [s for s in self._running if abort_all or s.req.rid == rid]:
            self._finish(seq, FinishReason(type="abort", message="aborted by request"))
            count += 1
        return count

    def _pause(self, mode: PauseMode) -> int:
        """Stop stepping; returns how many requests were paused (0 in `abort` mode, which aborts them)."""
        self._paused = True
        if mode == "abort":
            self._abort("", abort_all=True)
            return 0
        if mode == "retract":
            for seq in self._running:
                seq.pending = seq.req.input_ids + seq.output_ids  # KV is recomputed on continue
                seq.kv.release()
                seq.kv = SequenceKV(self.runner.kv_shape, 1, self.kv_buffers)
                seq.retracted = True
        return len(self._running)

    def _resume(self) -> None:
        for seq in self._running:
            if seq.retracted:
                self._load_prefix(seq, seq.pending)
                seq.retracted = False
        self._paused = False

    def cache_sequence(self, rid: str) -> int:
        """Put the KV of running (or paused) request `rid` into the prefix cache, so it can be exported;
        returns the tokens it covers (0 for an unknown rid or a retracted request, whose KV is gone)."""
        for seq in self._running:
            if seq.req.rid == rid and not seq.retracted:
                self.cache.insert(seq.computed_ids(), seq.kv)
                return seq.kv.length
        return 0

    def abort_all_running(self) -> int:
        """For weight updates with `abort_all_requests` (call on the scheduler thread)."""
        return self._abort("", abort_all=True)

    @property
    def num_running(self) -> int:
        return len(self._running)
