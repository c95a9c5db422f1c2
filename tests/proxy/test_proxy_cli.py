"""`gyre proxy serve` in a subprocess answers an SDK call and logs it; `bench` prints its keys as JSON."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from gyre.cli import app
from gyre.log import LogReader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], attempts: int = 3) -> tuple[subprocess.Popen, int]:
    """`gyre proxy serve ARGS` on a free port, once its /health answers. Another test's server may take the port
    between the probe and the bind (tests run on two workers): that proxy exits, and another port is tried."""
    for _ in range(attempts):
        port = _free_port()
        command = [sys.executable, "-c", "from gyre.cli import app; app()", "proxy", "serve", "--port", str(port),
                   *args]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return process, port
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        process.kill()
        output = process.communicate(timeout=20)[0]
        if "address already in use" not in output.lower():
            raise AssertionError(f"proxy did not start: {output}")
    raise AssertionError(f"proxy found no free port in {attempts} attempts")


def test_serve_in_a_subprocess(scripted, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    minted = CliRunner().invoke(app, ["proxy", "token", "exec-cli", "--file", str(tokens)])
    assert minted.exit_code == 0, minted.output
    token = minted.output.strip()
    log_dir = tmp_path / "log"
    markers = tmp_path / "markers.toml"
    markers.write_text('summary_request = ["SUMMARISE"]\n')
    process, port = _serve(["--engine", f"cell0={scripted.url}", "--log-dir", str(log_dir), "--executions",
                            str(tokens), "--markers", str(markers)])
    try:
        scripted.say("Hello.")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0)
        reply = client.chat.completions.create(
            model="m", max_tokens=20, messages=[{"role": "user", "content": "SUMMARISE"}]
        )
        assert reply.choices[0].message.content == "Hello."
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0]
    assert "accepting 1 execution(s)" in output and token not in output
    (call,) = [e for e in LogReader(log_dir).events() if e.kind == "model_call_finished"]
    assert call.execution_id == "exec-cli" and call.branch == "main-summary"


def test_bench_json_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.proxy_bench as bench

    row = {"calls": 1, "proxy_cpu_ms_per_call": 1.0, "p50_added_ms": 0.5, "p99_added_ms": 0.9}
    fake = {
        "engine": "stub",
        "concurrency": {"1": row},
        "p50_added_ms": {"1": 0.5},
        "p99_added_ms": {"1": 0.9},
        "long_context_added_ms": {"100000": 0.1},
        "long_context": {"100000": {"added_ms": 0.1, "proxied_ms": 1.0, "direct_ms": 0.9}},
        "breakdown_p50_1_session": {"fsync_floor_ms": 0.25},
        "servers": {
            "empty_asgi": {"concurrency": {"1": row}, "saturated": {"calls_per_s": 900.0, "cpu_ms_per_call": 0.4}}
        },
    }
    seen = {}
    monkeypatch.setattr(bench, "run_benchmark", lambda **kw: seen.update(kw) or fake)
    result = CliRunner().invoke(app, ["proxy", "bench", "--json", "--quick"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == fake and seen["quick"] is True
    text = CliRunner().invoke(app, ["proxy", "bench"])
    assert text.exit_code == 0 and "p50 +0.50 ms" in text.output
    assert "fsync_floor_ms 0.25" in text.output and "empty_asgi: saturated 900 calls/s" in text.output


def test_bench_read_cost_reads_both_ways() -> None:
    """`python -m benchmarks.proxy_bench --read`: the same request read whole and with the cache, both timed."""
    import benchmarks.proxy_bench as bench

    result = bench.read_cost(calls=4, long_chars=20_000, reps=3)
    assert set(result) == {"call_4", "long_context"}
    for row in result.values():
        assert row["whole_us"] > 0 and row["cached_us"] > 0 and row["messages"] > 4


def test_token_command_mints_into_a_private_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    result = CliRunner().invoke(app, ["proxy", "token", "a", "b", "-f", str(tokens)])
    assert result.exit_code == 0
    a, b = result.output.split()
    assert a != b and a.startswith("gyre_ex_") and oct(tokens.stat().st_mode & 0o777) == "0o600"
    again = CliRunner().invoke(app, ["proxy", "token", "a", "-f", str(tokens)])
    assert again.exit_code == 2 and "already has a token" in again.output and "Traceback" not in again.output


def test_serve_refuses_a_bad_token_file_cleanly(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tokens]\nexec-1 = "short"\n')
    tokens.chmod(0o600)
    for args, words in (
        (["--executions", str(tokens)], "too short"),
        (["--executions", str(tmp_path / "missing.toml")], "does not exist"),
        (["--execution", "exec-1=0123456789abcdef0"], "No such option"),
        (["--tokenizer", str(tmp_path / "nowhere")], "neither 'tiny' nor a local directory"),
    ):
        result = CliRunner().invoke(app, ["proxy", "serve", "--engine", "http://127.0.0.1:9", *args])
        said = " ".join(result.output.replace("│", " ").split())  # the error box wraps at the terminal's width
        assert result.exit_code == 2 and words in said, result.output
        assert isinstance(result.exception, SystemExit)  # a usage error, not a traceback


def test_serve_without_executions_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import gyre.proxy

    served: list[object] = []
    monkeypatch.setattr(gyre.proxy, "serve", lambda proxy, **kw: served.append(proxy))
    monkeypatch.delenv("GYRE_PROXY_EXECUTIONS", raising=False)
    result = CliRunner().invoke(app, ["proxy", "serve", "--engine", "http://127.0.0.1:9"])
    assert result.exit_code == 0 and len(served) == 1
    assert "no executions registered" in result.output and "gyre proxy token" in result.output
