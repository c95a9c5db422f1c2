"""The scenario agent against a tiny fake OpenAI server: it makes exactly the described calls (max_tokens,
prompt growth, compaction roots, waits), picks its execution out of a set, retries, crashes when told, and
imports nothing of Gyre."""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gyre.harness import HarnessConfig
from gyre.sim.calls import CallPlan, describe_workload, plan_calls
from gyre.sim.scenario import load_scenario, with_values
from gyre.sim.workload import Workload, sample_workload

REPO = Path(__file__).resolve().parents[2]
AGENT_DIR = REPO / "agents" / "scenario_agent"
KEY = "exec-token-scenario"


class FakeOpenAI:
    """Chat Completions on a local port: records every request; the first ``fail`` answer 500."""

    def __init__(self, fail: int = 0, template_tokens: int | None = None,
                 generated_ago_s: float | None = None, opened_after_s: float | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.generated_ago_s = generated_ago_s
        """With it, replies carry a Gyre proxy's ``gyre-generated-at``: the model finished this long before
        the reply left (the reply's way back took that long); the values sent are in ``generated``."""
        self.generated: list[float] = []
        self.opened_after_s = opened_after_s
        """With it, replies carry a Gyre proxy's ``gyre-started-at``, this long after the request arrived (as a
        busy proxy opens a call late), and ``gyre-generated-at`` a little later; the answer leaves after both.
        The values sent are in ``opened`` and ``generated``."""
        self.opened: list[float] = []
        self.fail = fail
        self.template_tokens = template_tokens
        """With it, replies report the prompt's tokens as a byte-level tokenizer with a chat template would:
        one per character plus this many per message; without it, ``prompt_tokens`` is 0 (not reported)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.time()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if fake.fail:
                    fake.fail -= 1
                    self.send_response(500)
                    self.end_headers()
                    return
                fake.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                n, content = body["max_tokens"], f"r{len(fake.requests)} " + "y" * body["max_tokens"]
                reply = {"id": f"c{len(fake.requests)}", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": content}}],
                         "usage": {"prompt_tokens": fake.prompt_tokens(body["messages"]), "completion_tokens": n,
                                   "total_tokens": n}}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if fake.generated_ago_s is not None:
                    # what the header carries (6 places), so a test's own rounding matches the agent's
                    fake.generated.append(round(time.time() - fake.generated_ago_s, 6))
                    self.send_header("gyre-generated-at", f"{fake.generated[-1]:.6f}")
                if fake.opened_after_s is not None:
                    fake.opened.append(round(arrived + fake.opened_after_s, 6))
                    fake.generated.append(round(fake.opened[-1] + 0.01, 6))
                    time.sleep(max(0.0, fake.generated[-1] - time.time()))  # both in the past when it leaves
                    self.send_header("gyre-started-at", f"{fake.opened[-1]:.6f}")
                    self.send_header("gyre-generated-at", f"{fake.generated[-1]:.6f}")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def prompt_tokens(self, messages: list[dict[str, Any]]) -> int:
        if self.template_tokens is None:
            return 0
        return sum(len(m["content"]) + self.template_tokens for m in messages)

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server


def agent(url: str, workload: Path, cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "GYRE_"))}
    env.update(OPENAI_BASE_URL=url, OPENAI_API_KEY=KEY)
    return subprocess.run([sys.executable, str(AGENT_DIR / "agent.py"), "--workload", str(workload),
                           "--retry-backoff-s", "0.01", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


SCENARIO = {"calls.s_per_call": 5.0, "calls.compact_at_tokens": 8_000, "calls.summary_tokens": 2_000}


def workload_file(tmp_path: Path, *, crash: bool = False, **scales: float) -> tuple[Path, dict[str, Any]]:
    """A set of descriptions of one step of a per-call terminal-bench-like run; returns it and the one the
    tests replay (a completed run with compactions, or a crashed one)."""
    sc = with_values(load_scenario("terminal-bench-like"), SCENARIO)
    batch = sample_workload(sc, 0, 1).batches[0]
    document = describe_workload(sc, Workload((batch,)), 0, **scales)
    status = "harness_error" if crash else "completed"
    chosen = next(d for d in document["executions"] if d["status"] == status and (crash or d["totals"]["compactions"]))
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(document))
    return path, chosen


def test_the_agent_imports_only_the_standard_library() -> None:
    for path in AGENT_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", f"{path.name} imports {name}"


def test_it_makes_exactly_the_described_calls_with_growing_messages(fake: FakeOpenAI, tmp_path: Path) -> None:
    path, d = workload_file(tmp_path, time_scale=1e4, token_scale=20)
    live_id = f"run-7.s{d['step']}-g{d['group']}-e{d['rollout']}"  # a live run's id: matched by its numbers
    done = agent(fake.url, path, tmp_path, "--execution-id", live_id, "--model", "policy")
    assert done.returncode == 0, done.stderr
    calls, requests = d["calls"], fake.requests
    assert len(requests) == len(calls) > 3
    assert all(r["path"] == "/v1/chat/completions" and r["auth"] == f"Bearer {KEY}" and r["model"] == "policy"
               for r in requests)
    planned = 0  # the outputs so far add up to the plan's over token_scale (each call at least 1)
    for call, request in zip(calls, requests, strict=True):
        planned += call["output_tokens"]
        asked = sum(r["max_tokens"] for r in requests[:requests.index(request) + 1])
        assert request["max_tokens"] >= 1 and (asked == round(planned / 20) or request["max_tokens"] == 1)
    for i, (call, request) in enumerate(zip(calls, requests, strict=True)):
        messages, new = request["messages"], request["messages"][-1]
        chars = round(call["prompt_delta_tokens"] / 20)
        root = call["compaction"] or i == 0
        sent = len(new["content"]) + len(messages[0]["content"]) * root  # a root's size holds the system prompt
        fixed = len(messages[0]["content"]) + new["content"].find("below:\n") + 7 if call["compaction"] else 150
        assert new["role"] == "user" and chars - 1 <= sent <= max(chars, fixed) + 1  # + its header
        if root:  # a new root: system + the summary (or the task)
            assert len(messages) == 2 and messages[0]["role"] == "system"
            assert not call["compaction"] or new["content"].startswith("This session is being continued")
        else:  # extends the previous call's messages with its reply, verbatim, then the tool output
            previous = requests[i - 1]
            reply = {"role": "assistant", "content": f"r{i} " + "y" * previous["max_tokens"]}
            assert messages[:-1] == [*previous["messages"], reply]
    assert sum(c["compaction"] for c in calls) == d["totals"]["compactions"] > 0
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["model_calls"] == len(calls) and report["is_error"] is False
    assert report["waited_s"] == pytest.approx(sum(c["wait_s"] for c in calls) / 1e4, abs=1e-3)
    assert (tmp_path / "answer.txt").read_text().startswith(f"r{len(calls)} ")


def test_with_usage_the_real_prompts_follow_the_plans_context_template_included(tmp_path: Path) -> None:
    """A chat template adds tokens the plan does not hold; the agent learns them from ``usage`` and sizes the
    next tool output so that each prompt holds the plan's context over token_scale, not that plus the
    template (live at token_scale 100 the difference was +33% of prompt tokens)."""
    path, d = workload_file(tmp_path, time_scale=1e4, token_scale=20)
    plan = CallPlan.from_json(d)
    with FakeOpenAI(template_tokens=12) as server:
        done = agent(server.url, path, tmp_path, "--execution-id", d["execution_id"])
        assert done.returncode == 0, done.stderr
    real = [server.prompt_tokens(r["messages"]) for r in server.requests]
    roots = [i for i, c in enumerate(d["calls"]) if i == 0 or c["compaction"]]
    checked = shortened = 0
    for i in range(len(real)):
        if i - max(r for r in roots if r <= i) < 2:  # the root and the turn after it: template not learned yet
            continue
        target = plan.prompt_tokens(i) / 20
        body = len(server.requests[i]["messages"][-1]["content"]) - len(f"Tool output {i}:\n")
        shortened += body < round(d["calls"][i]["prompt_delta_tokens"] / 20) - len(f"Tool output {i}:\n")
        assert abs(real[i] - target) <= 1 or (body == 0 and real[i] > target), (i, real[i], target)
        checked += 1
    assert checked >= 3 and shortened == checked  # every filler gave up the template's share
    system = len(server.requests[0]["messages"][0]["content"])
    first = max(plan.prompt_tokens(0) / 20, system)  # the first prompt holds its system prompt: only the template
    assert abs(real[0] - first - 2 * 12) <= 1, (real[0], plan.prompt_tokens(0) / 20)  # (two messages) is over


def test_a_crash_a_stall_and_retries(tmp_path: Path) -> None:
    path, d = workload_file(tmp_path, crash=True, time_scale=1e4, token_scale=50)
    with FakeOpenAI(fail=1) as server:
        done = agent(server.url, path, tmp_path, "--execution-id", d["execution_id"])
        assert done.returncode == 3, done.stderr  # every call made, then the described crash
        assert len(server.requests) == len(d["calls"])
        assert json.loads(done.stdout.strip().splitlines()[-1])["api_retries"] == 1
        assert not (tmp_path / "answer.txt").exists()
    stalled = {**d, "crash": False, "time_scale": 100.0,
               "calls": [*d["calls"][:2], {"wait_s": 5.0, "prompt_delta_tokens": 0, "output_tokens": 1,
                                           "compaction": False, "stall": True}]}
    single = tmp_path / "one.json"
    single.write_text(json.dumps(stalled))
    with FakeOpenAI() as server:
        done = agent(server.url, single, tmp_path)
        assert done.returncode == 0 and len(server.requests) == 2  # the stall's call is never sent
        assert json.loads(done.stdout.strip().splitlines()[-1])["waited_s"] >= 0.05


def test_the_first_wait_counts_from_the_executions_start_and_later_ones_from_each_reply(tmp_path: Path) -> None:
    """A harness's own start-up is part of the environment start the first wait stands for: begun 1,000 s
    ago, the agent does not sleep its 30 s first wait (or this test times out); the excess is a debt that the
    later wait is spent on (not slept), and what is left of it at the end is reported as late."""
    _, d = workload_file(tmp_path, time_scale=1e4, token_scale=50)
    one = {**d, "time_scale": 1.0, "calls": [{**d["calls"][0], "wait_s": 30.0}, {**d["calls"][1], "wait_s": 0.2}]}
    single = tmp_path / "one.json"
    single.write_text(json.dumps(one))
    with FakeOpenAI() as server:
        done = agent(server.url, single, tmp_path, "--started-at", str(time.time() - 1000), timeout=25)
        assert done.returncode == 0, done.stderr
        assert len(server.requests) == 2
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert 970 - 0.2 <= report["late_s"] <= 1000 + 25
    calls = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"event": "call"')]
    assert [call["slept_s"] for call in calls] == [0, 0]


def test_each_later_wait_counts_from_when_the_model_finished_where_the_proxy_says(tmp_path: Path) -> None:
    """A Gyre proxy's ``gyre-generated-at`` anchors the next wait: the reply's way back (durability, rendering,
    HTTP) is host time that ``time_scale`` would multiply. The server here says the model finished 1,000 s
    ago, which is before the request was sent: the agent then counts from its send, never earlier."""
    _, d = workload_file(tmp_path, time_scale=1e4, token_scale=50)
    two = {**d, "time_scale": 1.0, "calls": [{**d["calls"][0], "wait_s": 0.0}, {**d["calls"][1], "wait_s": 0.0},
                                             {**d["calls"][2], "wait_s": 0.0}]}
    path = tmp_path / "three.json"
    path.write_text(json.dumps(two))
    with FakeOpenAI(generated_ago_s=1000.0) as server:
        done = agent(server.url, path, tmp_path)
        assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"event": "call"')]
    assert len(calls) == 3
    for call in calls:  # clamped to the send: a server's clock cannot move the agent's wait before its request
        assert call["anchor"] == call["sent"] < call["received"]
    with FakeOpenAI(generated_ago_s=0.0) as server:  # finished as the reply left: after the send
        done = agent(server.url, path, tmp_path)
        assert done.returncode == 0, done.stderr
        generated = server.generated
    calls = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"event": "call"')]
    assert [call["anchor"] for call in calls] == [round(t, 4) for t in generated]
    assert all(call["sent"] <= call["anchor"] <= call["received"] for call in calls)


def test_a_request_s_way_to_the_proxy_is_left_out_of_the_next_wait(tmp_path: Path) -> None:
    """A Gyre proxy's ``gyre-started-at``: a request that reached the model late (relays, a busy host) began,
    for the emulated cluster, when it was sent — the next wait, counted from when the model finished, is
    shortened by that delay (summed as ``lag_s``); the last call's delay has no wait after it: late."""
    _, d = workload_file(tmp_path, time_scale=1e4, token_scale=50)
    three = {**d, "time_scale": 1.0, "calls": [{**c, "wait_s": 0.0 if i == 0 else 2.0}
                                               for i, c in enumerate(d["calls"][:3])]}
    path = tmp_path / "three.json"
    path.write_text(json.dumps(three))
    with FakeOpenAI(opened_after_s=0.3) as server:
        done = agent(server.url, path, tmp_path)
        assert done.returncode == 0, done.stderr
        opened, generated = server.opened, server.generated
    calls = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"event": "call"')]
    assert len(calls) == len(opened) == 3
    for call, at, finished in zip(calls, opened, generated, strict=True):
        lag = at - call["sent"]
        assert lag >= 0.3  # the fake opened each call 0.3 s after it arrived
        assert call["lag_s"] == pytest.approx(lag, abs=2e-4)
        assert call["anchor"] == pytest.approx(finished, abs=2e-4)
    for before, call in itertools.pairwise(calls):  # a 2 s wait, less what passed since the model finished and the lag
        assert call["slept_s"] <= 2.0 - (before["received"] - before["anchor"]) - before["lag_s"] + 2e-3
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["lag_s"] == pytest.approx(sum(c["lag_s"] for c in calls), abs=2e-3)
    assert report["late_s"] == pytest.approx(calls[-1]["lag_s"], abs=2e-3)


def test_bad_usage_is_exit_2(fake: FakeOpenAI, tmp_path: Path) -> None:
    path, _ = workload_file(tmp_path)
    assert agent(fake.url, path, tmp_path).returncode == 2  # a set needs an execution id
    assert agent(fake.url, path, tmp_path, "--execution-id", "nope").returncode == 2
    (tmp_path / "x.json").write_text('{"format": "other"}')
    assert agent(fake.url, tmp_path / "x.json", tmp_path, "--execution-id", "a").returncode == 2
    bad = agent(fake.url, path, tmp_path, "--max-retries", "many")
    assert bad.returncode == 2 and "--max-retries: 'many' is not an integer" in bad.stderr
    bad = agent(fake.url, path, tmp_path, "--bogus", "1")
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr
    assert fake.requests == []


def test_the_harness_config_loads_and_names_the_description_and_the_execution() -> None:
    config = HarnessConfig.load(AGENT_DIR / "harness.toml")
    assert "{task_file}" in config.command and "{execution_id}" in config.command


def test_a_plan_and_its_description_agree_on_every_call() -> None:
    sc = with_values(load_scenario("terminal-bench-like"), SCENARIO)
    e = sample_workload(sc, 0, 1).executions()[0]
    plan, described = plan_calls(sc, e, 0), describe_workload(sc, Workload(((e,),)), 0)["executions"][0]
    assert [(c.wait_s, c.prompt_delta_tokens, c.output_tokens, c.compaction) for c in plan.calls] == \
        [(c["wait_s"], c["prompt_delta_tokens"], c["output_tokens"], c["compaction"]) for c in described["calls"]]
