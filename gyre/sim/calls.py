"""Per-call workloads: one execution as the model calls a harness makes, for the simulator and a scenario
harness alike.

``workload.py`` samples an execution's duration on a full cell (D), its trajectory tokens (T), a call count
and a status. ``plan_calls`` splits it into calls; each call has a tool/environment wait before it, a prompt
delta (tokens appended to the context: the task for the first call, tool outputs after), output tokens,
and a compaction flag (the call starts a new root whose prompt is a summary: the context resets). The split
keeps the aggregate:

- time: a share ``decode.share`` of D is model time, i.e. the prefill of the prompt deltas
  (``calls.prefill_s_per_mtoken``) plus the output tokens at the reference decode speed (``token_ms``: one
  iteration of a full cell of which a share ``decode.share`` of the requests are decoding); the rest is
  waits. At the reference speed an execution's calls add up to D;
- tokens: prompt deltas and outputs add up to T (compactions add their summaries);
- calls: the aggregate's count, or D / ``calls.s_per_call``;
- status: a timed-out run ends in a *stall*, a last call whose wait is the whole timeout (a hung tool), so
  it times out whatever the load; a crashed run (harness_error) exits after its calls.

Pure and seeded (the workload seed, the step and the execution id): the same plan for the same execution,
whoever asks. ``CallPlan.to_json`` is the plain description a scenario harness runs
(``agents/scenario_agent``), and ``CallPlan.from_json`` reads it back, so a live run and ``gyre sim`` face
the same executions. ``python -m gyre.sim.describe SCENARIO --steps N --out FILE`` writes a workload's.
"""

import re
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre.sim.scenario import Scenario
from gyre.sim.workload import ExecutionSpec, Workload

FORMAT = "gyre-workload/1"
SET_FORMAT = "gyre-workload-set/1"
_INDICES = re.compile(r"s0*(\d+)-g0*(\d+)-[re]0*(\d+)$")
"""Step, group and rollout in an execution id: the simulator's ``s000-g001-r02``, a live run's ``….s0-g1-e2``."""


@dataclass(frozen=True, slots=True)
class Call:
    wait_s: float
    """Tool and environment time before the call is sent (after the previous call's reply)."""
    prompt_delta_tokens: int
    """Tokens the call's prompt adds to the context (with ``compaction``: the new root's whole prompt)."""
    output_tokens: int
    compaction: bool = False
    stall: bool = False
    """The wait never ends before the timeout (a hung tool): the run times out in it."""


@dataclass(frozen=True)
class CallPlan:
    execution_id: str
    task_id: str
    group_id: str
    step: int
    group: int | None
    rollout: int | None
    status: str
    """As sampled: completed | timed_out (it ends in a stall) | harness_error (``crash``)."""
    timeout_s: float
    crash: bool
    calls: tuple[Call, ...]
    contexts: tuple[int, ...] = field(default=(), init=False, compare=False)
    """Per call: tokens in the context once its output is generated (what its KV holds)."""

    def __post_init__(self) -> None:
        context, out = 0, []
        for call in self.calls:
            context = (0 if call.compaction else context) + call.prompt_delta_tokens + call.output_tokens
            out.append(context)
        object.__setattr__(self, "contexts", tuple(out))

    def prompt_tokens(self, i: int) -> int:
        return self.contexts[i] - self.calls[i].output_tokens

    def to_json(self, *, time_scale: float = 1.0, token_scale: float = 1.0,
                chars_per_token: float = 1.0) -> dict[str, Any]:
        """The plain description a scenario harness runs. It sleeps ``wait_s / time_scale``, sends
        ``prompt_delta_tokens / token_scale`` tokens of filler (``chars_per_token`` characters each: 1 for a
        byte-level tokenizer) and asks for ``output_tokens / token_scale`` tokens (at least 1)."""
        if time_scale <= 0 or token_scale <= 0 or chars_per_token <= 0:
            raise ValueError("time_scale, token_scale and chars_per_token must be positive")
        return {
            "format": FORMAT, "execution_id": self.execution_id, "task_id": self.task_id,
            "group_id": self.group_id, "step": self.step, "group": self.group, "rollout": self.rollout,
            "status": self.status, "timeout_s": self.timeout_s, "crash": self.crash,
            "time_scale": time_scale, "token_scale": token_scale, "chars_per_token": chars_per_token,
            "calls": [{"wait_s": c.wait_s, "prompt_delta_tokens": c.prompt_delta_tokens,
                       "output_tokens": c.output_tokens, "compaction": c.compaction, "stall": c.stall}
                      for c in self.calls],
            "totals": {"calls": len(self.calls), "wait_s": round(sum(c.wait_s for c in self.calls), 3),
                       "prompt_delta_tokens": sum(c.prompt_delta_tokens for c in self.calls),
                       "output_tokens": sum(c.output_tokens for c in self.calls),
                       "compactions": sum(c.compaction for c in self.calls)},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CallPlan":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} description (format {data.get('format')!r})")
        calls = tuple(Call(float(c["wait_s"]), int(c["prompt_delta_tokens"]), int(c["output_tokens"]),
                           bool(c.get("compaction", False)), bool(c.get("stall", False))) for c in data["calls"])
        return cls(data["execution_id"], data["task_id"], data["group_id"], int(data["step"]), data.get("group"),
                   data.get("rollout"), data["status"], float(data["timeout_s"]), bool(data["crash"]), calls)


