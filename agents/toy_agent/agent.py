#!/usr/bin/env python3
"""The bundled toy coding agent: a small black-box harness that behaves like a real one.

It talks to OPENAI_BASE_URL with OPENAI_API_KEY through the official `openai` SDK, as any third-party
harness would (``--client http``: the same requests with the standard library, no SDK import), and never
imports Gyre: Gyre sees it only as a process and a stream of model calls.

What it does, each because real harnesses do it and the trainer must cope with it:
- multi-turn tool use: write_file, read_file, run (a shell command in the workspace, with a timeout);
- context compaction every N turns: a summary call, then a fresh conversation that starts with the summary.
  The wording is Claude Code's, so the proxy's default markers classify the calls (main-summary, ...);
- a sub-agent: the `delegate` tool runs a sub-task in a conversation of its own and returns its answer;
- retries: API errors are retried with backoff; a malformed tool call gets an error result and another turn;
- a max-turns bound;
- a plain-text fallback: a reply without tool calls ends the run, and its text is written to the answer file
  unless a tool wrote that file already (`write_file`, or a `run` command such as `awk ... > answer.txt`). A
  model that cannot call tools yet (a random-init one) still leaves an answer to grade, so reinforcement learning
  has a signal from the first step.

Output: progress lines on stderr; one JSON object on stdout at the end, like `claude -p --output-format json`.
Exit status: 0 when the run ended (answer or max turns), 1 when the model stayed unreachable, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_model import ModelClient, ModelUnavailable, Refused, Reply, connect
from agent_tools import SCHEMAS, MalformedToolCall, ToolFailed, WorkspaceTools, parse_arguments

SYSTEM_PROMPT = (
    "You are a coding agent working in a directory of files. Use the tools to inspect and change files. "
    "When the task is done, reply with a short final answer and no tool call."
)
SUMMARY_REQUEST = (
    "Your task is to create a detailed summary of the conversation so far, paying close attention to the "
    "task, the files written and what remains to do. Reply with the summary only."
)
CONTINUATION = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The conversation is summarized below:\n"
)
SUB_TASK = "You are a sub-agent. Do this sub-task and reply with a short report:\n"


@dataclass
class Stats:
    """What happened, for the final JSON line (and for tests that prove each behaviour happened)."""

    turns: int = 0
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    tool_errors: int = 0
    compactions: int = 0
    subagents: int = 0
    answer_written_by: str | None = None


@dataclass(frozen=True)
class Outcome:
    stop_reason: str  # "answer" | "max_turns"
    text: str


@dataclass
class Agent:
    """One agent (the main one or a sub-agent): its own conversation, tools, turn bound and compaction."""

    name: str
    model: ModelClient
    tools: WorkspaceTools
    tool_names: tuple[str, ...]
    compact_every: int
    summary_max_tokens: int
    stats: Stats
    log: Callable[..., None]
    spawn: Callable[[str], Outcome] | None = None
    environment: Callable[[], float] | None = None
    """Time the agent's environment takes after each model reply (tools, tests): see `EnvironmentLatency`."""
    messages: list[dict[str, Any]] = field(default_factory=list)

    def run(self, task: str, max_turns: int) -> Outcome:
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
        specs = [SCHEMAS[n] for n in self.tool_names]
        since_compaction = 0
        last_text = ""
        for turn in range(1, max_turns + 1):
            if self.compact_every and since_compaction >= self.compact_every:
                self._compact(task)
                since_compaction = 0
            reply = self.model.complete(self.messages, tools=specs, agent=self.name)
            self.stats.turns += 1
            since_compaction += 1
            self.messages.append(reply.as_message())
            last_text = reply.content or last_text
            if self.environment is not None:
                waited = self.environment()
                self.log("environment", agent=self.name, turn=turn, seconds=round(waited, 3))
            self.log("turn", agent=self.name, turn=turn, tool_calls=len(reply.tool_calls),
                     finish_reason=reply.finish_reason)
            if not reply.tool_calls:
                return Outcome("answer", reply.content or "")
            self._run_tools(reply)
        self.log("max_turns", agent=self.name, turns=max_turns)
        return Outcome("max_turns", last_text)

    def _run_tools(self, reply: Reply) -> None:
        for call in reply.tool_calls:
            self.stats.tool_calls += 1
            try:
                arguments = parse_arguments(call.name, call.arguments, set(self.tool_names))
                result = self._dispatch(call.name, arguments)
            except MalformedToolCall as e:
                self.stats.malformed_tool_calls += 1
                self.log("malformed_tool_call", agent=self.name, tool=call.name, error=str(e))
                result = f"error: malformed tool call: {e}. Call the tool again with valid arguments."
            except ToolFailed as e:
                self.stats.tool_errors += 1
                result = f"error: {e}"
            self.log("tool", agent=self.name, tool=call.name, result=result[:120])
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    def _dispatch(self, name: str, arguments: dict[str, Any]) -> str:
        if name == "delegate":
            assert self.spawn is not None  # only agents that may spawn offer the tool
            outcome = self.spawn(arguments["task"])
            return f"sub-agent finished ({outcome.stop_reason}): {outcome.text}"
        return self.tools.call(name, arguments)

    def _compact(self, task: str) -> None:
        """Summarise the conversation, then continue from a fresh one that starts with the summary."""
        request = [*self.messages, {"role": "user", "content": SUMMARY_REQUEST}]
        reply = self.model.complete(request, tools=None, agent=f"{self.name}-summary",
                                    max_tokens=self.summary_max_tokens)
        summary = (reply.content or "").strip() or "(no summary)"
        self.stats.compactions += 1
        self.log("compaction", agent=self.name, summary_chars=len(summary))
        self.messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{CONTINUATION}{summary}\n\nThe task, as first given:\n{task}\n\n"
                                        "Continue from where you left off."},
        ]


