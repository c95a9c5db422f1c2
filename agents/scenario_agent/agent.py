#!/usr/bin/env python3
"""The scenario agent: a black-box harness that replays one execution of a per-call workload description.

It knows nothing of Gyre: it reads a JSON description (format ``gyre-workload/1``, one execution's calls;
or ``gyre-workload-set/1``, a list of them), and makes exactly the described model calls against the
OpenAI Chat Completions API at ``$OPENAI_BASE_URL`` with ``$OPENAI_API_KEY``, over plain HTTP/1.1 on one kept-alive
connection (stdlib only, ``socket``: its start-up is part of what it emulates).

For each call, in order:
1. it sleeps the call's tool/environment wait, ``wait_s / time_scale``, counted from when the model finished the
   previous reply (a Gyre proxy's ``gyre-generated-at``; else when the reply arrived), or for the first call
   from ``--started-at`` (when the runner began the execution). The host's time is not the emulated cluster's,
   and ``time_scale`` would multiply it: the agent's own start-up (sandbox, interpreter), a reply's way back
   (durability, rendering, HTTP) and a request's way to the model (relays, a busy proxy: ``gyre-started-at``
   minus when it was sent, summed as ``lag_s``; on two cores a first wave of 64 executions waited 0.5 s median
   there) are part of the wait after them. What a wait cannot hold is a debt that later waits are shortened to
   make up; what is still owed at the end is reported as ``late_s``. A stall's wait is the whole timeout,
   never shortened: the harness runner's timeout, set to ``timeout_s / time_scale``, ends the run in it;
2. it appends the call's prompt growth to the conversation as filler text of about
   ``prompt_delta_tokens / token_scale`` tokens (``chars_per_token`` characters each; 1 for a byte-level
   tokenizer): the first call's as the task, the others' as a tool output after the previous reply. A
   ``compaction`` call starts a fresh conversation instead (system prompt + a summary of that size): a new
   root of the trajectory tree. A root's size holds its system prompt (a one-call execution at
   ``token_scale`` 50 otherwise sent 208 real tokens for a plan of 112);
3. it asks for ``max_tokens`` so that its outputs so far add up to the plan's outputs so far over
   ``token_scale`` (at least 1 a call), and keeps the reply, verbatim, as the assistant message the next call
   extends.
The real counts follow the plan's, not just each call's own: where the reply reports ``usage``, a tool
output's filler is sized so that the next prompt holds the plan's context over ``token_scale`` real tokens,
the chat template's tokens (roles, headers) and any shortfall of earlier calls included. Sized per call
instead, a tool output of 20 real tokens gains ~30 of template, and each ``ceil`` a fraction of a token: live
runs at ``token_scale`` 100 forwarded +33% prompt and +10% output tokens over their plan.
Then it writes the last reply to the answer file and exits 0; a description with ``crash`` exits 3 after its
calls, without an answer (a harness error). Which execution: ``--execution-id`` (or ``$GYRE_EXECUTION_ID``)
matched exactly, else by the step, group and rollout numbers at its end (``s0-g1-e2``, ``s000-g001-r02``).

Output: progress lines on stderr; one JSON object on stdout at the end. Exit status: 0 done, 1 model
unreachable (after retries), 2 bad usage or description, 3 the described crash.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from typing import Any

FORMAT = "gyre-workload/1"
SET_FORMAT = "gyre-workload-set/1"
SYSTEM_PROMPT = "You are a coding agent. Read the tool outputs and continue the task."
CONTINUATION = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The conversation is summarized below:\n"
)
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
         "xray", "yankee", "zulu")
_INDICES = re.compile(r"s0*(\d+)-g0*(\d+)-[re]0*(\d+)$")
GENERATED_AT = "gyre-generated-at"
"""A Gyre proxy's answer header: when the model finished the reply (Unix seconds); other servers omit it."""
STARTED_AT = "gyre-started-at"
"""A Gyre proxy's answer header: when it opened the call, the request parsed (Unix seconds)."""