class CallTiming:
    """What a call costs on a cell: prefill per prompt token, decode per output token.

    ``token_ms`` is the reference decode iteration: a full cell of which a share ``decode.share`` of the
    requests decode at once (the others wait on tools), each holding ``reference_context_tokens``. The
    simulator's per-call clock runs at ``token_ms / t(n, C)`` for the ``n`` requests decoding on a cell
    with ``C`` tokens of context among them.
    """

    def __init__(self, scenario: Scenario) -> None:
        d, slots = scenario.decode, scenario.cluster.slots_per_cell
        self.spec = d
        n = max(1, round(d.share * slots))
        self.token_ms = self.step_ms(n, n * d.reference_context_tokens)
        calls = scenario.calls
        per_mtoken = calls.prefill_s_per_mtoken
        self.prefill_s_per_token = (scenario.rollout.resume_s_per_mtoken if per_mtoken is None else per_mtoken) / 1e6

    def step_ms(self, requests: int, context_tokens: int) -> float:
        d = self.spec
        return d.step_ms + requests * d.per_request_ms + context_tokens / 1e6 * d.per_mtoken_ms

    def prefill_s(self, call: Call) -> float:
        return call.prompt_delta_tokens * self.prefill_s_per_token

    def reference_s(self, plan: CallPlan) -> float:
        """The plan's time at the reference decode speed, stall included."""
        return sum(c.wait_s + self.prefill_s(c) + c.output_tokens * self.token_ms / 1e3 for c in plan.calls)

    def alone_s(self, plan: CallPlan) -> float:
        """The plan's time alone on a cell (no other request, no timeout): waits, prefill and each call's
        output at one request's speed with that call's context."""
        return sum(c.wait_s + self.prefill_s(c) + c.output_tokens * self.step_ms(1, ctx) / 1e3
                   for c, ctx in zip(plan.calls, plan.contexts, strict=True))

    def fastest_s(self, plan: CallPlan) -> float:
        """No load makes the plan faster than this: decode at one request with no context, or the timeout."""
        fastest = sum(c.wait_s + self.prefill_s(c) + c.output_tokens * self.step_ms(1, 0) / 1e3 for c in plan.calls)
        return min(plan.timeout_s, fastest)


def plan_calls(scenario: Scenario, spec: ExecutionSpec, seed: int, timing: CallTiming | None = None) -> CallPlan:
    """The execution's calls (module docstring): pure in (scenario, spec, seed)."""
    c, share = scenario.calls, scenario.decode.share
    if not share:
        raise ValueError(f"scenario {scenario.name!r} has no decode curve (decode.share = 0): a call's output "
                         "tokens are its share of the execution's time at the curve's speed")
    timing = timing or CallTiming(scenario)
    rng = np.random.default_rng([seed, spec.step, zlib.crc32(spec.execution_id.encode())])
    duration, tokens = spec.duration_s, spec.tokens
    n = spec.calls if c.s_per_call is None else int(np.clip(round(duration / c.s_per_call), 1, c.max_calls))
    p, tok = timing.prefill_s_per_token, timing.token_ms / 1e3
    # model time share * D = prefill of the prompt deltas (T - o) + o tokens of decode
    o = round((share * duration - tokens * p) / (tok - p)) if tok > p else n
    o = int(min(max(o, n), max(n, tokens)))
    delta_total = max(0, tokens - o)
    wait_total = max(0.0, duration - delta_total * p - o * tok)
    waits = _split_float(wait_total, _weights(rng, n, c.call_sigma))
    deltas = _split_int(delta_total, _weights(rng, n, c.call_sigma))
    outs = [1 + x for x in _split_int(o - n, _weights(rng, n, c.call_sigma))]
    timeout = scenario.rollout.timeout_s
    raw = [(round(waits[i], 3), deltas[i], outs[i], False) for i in range(n)]
    if spec.status == "timed_out":
        raw.append((timeout, 0, 1, True))
    calls, context = [], 0
    for i, (wait, delta, out, stall) in enumerate(raw):
        compaction = False
        if c.compact_at_tokens is not None and i > 0 and context + delta + out > c.compact_at_tokens:
            delta, compaction, context = c.summary_tokens + delta, True, 0
        context += delta + out
        calls.append(Call(wait, delta, out, compaction, stall))
    match = _INDICES.search(spec.execution_id)
    group, rollout = (int(match[2]), int(match[3])) if match else (None, None)
    return CallPlan(spec.execution_id, spec.task_id, spec.group_id, spec.step, group, rollout, spec.status,
                    timeout, spec.status == "harness_error", tuple(calls))


def describe_workload(scenario: Scenario, workload: Workload, seed: int, **scales: float) -> dict[str, Any]:
    """Every execution's description (``CallPlan.to_json``), in queue order: the file a scenario harness
    reads (``--workload FILE --execution-id ID``)."""
    timing = CallTiming(scenario)
    return {"format": SET_FORMAT, "scenario": scenario.name, "seed": seed, "steps": workload.steps,
            "executions": [plan_calls(scenario, e, seed, timing).to_json(**scales) for e in workload.executions()]}


def _weights(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    return rng.lognormal(0.0, sigma, n) if sigma else np.ones(n)


def _split_int(total: int, weights: np.ndarray) -> list[int]:
    """``total`` split in proportion to ``weights``, rounded so the parts add up to it exactly."""
    exact = total * weights / weights.sum()
    parts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - parts), kind="stable")[: total - int(parts.sum())]:
        parts[i] += 1
    return [int(x) for x in parts]


def _split_float(total: float, weights: np.ndarray) -> list[float]:
    return [float(x) for x in total * weights / weights.sum()]