@dataclass(frozen=True)
class EnvironmentLatency:
    """A heavy-tailed environment: after each model reply the agent waits ``lognormal(mu, sigma)`` seconds (the
    body: tool calls, builds), and with probability ``tail_p`` ``tail_s`` seconds instead (the mass near the
    timeout: a hung test suite). Seeded by the execution id, so a run's latencies are reproducible; while an
    agent waits its CPU is idle, which is the capacity an elastic scheduler lends to training.

    Spec: ``MU,SIGMA[,TAIL_P,TAIL_S]`` (``0.0,1.0,0.1,20``: median 1 s, one wait in ten 20 s)."""

    mu: float
    sigma: float
    tail_p: float = 0.0
    tail_s: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> EnvironmentLatency:
        try:
            values = [float(v) for v in spec.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--env-latency {spec!r}: expected MU,SIGMA[,TAIL_P,TAIL_S]") from None
        if len(values) not in (2, 4) or values[1] < 0 or (len(values) == 4 and not 0 <= values[2] <= 1):
            raise argparse.ArgumentTypeError(f"--env-latency {spec!r}: expected MU,SIGMA[,TAIL_P,TAIL_S] with "
                                             "SIGMA >= 0 and 0 <= TAIL_P <= 1")
        return cls(*values)

    def sampler(self, seed: str) -> Callable[[], float]:
        rng = random.Random(seed)

        def wait() -> float:
            seconds = self.tail_s if rng.random() < self.tail_p else rng.lognormvariate(self.mu, self.sigma)
            time.sleep(seconds)
            return seconds

        return wait


def gated(wait: Callable[[], float] | None, gate: Path) -> Callable[[], float]:
    """``wait``, then until ``gate`` exists: a test holds every execution at its next environment step by removing
    the file and lets them go by creating it again, so that a run cannot finish before something the test waits
    for has happened (an ordering by a fact, not by a sleep). Returns the seconds waited in all."""

    def wait_gated() -> float:
        started = time.monotonic()
        if wait is not None:
            wait()
        while not gate.exists():
            time.sleep(0.05)
        return time.monotonic() - started

    return wait_gated


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", help="the task (or use --task-file)")
    parser.add_argument("--task-file", type=Path, help="read the task from this file")
    parser.add_argument("--workspace", type=Path, default=Path("."))
    parser.add_argument("--answer-file", default="answer.txt", help="where the plain-text fallback writes")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gyre-policy"))
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--subagent-max-turns", type=int, default=3)
    parser.add_argument("--compact-every", type=int, default=4, help="turns between compactions (0: never)")
    parser.add_argument("--max-retries", type=int, default=3, help="retries of a failed model call")
    parser.add_argument("--retry-backoff-s", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--summary-max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--client", choices=("sdk", "http"), default="sdk",
                        help="sdk: the openai package; http: the same requests with urllib (no ~0.5 s SDK import)")
    parser.add_argument("--run-timeout-s", type=float, default=10.0, help="limit of one `run` tool call")
    parser.add_argument("--no-subagent", action="store_true", help="do not offer the delegate tool")
    parser.add_argument("--env-latency", type=EnvironmentLatency.parse, default=None,
                        help="heavy-tailed wait after each model reply: MU,SIGMA[,TAIL_P,TAIL_S] (seconds, "
                             "lognormal body; seeded by $GYRE_EXECUTION_ID)")
    parser.add_argument("--env-gate", type=Path, default=None, metavar="FILE",
                        help="after each model reply (and its --env-latency wait) also wait until FILE exists")
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.task_file is None):
        parser.error("give the task either as PROMPT or with --task-file")
    if args.max_turns < 1 or args.subagent_max_turns < 1 or args.compact_every < 0 or args.max_retries < 0:
        parser.error("--max-turns and --subagent-max-turns must be >= 1, the others >= 0")
    return args