def _unix_seconds(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


class UsageError(Exception):
    """The description or the arguments are wrong (exit 2)."""


class ModelUnavailable(Exception):
    """The model could not be reached after every retry, or refused the request (exit 1)."""


def filler(chars: int, seed: int) -> str:
    """About ``chars`` characters of word-like text, different for every ``seed``."""
    if chars <= 0:
        return ""
    out, i, size = [], seed, 0
    while size < chars:
        word = WORDS[i % len(WORDS)]
        out.append(word)
        size += len(word) + 1
        i = i * 7 + 3
    return " ".join(out)[:chars]


def select(document: dict[str, Any], execution_id: str | None) -> dict[str, Any]:
    """The execution's description from a single description or a set of them."""
    if document.get("format") == FORMAT:
        return document
    if document.get("format") != SET_FORMAT:
        raise UsageError(f"not a workload description (format {document.get('format')!r}; expected {FORMAT!r} "
                         f"or {SET_FORMAT!r})")
    executions = document.get("executions") or []
    if not execution_id:
        if len(executions) == 1:
            return executions[0]
        raise UsageError(f"the workload holds {len(executions)} executions: give --execution-id")
    for description in executions:
        if description.get("execution_id") == execution_id:
            return description
    match = _INDICES.search(execution_id)
    if match:
        key = tuple(int(x) for x in match.groups())
        for description in executions:
            if (description.get("step"), description.get("group"), description.get("rollout")) == key:
                return description
    raise UsageError(f"no execution {execution_id!r} in the workload (matched by id, then by step, group and "
                     "rollout numbers)")


class HttpError(Exception):
    """An HTTP answer other than 200."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class Connection:
    """HTTP/1.1 POSTs over one kept-alive socket (plain ``http://`` only): the agent's start-up is emulation
    overhead that ``time_scale`` multiplies, and ``urllib.request`` alone costs ~45 ms of CPU to import (with
    ``http.client``, ``email`` and ``ssl``) against ~1 ms for ``socket``."""

    def __init__(self, url: str, timeout_s: float) -> None:
        match = re.match(r"http://([^/:]+)(?::(\d+))?(/.*)?$", url)
        if match is None:
            raise UsageError(f"only http:// base URLs are supported, got {url!r}")
        self.host, self.port, self.path = match[1], int(match[2] or 80), match[3] or "/"
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buffer = b""

    def post(self, headers: dict[str, str], body: bytes) -> tuple[bytes, dict[str, str]]:
        """The 200 answer's body and headers (names in lower case); `HttpError` for another status, `OSError`
        when the connection fails (a kept-alive socket the server closed is retried once on a fresh one)."""
        for fresh in (self._sock is None, True):
            if fresh:
                self.close()
                self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            request = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{head}"
                       f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            try:
                assert self._sock is not None
                self._sock.sendall(request)
                status, reply, fields = self._read()
            except ConnectionError:
                answered = bool(self._buffer)
                self.close()
                if fresh or answered:
                    raise
                continue  # the server had closed the kept-alive connection: once more on a new one
            except OSError:  # a timeout: never sent again here (the caller's retries decide)
                self.close()
                raise
            if fields.get("connection", "").lower() == "close":
                self.close()
            if status != 200:
                raise HttpError(status, reply)
            return reply, fields
        raise ConnectionError("unreachable")

    def _read(self) -> tuple[int, bytes, dict[str, str]]:
        while b"\r\n\r\n" not in self._buffer:
            self._fill()
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            raise ConnectionError(f"not an HTTP answer: {lines[0][:80]!r}") from None
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if fields.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                while b"\r\n" not in self._buffer:
                    self._fill()
                size_line, self._buffer = self._buffer.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                while len(self._buffer) < size + 2:
                    self._fill()
                body, self._buffer = body + self._buffer[:size], self._buffer[size + 2:]
                if size == 0:
                    return status, body, fields
        if "content-length" in fields:
            size = int(fields["content-length"])
            while len(self._buffer) < size:
                self._fill()
            body, self._buffer = self._buffer[:size], self._buffer[size:]
            return status, body, fields
        while self._fill(eof_ok=True):  # neither: the body ends with the connection
            pass
        body, self._buffer = self._buffer, b""
        return status, body, {**fields, "connection": "close"}

    def _fill(self, eof_ok: bool = False) -> bool:
        assert self._sock is not None
        data = self._sock.recv(65536)
        if not data:
            if eof_ok:
                return False
            raise ConnectionError("the server closed the connection mid-answer")
        self._buffer += data
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buffer = None, b""


class Client:
    """Chat Completions over plain HTTP, with the agent's own retries (connection errors, 429, 5xx)."""

    def __init__(self, base_url: str, api_key: str, model: str, *, max_retries: int, backoff_s: float,
                 timeout_s: float, ignore_eos: bool, log: Any) -> None:
        self.connection = Connection(base_url.rstrip("/") + "/chat/completions", timeout_s)
        self.api_key, self.model = api_key, model
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.ignore_eos, self.log = ignore_eos, log
        self.retries = 0

    def complete(self, messages: list[dict[str, Any]], max_tokens: int
                 ) -> tuple[dict[str, Any], float | None, float | None]:
        """The reply and, where the proxy says them, when it opened the call (``gyre-started-at``) and when the
        model finished it (``gyre-generated-at``)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        if self.ignore_eos:
            body["ignore_eos"] = True  # SGLang's and vLLM's extension: decode exactly max_tokens
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"}
        attempt = 0
        while True:
            try:
                raw, fields = self.connection.post(headers, data)
                reply = json.loads(raw)
                if not reply.get("choices"):
                    raise ModelUnavailable("the reply has no choices")
                return reply, _unix_seconds(fields.get(STARTED_AT)), _unix_seconds(fields.get(GENERATED_AT))
            except HttpError as e:
                if e.status != 429 and e.status < 500:
                    raise ModelUnavailable(str(e)) from e
                error: Exception = e
            except (OSError, ModelUnavailable, ValueError) as e:  # connection, timeout, bad JSON
                error = e
            if attempt >= self.max_retries:
                raise ModelUnavailable(f"model call failed after {attempt + 1} attempts: {error}") from error
            delay = self.backoff_s * 2**attempt
            attempt += 1
            self.retries += 1
            self.log("retry", attempt=attempt, delay_s=delay, error=str(error)[:200])
            time.sleep(delay)


def run(description: dict[str, Any], client: Client, log: Any, started_at: float | None = None) -> dict[str, Any]:
    """Make the described calls; return what happened (for the report). ``started_at``: when the execution
    began (Unix seconds; default now), which the first call's wait counts from."""
    time_scale = float(description.get("time_scale", 1.0))
    token_scale = float(description.get("token_scale", 1.0))
    chars_per_token = float(description.get("chars_per_token", 1.0))
    if time_scale <= 0 or token_scale <= 0 or chars_per_token <= 0:
        raise UsageError("time_scale, token_scale and chars_per_token must be positive")
    system = {"role": "system", "content": SYSTEM_PROMPT}
    messages: list[dict[str, Any]] = [system]
    made: list[dict[str, Any]] = []
    waited, lag, last = 0.0, 0.0, ""
    debt = 0.0  # how far the host has put the agent behind the plan: later waits are shortened to make it up
    anchor = time.time() if started_at is None else started_at  # what the next wait counts from
    plan_context = plan_out = real_out = 0  # the plan's context after the previous call, outputs so far; real outputs
    previous: tuple[int, int] | None = None  # the previous call's real (prompt, completion) tokens, from usage
    overhead = 0.0  # real tokens a tool output adds beyond its filler (template, header): the last turn's
    for i, call in enumerate(description["calls"]):
        wait = float(call["wait_s"]) / time_scale
        if call.get("stall"):  # a hung tool, slept whole: the runner's timeout ends the run in it
            time.sleep(max(0.0, wait - (time.time() - anchor)))
            waited += wait
            log("stall", call=i, waited_s=round(wait, 3))
            break
        slack = wait - (time.time() - anchor)  # the wait less what passed since the anchor (start-up, a reply)
        slept = max(0.0, slack - debt)
        debt = max(0.0, debt - slack)
        time.sleep(slept)
        waited += wait
        delta, root = int(call["prompt_delta_tokens"]), bool(call.get("compaction")) or i == 0
        plan_prompt = (0 if call.get("compaction") else plan_context) + delta
        chars, body = round(delta / token_scale * chars_per_token), 0
        if root:  # the plan's first prompt holds everything sent: the system prompt comes out of its filler
            chars -= len(SYSTEM_PROMPT)
        if call.get("compaction"):
            messages = [system, {"role": "user", "content": CONTINUATION + filler(chars - len(CONTINUATION), i)}]
        elif i == 0:
            messages.append({"role": "user", "content": filler(chars, i)})
        else:
            header = f"Tool output {i}:\n"
            body = chars - len(header)
            if previous is not None:  # the real prompt so far, the reply, the header and template: filler is the rest
                need = plan_prompt / token_scale - sum(previous) - overhead
                body = max(0, round(need * chars_per_token))
            chars = len(header) + body
            messages.append({"role": "user", "content": header + filler(body, i)})
        plan_out += int(call["output_tokens"])
        max_tokens = max(1, round(plan_out / token_scale) - real_out)
        sent = time.time()
        reply, opened, generated = client.complete(messages, max_tokens)
        received = time.time()
        # the next wait counts from when the model finished: the reply's way back (durability, rendering,
        # HTTP) is the host's, which time_scale would multiply; a clock ahead of ours counts from receipt.
        # The request's way there (relays, a busy proxy) is the host's too: the call began when it was sent.
        anchor = received if generated is None else min(received, max(sent, generated))
        forward = 0.0 if opened is None else min(max(0.0, opened - sent), max(0.0, anchor - sent))
        debt += forward
        lag += forward
        message = reply["choices"][0].get("message") or {}
        last = message.get("content") or ""
        messages.append({"role": "assistant", "content": last})
        usage = reply.get("usage") or {}
        completion = usage.get("completion_tokens")
        got = max_tokens if completion is None else int(completion)
        real_out += got
        prompt = usage.get("prompt_tokens")
        if prompt:  # an engine that reports no prompt count leaves the sizing to the plan alone
            if not root and previous is not None:
                overhead = int(prompt) - sum(previous) - body / chars_per_token
            previous = (int(prompt), got)
        plan_context = plan_prompt + int(call["output_tokens"])
        made.append({"max_tokens": max_tokens, "prompt_chars": chars, "compaction": bool(call.get("compaction")),
                     "prompt_tokens": prompt, "completion_tokens": completion})
        log("call", call=i, max_tokens=max_tokens, prompt_chars=chars, prompt_tokens=prompt, waited_s=round(wait, 3),
            finish_reason=reply["choices"][0].get("finish_reason"), sent=round(sent, 4),
            received=round(received, 4), anchor=round(anchor, 4), slept_s=round(slept, 4), lag_s=round(forward, 4))
    return {"calls": made, "waited_s": round(waited, 3), "late_s": round(debt, 3), "lag_s": round(lag, 3),
            "answer": last}


OPTIONS: dict[str, tuple[Any, str]] = {
    "workload": (str, "the description (or set of them), JSON (required)"),
    "execution-id": (str, "which execution of a set (default: $GYRE_EXECUTION_ID)"),
    "answer-file": (str, "where the last reply is written (default: answer.txt)"),
    "started-at": (float, "when the execution began, Unix seconds (the runner's {started_at}; default: now)"),
    "model": (str, "the model name sent (default: $OPENAI_MODEL or gyre-policy)"),
    "max-retries": (int, "retries of a failed call (default: 3)"),
    "retry-backoff-s": (float, "first retry's delay, doubled each time (default: 0.5)"),
    "request-timeout-s": (float, "one call's timeout (default: 600)"),
    "ignore-eos": (bool, "ask the engine to decode exactly max_tokens"),
}
"""The command line, parsed by hand: ``argparse`` (with ``gettext``) and ``pathlib`` cost more start-up than the
rest of the agent, and an emulated run's ``time_scale`` multiplies a harness's start-up."""


class Args:
    def __init__(self, values: dict[str, Any]) -> None:
        self.workload: str = values["workload"]
        self.execution_id: str | None = values.get("execution-id", os.environ.get("GYRE_EXECUTION_ID"))
        self.answer_file: str = values.get("answer-file", "answer.txt")
        self.started_at: float | None = values.get("started-at")
        self.model: str = values.get("model", os.environ.get("OPENAI_MODEL", "gyre-policy"))
        self.max_retries: int = values.get("max-retries", 3)
        self.retry_backoff_s: float = values.get("retry-backoff-s", 0.5)
        self.request_timeout_s: float = values.get("request-timeout-s", 600.0)
        self.ignore_eos: bool = values.get("ignore-eos", False)


def usage() -> str:
    lines = [__doc__.splitlines()[0], "", "options:"]
    lines += [f"  --{name}{'' if kind is bool else ' VALUE'}  {text}" for name, (kind, text) in OPTIONS.items()]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> Args:
    """``--name VALUE``, ``--name=VALUE`` and the ``--ignore-eos`` flag; `UsageError` names what is wrong."""
    values: dict[str, Any] = {}
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in ("-h", "--help"):
            print(usage())
            raise SystemExit(0)
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in OPTIONS:
            raise UsageError(f"unknown argument {arg!r} (options: {', '.join('--' + n for n in OPTIONS)})")
        kind = OPTIONS[name][0]
        if kind is bool:
            if eq:
                raise UsageError(f"--{name} takes no value")
            values[name] = True
            continue
        if not eq:
            if not rest:
                raise UsageError(f"--{name} needs a value")
            value = rest.pop(0)
        try:
            values[name] = kind(value)
        except ValueError:
            raise UsageError(f"--{name}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if "workload" not in values:
        raise UsageError("--workload is required")
    return Args(values)


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"scenario-agent: {e}\n\n{usage()}", file=sys.stderr)
        return 2
    started = time.monotonic()
    print(json.dumps({"event": "started", "t": round(time.time(), 4)}), file=sys.stderr, flush=True)

    def log(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}, default=str), file=sys.stderr, flush=True)

    api_key, base_url = os.environ.get("OPENAI_API_KEY"), os.environ.get("OPENAI_BASE_URL")
    try:
        if not api_key or not base_url:
            raise UsageError("OPENAI_BASE_URL and OPENAI_API_KEY must be set")
        with open(args.workload, encoding="utf-8") as f:
            description = select(json.load(f), args.execution_id)
        client = Client(base_url, api_key, args.model, max_retries=args.max_retries, backoff_s=args.retry_backoff_s,
                        timeout_s=args.request_timeout_s, ignore_eos=args.ignore_eos, log=log)
        outcome = run(description, client, log, args.started_at)
    except (UsageError, OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        print(f"scenario-agent: {e}", file=sys.stderr)
        return 2
    except ModelUnavailable as e:
        log("error", error=str(e))
        print(json.dumps({"type": "result", "is_error": True, "error": str(e)}), flush=True)
        return 1
    crash = bool(description.get("crash"))
    if not crash:
        os.makedirs(os.path.dirname(os.path.abspath(args.answer_file)), exist_ok=True)
        with open(args.answer_file, "w", encoding="utf-8", errors="replace") as f:
            f.write(outcome["answer"] or "done")
    print(json.dumps({"type": "result", "is_error": crash, "execution_id": description.get("execution_id"),
                      "model_calls": len(outcome["calls"]), "api_retries": client.retries,
                      "max_tokens": [c["max_tokens"] for c in outcome["calls"]],
                      "completion_tokens": sum(c["completion_tokens"] or 0 for c in outcome["calls"]),
                      "compactions": sum(c["compaction"] for c in outcome["calls"]),
                      "waited_s": outcome["waited_s"], "late_s": outcome["late_s"], "lag_s": outcome["lag_s"],
                      "duration_s": round(time.monotonic() - started, 3)}),
          flush=True)
    if crash:
        log("crash", message="the description says this run crashes (harness_error)")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
