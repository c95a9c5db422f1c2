"""The proxy itself, independent of the HTTP APIs: executions, TITO, routing, redirects, recording.

A front end (Anthropic or OpenAI) authenticates a request to an execution, translates it into a
`Conversation`, and calls `Proxy.begin`, which renders it into units, finds where it attaches in the
execution's call tree, and records `model_call_started`. `ActiveCall.generations` drives the engine — across
redirects, engine-side aborts and lost engines, continuing from the partial output, so the harness only sees
latency — and `ActiveCall.complete` records `model_call_finished` durably before the front end answers.

A lost engine (connection refused or reset, stream cut: `EngineUnreachableError`, confirmed by an abort the
engine cannot take either) marks its cell down in the router, which moves the cell's executions to the live
admitting cells; each call in flight there fails on its own and continues where its execution now is, from
prompt + partial output (a `call_redirected` event whose `kv_refused` says the source engine was lost). With
no live admitting cell the call waits up to `ProxyConfig.engine_lost_wait_s` for a routing update, then
fails with `EngineLostError`, which the front ends answer as a retryable overloaded error. An engine's own
error answer (4xx, 5xx) or a timeout is not a loss: it is raised as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gyre.engine import (
    EngineError,
    EngineProtocolError,
    EngineTimeoutError,
    EngineUnreachableError,
    FinishReason,
    GenerateResult,
    SamplingParams,
)
from gyre.events.models import (
    CallRedirected,
    Event,
    ExecutionQueued,
    ExecutionStarted,
    ModelCallFinished,
    ModelCallStarted,
)
from gyre.proxy.branches import Agent
from gyre.proxy.config import ProxyConfig
from gyre.proxy.conversation import Conversation, Message
from gyre.proxy.errors import ApiError, EngineLostError
from gyre.proxy.kv_mover import MooncakeKvMover
from gyre.proxy.registry import ExecutionRegistry, ExecutionState, Registration
from gyre.proxy.render import ChatRenderer
from gyre.proxy.routing import UNPLACED, Flight, KvMove, KvMover, RecomputeKv, Router
from gyre.proxy.template_render import codec_renderer
from gyre.proxy.tito import CallRecord, Plan
from gyre.proxy.tokens import TokenCodec
from gyre.proxy.transport import GenerateEngine, Prompt, engine_link, prompt_of
from gyre.sink import EventSink, LogSink, MemorySink

log = logging.getLogger(__name__)

_RETRY_BACKOFF_S = 0.05
SAMPLING_KEPT = 1024
"""Sampling parameters kept per distinct `CallSettings` (all forgotten when full): a harness asks the same
of every call, and `SamplingParams` validated once is the same object for the next (it is frozen)."""
LOST_REASON = "source engine lost"
"""How a `call_redirected` event's `kv_refused` starts when the call left a lost engine."""
CUT_REASON = "cut (partial rollouts): resumed by a re-prefill"
"""A `call_redirected` event's `kv_refused` when the call's execution was cut and placed again."""


@dataclass(frozen=True, kw_only=True)
class CallSettings:
    """What a request asks of the model, in API-neutral terms."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    """A call's output so far (cumulative); `finish` is set on the last one."""

    output_ids: list[int]
    finish: FinishReason | None = None


def _served_version(weight_version: str | None) -> int | None:
    """An engine's ``weight_version`` as a policy version; None for a name that is not one (SGLang's
    "default": an engine nobody named a version)."""
    return int(weight_version) if weight_version is not None and weight_version.isdigit() else None


def harness_env(registration: Registration, base_url: str, model: str = "gyre-policy") -> dict[str, str]:
    """Environment that points Anthropic- and OpenAI-speaking harnesses at the proxy with their token."""
    base = base_url.rstrip("/")
    return {
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_AUTH_TOKEN": registration.token,
        "ANTHROPIC_MODEL": model,
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_BASE": f"{base}/v1",
        "OPENAI_API_KEY": registration.token,
        "OPENAI_MODEL": model,
    }


