"""Claude Code, unmodified, through the proxy to the local engine — opt-in: `pytest -m harness_claude_code`.

The fixture uses `claude` from $GYRE_CLAUDE or PATH, else installs `@anthropic-ai/claude-code` from npm into a
temporary prefix (the only network use, and only in this opt-in test). Claude Code itself is fenced to
loopback: non-essential traffic is off and HTTP(S)_PROXY points at a closed local port, so anything it tries
to send elsewhere fails instead of leaving the machine. Its first prompt is ~49K byte-level tokens: the tiny
model's 128K context serves it (a prefill of a minute or more on a CPU thread).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.log import LogReader, LogWriter
from gyre.proxy import LogSink, Proxy, ProxyConfig, ProxyServer
from tests.proxy.proxy_helpers import Seen, capture
from tests.proxy.test_proxy_tito_log import REASSEMBLE

pytestmark = pytest.mark.harness_claude_code

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code@2"


@pytest.fixture(scope="module")
def claude(tmp_path_factory: pytest.TempPathFactory) -> str:
    found = os.environ.get("GYRE_CLAUDE") or shutil.which("claude")
    if found:
        return found
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("neither `claude` nor `npm` is installed")
    prefix = tmp_path_factory.mktemp("claude-code")
    subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", CLAUDE_CODE_PACKAGE],
        check=True,
        timeout=600,
    )
    return str(prefix / "node_modules" / ".bin" / "claude")


@pytest.fixture(scope="module")
def engine() -> Iterator[LocalEngineServer]:
    server = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0, num_threads=2)))
    server.start()
    yield server
    server.stop()


def test_claude_code_print_mode_through_the_proxy(
    claude: str, engine: LocalEngineServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Seen] = {}
    capture(engine, monkeypatch, seen)
    log_dir = tmp_path / "log"
    sink = LogSink(LogWriter(log_dir, run_id="claude-code"))
    proxy = Proxy(ProxyConfig(engines={"cell0": engine.url}, max_tokens_cap=16), sink=sink)
    server = ProxyServer(proxy)
    server.start()
    try:
        registration = server.register_execution("cc-1")
        home = tmp_path / "home"
        (home / ".claude").mkdir(parents=True)
        (home / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True}))
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            **server.harness_env(registration),
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": "gyre-policy",
            "ANTHROPIC_DEFAULT_SONNET_MODEL": "gyre-policy",
            "ANTHROPIC_DEFAULT_OPUS_MODEL": "gyre-policy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "API_TIMEOUT_MS": "3600000",
            "HTTPS_PROXY": "http://127.0.0.1:9",  # a closed port: nothing leaves the machine
            "HTTP_PROXY": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        done = subprocess.run(
            [claude, "-p", "Reply with one word.", "--output-format", "json", "--max-turns", "1"],
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    finally:
        server.stop()
        sink.close()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["type"] == "result" and not result["is_error"], result
    rows = LogReader(log_dir).duckdb().execute(REASSEMBLE).fetchall()
    assert rows, "Claude Code made no model call"
    finished = LogReader(log_dir).duckdb().execute("SELECT finish_reason FROM model_calls").fetchall()
    assert all(reason != "abort" for (reason,) in finished)
    assert max(len(prompt) for _, prompt, *_ in rows) > 32768  # the real prompt, above the old 32K context
    for call_id, prompt, output, logprobs, _parent, _drift in rows:
        engine_side = seen[f"{call_id}#0"]
        assert prompt == engine_side.input_ids and output == engine_side.output_ids
        assert [round(x, 4) for x in logprobs] == [round(x, 4) for x in engine_side.output_logprobs or []]
