"""Synthetic agent executions shaped like long-horizon coding runs (seeded, no I/O).

Each execution is a main agent working through hundreds of calls: tool results (a few very long), replies,
sub-agents (their own roots; their report comes back to the main agent as a tool result), context
compactions (a summary call that extends the context, then a new root that starts from the summary),
retries (a failed reply, then the same prompt again: recorded as siblings sharing the prompt, either
through the failed call — as a longest-prefix-matching proxy records it — or through the common parent),
policy-version bumps mid-run, time-outs (an aborted last reply, scored on the preserved workspace),
harness errors and evaluator failures. Groups of ``group_size`` executions share a task.

Token counts scale with ``max_tokens`` (the default 100K–700K tokens per execution is the brief's regime);
the structure — call counts, branching, failure rates — does not, so small test runs have the same shape.
"""

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from gyre.events.fields import BranchKind, ExecutionStatus, FinishReason
from gyre.trajectory.errors import TrajectoryConfigError

REFERENCE_MAX_TOKENS = 700_000
"""Token lengths below are for this budget; other budgets scale them."""


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """Shape of a synthetic run. Rates are per execution unless they say per call."""

    executions: int = 32
    group_size: int = 16
    seed: int = 0
    min_tokens: int = 100_000
    max_tokens: int = 700_000
    vocab_size: int = 151_936
    concurrency: int = 64
    """Executions running at once; the rest queue, so groups finish at different times."""
    timeout_rate: float = 0.10
    harness_error_rate: float = 0.02
    eval_failure_rate: float = 0.06
    retry_rate: float = 0.006
    """Per call: the reply fails and the harness asks again."""
    subagent_rate: float = 0.03
    """Per main-agent call: the main agent delegates to a sub-agent."""
    version_bump_rate: float = 0.2
    """Executions whose later calls run on the next policy version (weights updated mid-run)."""
    policy_version: int = 0
    run_id: str = "synth"

    def __post_init__(self) -> None:
        if self.executions < 1:
            raise TrajectoryConfigError(f"executions must be >= 1, got {self.executions}")
        if self.group_size < 1:
            raise TrajectoryConfigError(f"group_size must be >= 1, got {self.group_size}")
        if not 1_000 <= self.min_tokens <= self.max_tokens:
            raise TrajectoryConfigError(
                f"need 1000 <= min_tokens <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        if self.concurrency < 1:
            raise TrajectoryConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in (
            "timeout_rate",
            "harness_error_rate",
            "eval_failure_rate",
            "retry_rate",
            "subagent_rate",
            "version_bump_rate",
        ):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise TrajectoryConfigError(f"{name} must be within [0, 1], got {value}")
        if self.timeout_rate + self.harness_error_rate > 1:
            raise TrajectoryConfigError("timeout_rate + harness_error_rate must not exceed 1")

    @property
    def scale(self) -> float:
        return self.max_tokens / REFERENCE_MAX_TOKENS


@dataclass
class SynthCall:
    """One recorded model call of a synthetic execution."""

    call_id: str
    parent: int
    branch: BranchKind
    prefix_len: int
    delta: np.ndarray
    output: np.ndarray
    logprobs: np.ndarray
    version: int
    start_s: float
    latency_s: float
    finish_reason: FinishReason = "stop"

    @property
    def full_len(self) -> int:
        return self.prefix_len + len(self.delta) + len(self.output)


Evaluation = Literal["reward", "failed", "none"]


@dataclass
class SynthExecution:
    """A generated execution: its calls (times relative to its start) and how it ended."""

    execution_id: str
    task_id: str
    group_id: str
    status: ExecutionStatus
    calls: list[SynthCall] = field(default_factory=list)
    duration_s: float = 0.0
    evaluation: Evaluation = "reward"
    reward: float = 0.0
    eval_error: str = ""
    compactions: int = 0
    sub_agents: int = 0
    retries: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(c.delta) + len(c.output) for c in self.calls)


@dataclass
class _Context:
    """An agent's current conversation: the call it continues from and that call's full length."""

    branch: BranchKind
    head: int = -1
    length: int = 0
    calls: int = 0