class Proxy:
    """Token-in/token-out proxy state: registry, call trees, routing, sink. Lives on one event loop."""

    def __init__(
        self,
        config: ProxyConfig,
        *,
        sink: EventSink | None = None,
        codec: TokenCodec | None = None,
        renderer: ChatRenderer | None = None,
        engines: Mapping[str, GenerateEngine] | None = None,
        kv_mover: KvMover | None = None,
    ) -> None:
        self.config = config
        self.sink: EventSink = sink if sink is not None else MemorySink()
        if isinstance(self.sink, LogSink):  # a call's commit inline on the loop only while no other call is in flight
            self.sink.busy_when(lambda: bool(self._active))
        self.codec = codec if codec is not None else TokenCodec.load(config.tokenizer)
        if renderer is None:
            renderer = codec_renderer(self.codec)
        self.renderer: ChatRenderer = renderer
        if engines is None:
            engines = {cell: engine_link(url, timeout_s=config.engine_timeout_s)
                       for cell, url in config.engines.items()}
        self.router = Router(engines)
        if kv_mover is None and config.kv_mover == "mooncake":
            kv_mover = MooncakeKvMover(lambda cell: self.router.engine(cell).base_url)
        if kv_mover is None:
            kv_mover = RecomputeKv()
        self.kv_mover: KvMover = kv_mover
        self.registry = ExecutionRegistry(self.codec, config.markers)
        self._active: dict[str, ActiveCall] = {}
        self._context: dict[str, int | None] = {}
        self._params: dict[CallSettings, SamplingParams] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.on_placed_again: Callable[[str], None] | None = None
        """Told the id of each cut execution once it is placed again (a cluster's harness runner stops holding
        its timeout there)."""

    # -- the runner's API ------------------------------------------------------------------------------

    def register_execution(
        self, execution_id: str, token: str | None = None, *, cell_id: str | None = None, policy_version: int = 0,
        attempt: int = 0,
    ) -> Registration:
        """Accept calls carrying `token` (generated when None) as `execution_id`, pinned to `cell_id`.

        ``cell_id=UNPLACED``: pinned later, when its harness starts (`Router.place`, in a cluster)."""
        if cell_id == UNPLACED:
            return self.registry.add(execution_id, token, UNPLACED, policy_version, attempt).registration
        cell = self.router.pin(execution_id, cell_id)
        try:
            state = self.registry.add(execution_id, token, cell, policy_version, attempt)
        except ValueError:
            if cell_id is None or self.router.cell_of(execution_id) == cell:
                self.router.unpin(execution_id)
            raise
        return state.registration

    def unregister_execution(self, execution_id: str) -> None:
        """Revoke the token and forget the execution's call tree (its calls are in the log)."""
        self.registry.remove(execution_id)
        self.router.unpin(execution_id)

    async def redirect(self, from_cell: str, to_cells: list[str]) -> dict[str, str]:
        """Move `from_cell`'s executions to `to_cells`; its in-flight calls are aborted there and continue on
        the new cell (a `call_redirected` event each). Returns the new pin of every moved execution."""
        moved = self.router.repin(from_cell, to_cells)
        await self._abort_flights(from_cell, lambda f: moved.get(f.execution_id))
        return moved

    async def _abort_flights(self, from_cell: str, target: Callable[[Flight], str | None]) -> int:
        """Mark every call in flight on ``from_cell`` to continue on ``target(flight)`` (else where its execution
        is pinned), then abort it there; the call itself resubmits. Returns how many there were."""
        flights = [f for f in self.router.flights_on(from_cell) if not f.cut]  # a cut call waits to be placed
        for flight in flights:
            flight.redirect_to = target(flight) or self._continuation(flight.execution_id)
        await self._abort(from_cell, flights, "redirect")
        return len(flights)

    async def _abort(self, from_cell: str, flights: list[Flight], why: str) -> None:
        """Abort ``flights`` (already marked: each call goes on by itself) on ``from_cell``'s engine."""
        engine = self.router.engine(from_cell)
        for flight in flights:
            try:
                await engine.abort(flight.rid)
            except EngineError as e:  # a dead cell: the request fails by itself and the call moves on
                log.warning("%s: aborting %s on %s failed: %s", why, flight.rid, from_cell, e)

    def _continuation(self, execution_id: str) -> str | None:
        """Where a call moved off a leaving cell continues when the plan does not say: its execution's pin;
        for an execution this proxy holds no pin for (a restarted proxy that has not placed it again, while
        the decision was made on the log's older view), the admitting cell that `Router.place` picks, pinned
        there. None when no cell admits: the aborted call then ends as any engine abort does."""
        pinned = self.router.pin_of(execution_id)
        if pinned is not None:
            return pinned
        return self.router.place(execution_id, self.router.need(execution_id))

    async def redirect_plan(self, from_cell: str, planned: Mapping[str, str],
                            executions: Mapping[str, str] | None = None) -> tuple[int, dict[str, str]]:
        """A cell leaves rollout (the cluster path): it admits no new execution; each in-flight call named in
        ``planned`` (call id -> cell) continues where the plan says, any other call on the cell (one that
        started after the decision) where its execution is repinned; executions move to their planned call's
        cell (``executions``: execution id -> cell), the rest to the admitting cell with the most free slots.
        Returns the number of calls redirected and the new pins."""
        self.router.set_route(from_cell, 0, admitting=False)
        moved = self.router.repin_plan(from_cell, executions or {})
        calls = await self._abort_flights(from_cell, lambda f: planned.get(f.call_id))
        return calls, moved

    async def cut(self, from_cell: str, queued: list[Event], version: int) -> int:
        """Partial rollouts (the cluster path, after `redirect_plan`): the executions ``queued`` names (their
        `execution_queued` again, as the simulator records a cut) leave ``from_cell`` without a redirect: each
        releases its slot and its call in flight is aborted; the call keeps its tokens and continues — its
        conversation and those tokens re-sent, a re-prefill, so the prefix tree keeps one trajectory — once
        its execution is placed again on an admitting cell holding ``version`` or newer (`_resume_cut`); a
        harness between calls waits there at its next call. Returns how many calls were in flight."""
        cut = {e.execution_id for e in queued if isinstance(e, ExecutionQueued)}
        self.router.set_route(from_cell, 0, admitting=False)  # none of them is placed there again
        self.sink.record(queued)  # before any resume of theirs (the same producer): the fold unplaces them
        for execution_id in sorted(cut):
            self.router.cut(execution_id, version)
        flights = [f for f in self.router.flights_on(from_cell) if f.execution_id in cut]
        for flight in flights:
            flight.cut = True
        await self._abort(from_cell, flights, "cut")
        return len(flights)

    async def _resume_cut(self, state: ExecutionState, call: ActiveCall | None = None) -> str:
        """Where a cut execution continues: placed again once a cell admits it (waits up to `weights_wait_s`,
        woken by routing changes); recorded as its `execution_started` there and, for its call in flight, a
        `call_redirected` that names the cut and the tokens re-prefilled."""
        execution_id = state.execution_id

        def give_up() -> EngineLostError:
            return EngineLostError(UNPLACED, f"cut execution {execution_id!r} was not placed again within "
                                             f"{self.config.weights_wait_s:g} s")

        cell = await self._await_route(lambda: self.router.place_cut(execution_id), self.config.weights_wait_s,
                                       give_up)
        self.sink.record(ExecutionStarted(execution_id=execution_id, cell_id=cell))
        if self.on_placed_again is not None:
            self.on_placed_again(execution_id)
        if call is not None:
            call.redirects += 1
            self.sink.record(CallRedirected(
                execution_id=execution_id, call_id=call.call_id, cell_id=cell, from_cell_id=call.cell_id,
                to_cell_id=cell, tokens_done=len(call.output_ids),
                tokens_recomputed=call.record.prompt_len + len(call.output_ids), kv_refused=CUT_REASON))
        return cell

    async def _confirm_lost(self, flight: Flight, engine: GenerateEngine) -> bool:
        """``flight`` failed unreachable on ``engine``: True when the cell is (now) down. The engine is asked
        to abort the request on a fresh request: if it answers, it is alive (a dropped connection; the old
        request is gone) and the call may continue there; if it cannot be reached either, the cell is marked
        down and its executions move (`Router.mark_down`)."""
        router, cell = self.router, flight.cell_id
        if router.is_down(cell):
            return True
        if router.engine(cell) is not engine:
            return False  # the cell has a new engine since (a restarted cell): try that
        try:
            await engine.abort(flight.rid)
        except (EngineUnreachableError, EngineTimeoutError) as e:
            if not router.is_down(cell):  # not already marked by another of its calls that failed too
                moved = router.mark_down(cell, engine)
                log.warning("cell %s: engine lost (%s; abort: %s): marked down, %d execution(s) moved: %s",
                            cell, flight.lost, e, len(moved), moved)
            return router.is_down(cell)
        except EngineError as e:
            log.info("cell %s: the engine answers (%s) after %s; continuing there", cell, e, flight.lost)
        return False

    async def live_cell(self, execution_id: str, cause: EngineError | None = None) -> str:
        """Where ``execution_id`` runs, its pinned cell being down: the live admitting cell it is re-pinned
        to (`Router.relocate`), waiting up to `engine_lost_wait_s` for one (woken by routing changes);
        then `EngineLostError`. Without a controller (`Router.routed` false) nothing can route a cell back:
        it fails at once and the down marks are cleared, so that the harness's retry tries again."""
        from_cell = self.router.pin_of(execution_id) or UNPLACED
        routed = self.router.routed

        def give_up() -> EngineLostError:
            if not routed:  # no controller will route a cell back: fail now, and the retry tries them all again
                log.warning("no live cell for %s: the retry tries %s again", execution_id, self.router.revive())
            url = self.router.engine(from_cell).base_url if from_cell in self.router.cells else from_cell
            waited = f"within {self.config.engine_lost_wait_s:g} s" if routed else "(none is live)"
            return EngineLostError(url, f"cell {from_cell!r} is down and no other cell admitted execution "
                                        f"{execution_id!r} {waited}; the engine: {cause or 'lost earlier'}")

        return await self._await_route(lambda: self.router.relocate(execution_id),
                                       self.config.engine_lost_wait_s if routed else 0.0, give_up, cause)

    async def cell_holding(self, execution_id: str, version: int) -> str:
        """Where ``execution_id`` runs once that cell's engine holds ``version`` or newer: its cell is loading
        a version just published, or the execution moved to a cell that has not loaded it yet. Waits (woken by
        routing changes) up to `weights_wait_s`, then `EngineLostError` (a retryable answer)."""
        def look() -> str | None:
            cell = self.router.relocate(execution_id) or self.router.cell_of(execution_id)
            return cell if self.router.holds(cell, version) else None

        def give_up() -> EngineLostError:
            cell = self.router.cell_of(execution_id)
            return EngineLostError(self.router.engine(cell).base_url,
                                   f"cell {cell!r} did not load weights v{version}, which execution "
                                   f"{execution_id!r} was queued with, within {self.config.weights_wait_s:g} s")

        return await self._await_route(look, self.config.weights_wait_s, give_up)

    async def _await_route(self, look: Callable[[], str | None], wait_s: float,
                           give_up: Callable[[], EngineLostError], cause: BaseException | None = None) -> str:
        """``look()`` again after every routing change until it names a cell, for up to ``wait_s``; then the
        error ``give_up()`` builds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            changed = asyncio.Event()

            def wake(event: asyncio.Event = changed) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(event.set)

            unwatch = self.router.watch(wake)  # before looking: a change in between still wakes us
            try:
                cell = look()
                if cell is not None:
                    return cell
                left = deadline - loop.time()
                if left <= 0:
                    raise give_up() from cause
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
            finally:
                unwatch()

    def stats(self) -> dict[str, int]:
        return {"executions": len(self.registry), "calls_in_flight": len(self._active)}

    async def aclose(self) -> None:
        for call in list(self._active.values()):
            call.abandon()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.router.aclose()
        if isinstance(self.kv_mover, MooncakeKvMover):
            await self.kv_mover.aclose()

    # -- the front ends' API ---------------------------------------------------------------------------

    def authenticate(self, token: str | None) -> ExecutionState | None:
        return self.registry.by_token(token) if token else None

    def count_prompt_tokens(self, state: ExecutionState, conversation: Conversation) -> int:
        """Tokens the model would see for this conversation now (read-only)."""
        return state.tree.plan(self.renderer.render(conversation).units).prompt_len

    async def context_length(self, cell: str) -> int | None:
        """The context length of `cell`'s engine: configured, else asked once (None: unknown, not checked)."""
        if self.config.context_length is not None:
            return self.config.context_length
        if cell not in self._context:
            ask = getattr(self.router.engine(cell), "context_length", None)  # optional in `GenerateEngine`
            try:
                self._context[cell] = await ask() if ask is not None else None
            except EngineError as e:  # not cached: the engine may come up; it still rejects long prompts itself
                log.warning("could not read the context length of %s: %s", cell, e)
                return None
        return self._context[cell]

    async def open(
        self, state: ExecutionState, conversation: Conversation, settings: CallSettings, *, stream: bool,
        dropped_tools: Sequence[str] = (),
    ) -> ActiveCall:
        """`begin`, after learning the engine's context length so that an overlong prompt is refused first.
        An execution pinned to a down cell moves first when a live cell admits it (else its call waits)."""
        if self.router.is_cut(state.execution_id):
            await self._resume_cut(state)
        cell = self.router.relocate(state.execution_id) or self.router.cell_of(state.execution_id)
        limit = await self.context_length(cell)
        return self.begin(state, conversation, settings, stream=stream, context_length=limit,
                          dropped_tools=dropped_tools)

    def begin(
        self,
        state: ExecutionState,
        conversation: Conversation,
        settings: CallSettings,
        *,
        stream: bool,
        context_length: int | None = None,
        dropped_tools: Sequence[str] = (),
    ) -> ActiveCall:
        """Attach the request to the execution's call tree and record `model_call_started`; `dropped_tools`
        names the tools the request offered that the front end left out of the prompt (hosted tools).

        A prompt that does not fit `context_length` raises `ApiError` (400, Anthropic's "prompt is too long"
        wording, which Claude Code does not retry) and records nothing: no engine call was made.
        """
        params = self._sampling(settings)
        rendering = self.renderer.render(conversation, state.rendered)
        plan = state.tree.plan(rendering.units)
        if context_length is not None and plan.prompt_len >= context_length:
            raise ApiError(
                "context_length", f"prompt is too long: {plan.prompt_len} tokens > {context_length - 1} maximum"
            )
        parent_agent = plan.parent.agent if plan.parent is not None else None
        assert parent_agent is None or isinstance(parent_agent, Agent)
        agent, branch = state.agents.classify(conversation, parent_agent)
        call_id = state.next_call_id()
        record = state.tree.start(plan, call_id, branch=branch, agent=agent)
        if plan.parent is None:
            state.roots += 1
        if plan.drift:
            state.drifted_calls += 1
            state.drift_tokens += plan.drift
        cell = self.router.cell_of(state.execution_id)
        self.sink.record(
            ModelCallStarted(
                execution_id=state.execution_id,
                call_id=call_id,
                cell_id=cell,
                parent_call_id=plan.parent.call_id if plan.parent else None,
                branch=branch,
                prompt_tokens=plan.prompt_len,
                policy_version=state.registration.policy_version,
                rerendered_turns=rendering.rewritten,
                attempt=state.registration.attempt,
                dropped_tools=list(dropped_tools),
            )
        )
        call = ActiveCall(self, state, record, plan, params, stream=stream, cell_id=cell)
        self._active[call_id] = call
        return call

    def _sampling(self, settings: CallSettings) -> SamplingParams:
        params = self._params.get(settings)
        if params is None:
            if len(self._params) >= SAMPLING_KEPT:
                self._params.clear()
            params = self._params[settings] = self._sampling_of(settings)
        return params

    def _sampling_of(self, settings: CallSettings) -> SamplingParams:
        over = self.config.sampling
        max_tokens = settings.max_tokens
        if self.config.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.config.max_tokens_cap)
        chosen = {
            "temperature": over.temperature if over.temperature is not None else settings.temperature,
            "top_p": over.top_p if over.top_p is not None else settings.top_p,
            "top_k": over.top_k if over.top_k is not None else settings.top_k,
            "stop": list(settings.stop) or None,
            "sampling_seed": settings.seed,
            "ignore_eos": True if over.ignore_eos else None,
        }
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                skip_special_tokens=False,
                spaces_between_special_tokens=False,
                no_stop_trim=True,
                **{k: v for k, v in chosen.items() if v is not None},
            )
        except ValidationError as e:
            first = e.errors()[0]
            raise ApiError("invalid_request", f"{first['msg']}", ".".join(map(str, first["loc"]))) from e

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class ActiveCall:
    """One model call in progress; see the module docstring for its life cycle."""

    def __init__(
        self,
        proxy: Proxy,
        state: ExecutionState,
        record: CallRecord,
        plan: Plan,
        params: SamplingParams,
        *,
        stream: bool,
        cell_id: str,
    ) -> None:
        self.proxy = proxy
        self.state = state
        self.record = record
        self.plan = plan
        self.params = params
        self.stream = stream
        self.cell_id = cell_id
        self.started = time.perf_counter()
        self.opened_at = time.time()
        """When the call was opened (Unix seconds): what a plain answer's ``gyre-started-at`` says."""
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: FinishReason | None = None
        self.cached_tokens = 0
        self.engine_version: int | None = None
        """The version the engines reported serving this call with (the oldest over its attempts)."""
        self.redirects = 0
        self._flight: Flight | None = None
        self._last: GenerateResult | None = None
        self._closed = False

    @property
    def call_id(self) -> str:
        return self.record.call_id

    @property
    def prompt_tokens(self) -> int:
        return self.record.prompt_len

    async def generations(self) -> AsyncIterator[Generation]:
        """Cumulative outputs as they come (only the final one unless streaming); raises `EngineError`."""
        proxy, execution, router = self.proxy, self.state.execution_id, self.proxy.router
        engine_aborts = attempt = 0
        lost: EngineError | None = None  # why the last attempt's cell was left
        while True:
            remaining = self.params.max_new_tokens - len(self.output_ids)
            if remaining <= 0:
                self.finish = FinishReason(type="length", length=len(self.output_ids))
                yield Generation(list(self.output_ids), self.finish)
                return
            if router.is_cut(execution):
                await proxy._resume_cut(self.state, self)
            cell = router.cell_of(execution)
            if router.is_down(cell):
                cell = await proxy.live_cell(execution, lost)
            if not router.holds(cell, self.state.registration.policy_version):
                cell = await proxy.cell_holding(execution, self.state.registration.policy_version)
            if cell != self.cell_id and (lost is not None or router.is_down(self.cell_id)):
                self._moved_off_lost(self.cell_id, cell, lost)
            lost = None
            self.cell_id = cell
            flight = Flight(execution, self.call_id, cell, f"{self.call_id}#{attempt}")
            attempt += 1
            params = self.params
            if remaining != params.max_new_tokens:  # a continuation asks only for what is left
                params = params.model_copy(update={"max_new_tokens": remaining})
            prompt = prompt_of(self.record, self.output_ids)
            self._last = None
            engine = router.engine(cell)
            async for partial in self._attempt(engine, flight, prompt, params):
                yield partial
            finish = self._absorb(self._last)
            if finish is not None and finish.type != "abort":
                self.finish = finish
                yield Generation(list(self.output_ids), finish)
                return
            if flight.cut:
                continue  # the loop's top waits until the execution is placed again
            if flight.redirect_to is not None:
                await self._redirected(flight)
                continue
            if flight.lost is not None:
                if await proxy._confirm_lost(flight, engine):
                    lost = flight.lost  # the loop's top continues the call where its execution now is
                    continue
                if engine_aborts >= proxy.config.engine_abort_retries:
                    raise flight.lost
                engine_aborts += 1  # a dropped connection to a live engine: continue there
                await asyncio.sleep(_RETRY_BACKOFF_S * engine_aborts)
                continue
            if finish is not None and engine_aborts < proxy.config.engine_abort_retries:
                engine_aborts += 1  # the engine aborted on its own (a pause for a weight update): continue
                await asyncio.sleep(_RETRY_BACKOFF_S * engine_aborts)
                continue
            self.finish = finish or FinishReason(type="abort", message="the engine stream ended without a result")
            yield Generation(list(self.output_ids), self.finish)
            return

    async def _attempt(
        self, engine: GenerateEngine, flight: Flight, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[Generation]:
        """One engine request: yields partial outputs while streaming, leaves its last result in `_last`."""
        router = self.proxy.router
        router.track(flight)
        self._flight = flight
        try:
            if self.stream:
                async for result in engine.generate_stream(
                    prompt, params, flight.rid, routing_key=self.state.execution_id
                ):
                    self._last = result
                    if result.finish_reason is None:
                        yield Generation(self.output_ids + result.output_ids)
            else:
                self._last = await engine.generate(prompt, params, flight.rid, routing_key=self.state.execution_id)
        except EngineError as e:
            if flight.redirect_to is None and not flight.cut:
                if not isinstance(e, EngineUnreachableError):
                    raise  # the engine answered (an error status, a bad body) or timed out: not a loss
                log.warning("call %s: engine of %s unreachable: %s", self.call_id, flight.cell_id, e)
                flight.lost = e
                return
            log.info(
                "call %s: engine of %s failed while being redirected; continuing on %s",
                self.call_id,
                flight.cell_id,
                flight.redirect_to,
            )
        finally:
            router.untrack(flight)
            self._flight = None

    def _absorb(self, result: GenerateResult | None) -> FinishReason | None:
        """Append an attempt's tokens (a partial stream counts too); its finish reason, if it has one."""
        if result is None:
            return None
        if result.output_logprobs is None:
            raise EngineProtocolError(f"engine answered {result.rid} without output log-probs")
        self.output_ids.extend(result.output_ids)
        self.logprobs.extend(result.output_logprobs)
        self.cached_tokens += result.cached_tokens
        served = _served_version(result.weight_version)
        if served is not None and (self.engine_version is None or served < self.engine_version):
            self.engine_version = served  # the oldest weights that produced any of the call's tokens
        return result.finish_reason

    async def _redirected(self, flight: Flight) -> None:
        assert flight.redirect_to is not None
        ids = self.record.ids(0, self.record.prompt_len)  # an array("i"): the mover sends it without a list
        ids.extend(self.output_ids)
        move = KvMove(self.state.execution_id, self.call_id, flight.cell_id, flight.redirect_to, ids, rid=flight.rid)
        moved = await self.proxy.kv_mover.move(move)
        self.redirects += 1
        self.cell_id = flight.redirect_to
        self.proxy.sink.record(
            CallRedirected(
                execution_id=self.state.execution_id,
                call_id=self.call_id,
                cell_id=flight.redirect_to,
                from_cell_id=flight.cell_id,
                to_cell_id=flight.redirect_to,
                kv_blocks=moved.blocks,
                kv_bytes=moved.bytes,
                tokens_done=len(self.output_ids),
                kv_tokens=moved.tokens,
                kv_transfer_seconds=moved.transfer_seconds,
                kv_seconds=moved.seconds,
                tokens_recomputed=moved.tokens_recomputed,
                kv_refused=moved.refused,
            )
        )

    def _moved_off_lost(self, from_cell: str, to_cell: str, cause: EngineError | None) -> None:
        """The call continues on ``to_cell`` because ``from_cell``'s engine was lost: nothing can be fetched
        from a dead engine, so the new one recomputes prompt + partial output (no KV mover is asked)."""
        self.redirects += 1
        recomputed = self.record.prompt_len + len(self.output_ids)
        log.warning("call %s: engine of %s lost; continuing on %s after %d tokens",
                    self.call_id, from_cell, to_cell, len(self.output_ids))
        self.proxy.sink.record(
            CallRedirected(
                execution_id=self.state.execution_id,
                call_id=self.call_id,
                cell_id=to_cell,
                from_cell_id=from_cell,
                to_cell_id=to_cell,
                tokens_done=len(self.output_ids),
                tokens_recomputed=recomputed,
                kv_refused=f"{LOST_REASON}: {cause}" if cause is not None else LOST_REASON,
            )
        )

    async def complete(self, reply: Message | None) -> None:
        """Record the finished call durably; `reply` is the assistant turn as the harness was shown it."""
        body = self.proxy.renderer.assistant_body(reply) if reply is not None else None
        position = self._close(body)
        if position is not None:
            await self.proxy.sink.durable(position)

    def abandon(self) -> None:
        """The harness is gone or the engine failed: abort the engine request, record what was produced.
        A no-op once the call is recorded, so front ends call it unconditionally on the way out."""
        if self._closed:
            return
        flight = self._flight
        if flight is not None:
            self.proxy._spawn(self._abort(flight))
        self._close(None)

    async def _abort(self, flight: Flight) -> None:
        try:
            await self.proxy.router.engine(flight.cell_id).abort(flight.rid)
        except EngineError as e:
            log.warning("call %s: abort of %s failed: %s", self.call_id, flight.rid, e)

    def _close(self, reply_body: str | None) -> int | None:
        if self._closed:
            return None
        self._closed = True
        self.proxy._active.pop(self.call_id, None)
        self.state.tree.finish(self.record, self.output_ids, reply_body)
        finish = self.finish.type if self.finish is not None else "abort"
        served = self.engine_version
        policy = served if served is not None else self.state.registration.policy_version
        return self.proxy.sink.record(
            ModelCallFinished(
                execution_id=self.state.execution_id,
                call_id=self.call_id,
                cell_id=self.cell_id,
                parent_call_id=self.plan.parent.call_id if self.plan.parent else None,
                branch=self.record.branch,
                prefix_len=self.plan.prefix_len,
                prompt_delta_ids=list(self.plan.delta),
                output_ids=self.output_ids,
                output_logprobs=self.logprobs,
                policy_version=policy,
                engine_version=served,
                cached_tokens=self.cached_tokens,
                latency_s=time.perf_counter() - self.started,
                finish_reason=finish,
                drift_tokens=self.plan.drift,
                attempt=self.state.registration.attempt,
            )
        )