def _stamp(path: Path) -> tuple[int, int] | None:
    """What the answer file is now (modification time, size), or None: a tool that wrote it changes this."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_mtime_ns, stat.st_size


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.monotonic()

    def log(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}, default=str), file=sys.stderr, flush=True)

    task = args.prompt if args.prompt is not None else args.task_file.read_text()
    try:
        client = connect(args.client, args.request_timeout_s)
    except Refused as e:  # no OPENAI_API_KEY
        print(f"toy-agent: {e}", file=sys.stderr)
        return 2
    model = ModelClient(client, model=args.model, max_tokens=args.max_tokens, temperature=args.temperature,
                        max_retries=args.max_retries, backoff_s=args.retry_backoff_s, log=log)
    workspace = args.workspace.resolve()
    tools = WorkspaceTools(workspace, run_timeout_s=args.run_timeout_s)
    try:
        answer = tools.resolve(args.answer_file)
    except ToolFailed as e:
        print(f"toy-agent: --answer-file: {e}", file=sys.stderr)
        return 2
    before = _stamp(answer)
    stats = Stats()
    environment = (args.env_latency.sampler(os.environ.get("GYRE_EXECUTION_ID", "") + task)
                   if args.env_latency is not None else None)
    if args.env_gate is not None:
        environment = gated(environment, args.env_gate)

    def agent(name: str, tool_names: tuple[str, ...], spawn: Callable[[str], Outcome] | None) -> Agent:
        return Agent(name, model, tools, tool_names, args.compact_every, args.summary_max_tokens or args.max_tokens,
                     stats, log, spawn, environment)

    def spawn(sub_task: str) -> Outcome:
        stats.subagents += 1
        log("subagent", task=sub_task[:120])
        return agent("sub-agent", ("write_file", "read_file", "run"), None).run(SUB_TASK + sub_task,
                                                                               args.subagent_max_turns)

    main_tools = ("write_file", "read_file", "run") + (() if args.no_subagent else ("delegate",))
    result: dict[str, Any] = {"type": "result"}
    try:
        outcome = agent("main", main_tools, spawn).run(task, args.max_turns)
    except ModelUnavailable as e:
        log("error", error=str(e))
        result |= {"is_error": True, "error": str(e)}
        outcome = None
    if outcome is not None:
        if answer in tools.written or _stamp(answer) != before:  # write_file, or a command (`run ... > answer`)
            stats.answer_written_by = "tool"
        elif outcome.stop_reason == "answer" and outcome.text.strip():
            answer.parent.mkdir(parents=True, exist_ok=True)
            answer.write_text(outcome.text, encoding="utf-8", errors="replace")
            stats.answer_written_by = "fallback"
            log("fallback", answer_file=args.answer_file, chars=len(outcome.text))
        result |= {"is_error": False, "stop_reason": outcome.stop_reason, "result": outcome.text[:2000]}
    result |= {**vars(stats), "model_calls": model.calls, "api_retries": model.retries,
               "duration_s": round(time.monotonic() - started, 3)}
    print(json.dumps(result), flush=True)
    return 1 if outcome is None else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