class _Simulator:
    """Generates one execution, call by call."""

    def __init__(
        self,
        config: SynthConfig,
        rng: np.random.Generator,
        execution: SynthExecution,
        system: np.ndarray,
        task: np.ndarray,
        sub_system: np.ndarray,
        version: int,
    ) -> None:
        self.config, self.rng, self.ex = config, rng, execution
        self.system, self.task, self.sub_system = system, task, sub_system
        self.version = version
        self.clock = 0.0
        self.scale = config.scale
        self.recorded = 0
        """Tokens recorded so far (prompt deltas and outputs)."""

    # -- token material ------------------------------------------------------------------------------

    def tokens(self, mean: float, sigma: float = 0.8, low: int = 1) -> np.ndarray:
        n = max(low, int(self.rng.lognormal(np.log(max(mean * self.scale, 1.0)), sigma)))
        return self.rng.integers(0, self.config.vocab_size, n, dtype=np.int32)

    def logprobs(self, n: int) -> np.ndarray:
        return -self.rng.gamma(0.3, 0.6, n).astype(np.float32)

    def tool_result(self) -> np.ndarray:
        if self.rng.random() < 0.04:  # a long tool output: a build log, a big file, a test run
            return self.tokens(15_000, sigma=0.6, low=50)
        return self.tokens(450, sigma=1.0)

    # -- recording -----------------------------------------------------------------------------------

    def record(
        self,
        ctx: _Context,
        delta: np.ndarray,
        output: np.ndarray,
        *,
        parent: int | None = None,
        prefix_len: int | None = None,
        branch: BranchKind | None = None,
        finish: FinishReason = "stop",
    ) -> int:
        parent = ctx.head if parent is None else parent
        prefix_len = ctx.length if prefix_len is None else prefix_len
        latency = 0.4 + len(output) / self.scale / 60.0 + prefix_len / self.scale / 40_000.0
        index = len(self.ex.calls)
        self.ex.calls.append(
            SynthCall(
                call_id=f"{self.ex.execution_id}/c{index:05d}",
                parent=parent,
                branch=branch or ctx.branch,
                prefix_len=prefix_len,
                delta=delta,
                output=output,
                logprobs=self.logprobs(len(output)),
                version=self.version,
                start_s=self.clock,
                latency_s=latency,
                finish_reason=finish,
            )
        )
        self.clock += latency + float(self.rng.lognormal(0.5, 1.0))  # the tool runs before the next call
        self.recorded += len(delta) + len(output)
        return index

    def step(self, ctx: _Context, delta: np.ndarray, output: np.ndarray) -> int:
        """A call that continues ``ctx``, possibly failing first and being retried."""
        if self.rng.random() < self.config.retry_rate:
            failed = self.record(ctx, delta, self.tokens(300), finish="length")
            self.ex.retries += 1
            if self.rng.random() < 0.7:  # proxy matched the failed call's prompt: a child of it, mid-segment
                index = self.record(
                    ctx, np.zeros(0, np.int32), output, parent=failed, prefix_len=ctx.length + len(delta)
                )
            else:  # recorded under the same parent: an identical prompt delta, stored twice
                index = self.record(ctx, delta.copy(), output)
        else:
            index = self.record(ctx, delta, output)
        ctx.head, ctx.length = index, self.ex.calls[index].full_len
        ctx.calls += 1
        return index

    def compact(self, ctx: _Context, summary_branch: BranchKind, system: np.ndarray, brief: np.ndarray) -> None:
        """Summarise the context (a call that extends it), then start a new root from the summary."""
        instruction = self.tokens(350, sigma=0.2)
        summary = self.tokens(3_000, sigma=0.4, low=8)
        self.record(ctx, instruction, summary, branch=summary_branch)
        ctx.head, ctx.length = -1, 0
        self.step(ctx, np.concatenate([system, brief, summary, self.tokens(120, sigma=0.3)]), self.reply())
        if summary_branch == "main-summary":
            self.ex.compactions += 1

    def reply(self) -> np.ndarray:
        return self.tokens(700 if self.rng.random() < 0.15 else 200, sigma=0.9)  # some replies think at length

    # -- agents --------------------------------------------------------------------------------------

    def sub_agent(self, assignment: np.ndarray) -> np.ndarray:
        """Run a sub-agent to completion; its final reply is its report."""
        self.ex.sub_agents += 1
        ctx = _Context("sub-agent")
        brief = np.concatenate([assignment, self.tokens(200)])
        self.step(ctx, np.concatenate([self.sub_system, brief]), self.reply())
        limit = 60_000 * self.scale
        for _ in range(int(self.rng.integers(4, 60))):
            delta = self.tool_result()
            if ctx.length + len(delta) > limit:
                self.compact(ctx, "sub-agent-summary", self.sub_system, brief)
            self.step(ctx, delta, self.reply())
        report = self.tokens(900, sigma=0.5)
        self.step(ctx, self.tokens(150), report)
        return report

    def run(self, target_tokens: int, stop_tokens: int) -> None:
        """The main agent works until it reaches its target (or ``stop_tokens``, when it is cut short)."""
        ctx = _Context("main")
        self.step(ctx, np.concatenate([self.system, self.task]), self.reply())
        limit = float(self.rng.uniform(110_000, 170_000)) * self.scale
        bump_at = (
            self.rng.uniform(0.3, 0.9) * target_tokens if self.rng.random() < self.config.version_bump_rate else None
        )
        while (done := self.recorded) < min(target_tokens, stop_tokens):
            if bump_at is not None and done >= bump_at:
                self.version, bump_at = self.version + 1, None
            if done < 0.9 * target_tokens and self.rng.random() < self.config.subagent_rate:
                output = self.reply()
                self.step(ctx, self.tool_result(), output)
                delta = np.concatenate([self.tokens(40, sigma=0.2), self.sub_agent(output[: max(1, len(output) // 2)])])
            else:
                delta = self.tool_result()
            if ctx.length + len(delta) > limit:
                self.compact(ctx, "main-summary", self.system, self.task)
            self.step(ctx, delta, self.reply())
        if stop_tokens < target_tokens:  # cut short: the last reply was aborted mid-stream
            last = self.ex.calls[-1]
            last.output = last.output[: max(1, len(last.output) // 3)]
            last.logprobs = last.logprobs[: len(last.output)]
            last.finish_reason = "abort"
        else:
            self.step(ctx, self.tool_result(), self.tokens(400))
        self.ex.duration_s = self.clock


def generate(config: SynthConfig) -> list[SynthExecution]:
    """All executions of a synthetic run, deterministic in ``config`` (including its seed)."""
    rng = np.random.default_rng(config.seed)
    scale = config.scale
    system = rng.integers(0, config.vocab_size, max(8, int(6_000 * scale)), dtype=np.int32)
    sub_system = rng.integers(0, config.vocab_size, max(8, int(2_500 * scale)), dtype=np.int32)
    executions = []
    groups = -(-config.executions // config.group_size)
    for g in range(groups):
        task = rng.integers(0, config.vocab_size, max(4, int(rng.uniform(1_500, 6_000) * scale)), dtype=np.int32)
        difficulty = float(rng.beta(1.2, 1.2))
        tests = int(rng.integers(20, 200))
        for k in range(min(config.group_size, config.executions - g * config.group_size)):
            number = g * config.group_size + k
            executions.append(
                _execution(
                    config,
                    np.random.default_rng([config.seed, number]),
                    number,
                    g,
                    system,
                    task,
                    sub_system,
                    difficulty,
                    tests,
                )
            )
    return executions


def _execution(
    config: SynthConfig,
    rng: np.random.Generator,
    number: int,
    group: int,
    system: np.ndarray,
    task: np.ndarray,
    sub_system: np.ndarray,
    difficulty: float,
    tests: int,
) -> SynthExecution:
    fate = rng.random()
    status: ExecutionStatus = "completed"
    if fate < config.timeout_rate:
        status = "timed_out"
    elif fate < config.timeout_rate + config.harness_error_rate:
        status = "harness_error"
    execution = SynthExecution(
        execution_id=f"exec-{number:05d}", task_id=f"task-{group:04d}", group_id=f"group-{group:04d}", status=status
    )
    target = int(rng.uniform(config.min_tokens, 0.95 * config.max_tokens))
    stop = target
    if status == "timed_out":
        stop = max(config.min_tokens, int(target * rng.uniform(0.7, 0.95)))
    elif status == "harness_error":
        stop = int(target * rng.uniform(0.1, 0.8))
    _Simulator(config, rng, execution, system, task, sub_system, config.policy_version).run(target, stop)
    if status == "harness_error":
        execution.evaluation = "none"
    elif rng.random() < config.eval_failure_rate:
        execution.evaluation = "failed"
        execution.eval_error = str(rng.choice(["crash", "timeout", "infrastructure"]))
    else:
        p = difficulty * (0.6 if status == "timed_out" else 1.0)
        execution.reward = float(rng.binomial(tests, p)) / tests
    return execution
