"""Claude Code, unmodified, sandboxed, through the proxy to the local engine — opt-in: `pytest -m harness_claude_code`.

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
from urllib.parse import urlsplit

import pytest

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.harness.bwrap import SandboxSpec, UidPool, give_to
from gyre.harness.relay import ProxyRelay
from gyre.log import LogReader, LogWriter
from gyre.proxy import Proxy, ProxyConfig, ProxyServer
from gyre.sink import LogSink
from tests.harness.harness_helpers import install_dir
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
        # In the sandbox a run gives it: its workspace and home, its install read-only, the proxy its only way out.
        uid = UidPool.shared().acquire() if os.geteuid() == 0 else None
        give_to(uid, workspace, home)
        relay = ProxyRelay("127.0.0.1", urlsplit(server.url).port or 80)
        spec = SandboxSpec(workspace=workspace, writable=(home,), readable=(install_dir(claude),), uid=uid,
                           relay_socket=relay.open(uid), proxy_port=urlsplit(server.url).port)
        try:
            done = subprocess.run(
                spec.argv([claude, "-p", "Reply with one word.", "--output-format", "json", "--max-turns", "1"]),
                cwd=workspace,
                env={**env, "TMPDIR": "/tmp"},
                capture_output=True,
                text=True,
                timeout=1800,
            )
        finally:
            relay.stop()
    finally:
        server.stop()
        sink.close()
    result = json.loads(done.stdout)
    assert result["type"] == "result", done.stdout[-2000:] + done.stderr[-2000:]
    # The random tiny model never stops by itself and the proxy caps each call at 16 tokens, so Claude Code
    # may continue a cut reply a few times and then report its output-token limit: the only error allowed.
    assert done.returncode == 0 or "output token maximum" in result["result"], result
    con = LogReader(log_dir).duckdb()
    table = con.execute(
        "SELECT call_id, parent_call_id, prefix_len, len(prompt_delta_ids), len(output_ids), finish_reason "
        "FROM model_calls ORDER BY seq"
    ).fetchall()
    finish = {row[0]: row[5] for row in table}
    rows = con.execute(REASSEMBLE).fetchall()
    answered = [row for row in rows if finish[row[0]] in ("stop", "length")]
    # the real prompt (above the old 32K context) was served, not refused and retried
    assert any(len(prompt) > 32768 for _, prompt, *_ in answered), table
    for call_id, prompt, output, logprobs, _parent, _drift in rows:
        engine_side = seen.get(f"{call_id}#0")
        if engine_side is None:  # aborted before the engine admitted it
            assert finish[call_id] == "abort", table
            continue
        assert prompt == engine_side.input_ids, table
        if finish[call_id] != "abort":  # an aborted call (Claude Code exited first) has a partial output
            assert output == engine_side.output_ids, table
            assert [round(x, 4) for x in logprobs] == [round(x, 4) for x in engine_side.output_logprobs or []]
