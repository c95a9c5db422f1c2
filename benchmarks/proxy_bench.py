"""Proxy benchmark: `gyre proxy bench --json [--quick]`.

What it measures: the latency a harness gains by calling the engine through the proxy instead of directly
(`added = proxied - direct`, per percentile), with N concurrent agent sessions, and the added cost of one
call in an execution that already holds 100K and 700K tokens.

To isolate the proxy, the engine is an *instant stub* (benchmark-only, labelled in the output): a raw
asyncio HTTP server that answers every `/generate` at once with the same reply (a tool call),
without looking at the prompt. Engine, proxy and load generator run as three processes on this machine;
the proxy writes a real durable log (fsync before each answer, group commit). Sessions model agents: each
call appends the echoed reply and a tool result, and concurrent sessions pause between calls (`think`,
0.5-1.5x the level's mean) for what a real engine's generation and the agent's tool would take, so 64 and
256 sessions offer about 32 and 64 calls per second. `proxy_cpu_ms_per_call` is the capacity figure: one
proxy process serves about 1000 / it calls per second of CPU. Both paths use the same HTTP client, so
client costs cancel.

So that every millisecond has a name, one run measures four servers against the same engine and client:
the engine directly; an empty ASGI app behind the proxy's own uvicorn stack (it drains the body and answers
a fixed message: the HTTP floor); the proxy without the durable log (events kept in memory); the proxy with
the log. The same run measures the fsync floor (`pwrite` + `fdatasync` of one event-sized record in the
log's directory) and each server's saturated throughput (closed loop, no think time), driven by several
load-generator processes (raw HTTP/1.1 clients: one httpx client in one process tops out below the proxy),
with the server's own CPU from `/proc`. Each server's CPU while it serves nothing (`idle_cpu_ms_per_s`) and the
instant engine's own CPU a call at each level (`engine_cpu_ms_per_call`) are reported beside: on a virtualised
core, code that runs after its process slept runs 2-4x slower, so a call that finds the proxy idle (64 and 256
sessions, a call every ~15-30 ms) costs more CPU than one of a back-to-back session, for the engine's ~30
lines as for the proxy's work.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ENGINE_LABEL = (
    "instant stub engine (benchmark-only): answers every /generate at once with the same reply, a tool "
    "call of {n} tokens, without reading the prompt"
)
TOOL_REPLY = 'On it.<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>'
EOS = 258
TOKEN_PREFIX = "bench-token-"


def _token(i: int) -> str:
    return f"{TOKEN_PREFIX}{i:08d}"


# -- the instant engine (its own process) ------------------------------------------------------------------


def _reply_ids() -> list[int]:
    from gyre.model.tokenizer import build_tokenizer

    return [*build_tokenizer().encode(TOOL_REPLY, add_special_tokens=False), EOS]


def run_instant_engine() -> None:
    """Serve `/generate` on a free loopback port (printed on stdout) until stdin closes."""
    ids = _reply_ids()
    meta = {
        "finish_reason": {"type": "stop", "matched": EOS} if ids[-1] == EOS else {"type": "length", "length": len(ids)},
        "prompt_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": "0",
        "output_token_logprobs": [[-0.25, t, None] for t in ids],
    }
    head, tail = json.dumps({"text": "", "output_ids": ids, "meta_info": {"id": "RID", **meta}}).split('"RID"')

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in header.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                at = body.rfind(b'"rid"')
                rid = body[at:].split(b'"')[3].decode() if at >= 0 else "none"
                payload = (head + json.dumps(rid) + tail).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(payload), payload)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        os._exit(0)  # stdin closed: the benchmark is over; nothing here needs cleaning up

    asyncio.run(main())


# -- the proxy (its own process) ---------------------------------------------------------------------------


def run_proxy_process(engine_url: str, executions: int, log_dir: str | None) -> None:
    """Serve a proxy with `executions` registered executions (tokens `_token(i)`); URL on stdout. Without
    `log_dir` the events stay in memory (the proxy without its durable log)."""
    from gyre.log import LogWriter
    from gyre.proxy import Proxy, ProxyConfig, ProxyServer
    from gyre.sink import LogSink, MemorySink

    sink = LogSink(LogWriter(log_dir, run_id="bench")) if log_dir else MemorySink()
    proxy = Proxy(ProxyConfig(engines={"cell0": engine_url}), sink=sink)
    server = ProxyServer(proxy)
    server.start()
    for i in range(executions):
        server.register_execution(f"bench-{i}", _token(i))
    print(server.url, flush=True)
    sys.stdin.read()
    server.stop()
    proxy.sink.close()


def run_empty_app_process() -> None:
    """Serve an empty ASGI app behind the proxy's uvicorn stack (guarded httptools protocol, same limits,
    socket options and event loop): it drains the body and answers a fixed Anthropic message. URL on stdout."""
    import threading

    from gyre.http_server import Server, listen, server_loop, uvicorn_config
    from gyre.proxy import ProxyConfig
    from gyre.proxy.http import refusal_parts

    reply = json.dumps(
        {
            "id": "msg_0",
            "type": "message",
            "role": "assistant",
            "model": "policy",
            "content": [
                {"type": "text", "text": "On it."},
                {"type": "tool_use", "id": "toolu_0", "name": "bash", "input": {"cmd": "ls"}},
            ],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    limits = ProxyConfig(engines={"cell0": "http://127.0.0.1:1"}).server_limits()
    sock = listen("127.0.0.1", 0)
    server = Server(uvicorn_config(app, limits, refusal_parts, log_level="warning"))
    def run() -> None:
        with asyncio.Runner(loop_factory=server_loop) as runner:
            runner.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.005)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    sys.stdin.read()
    server.should_exit = True
    thread.join(10)


def fsync_floor(directory: Path, reps: int = 200, size: int = 1024) -> dict[str, float]:
    """Milliseconds of one `pwrite` + `fdatasync` of `size` bytes appended to a file in `directory`: the
    floor under "durable before the reply" on this disk."""
    path = directory / "fsync-floor"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    times = []
    try:
        record = b"x" * size
        for _ in range(reps):
            start = time.perf_counter()
            os.write(fd, record)
            os.fdatasync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return {"p50_ms": _percentile(times, 0.5) * 1e3, "p99_ms": _percentile(times, 0.99) * 1e3}


def _spawn(code: str) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env
    )


def _instant_engine() -> tuple[subprocess.Popen[str], str]:
    """The instant engine in its own process, and its URL (once it listens)."""
    engine = _spawn("from benchmarks.proxy_bench import run_instant_engine; run_instant_engine()")
    assert engine.stdin is not None and engine.stdout is not None
    return engine, f"http://127.0.0.1:{engine.stdout.readline().strip()}"


# -- sessions -------------------------------------------------------------------------------------------------


@dataclass
class Session:
    """One agent conversation (Anthropic Messages), grown the way a harness grows it."""

    index: int
    result_chars: int
    messages: list[dict[str, Any]]

    @classmethod
    def new(cls, index: int, result_chars: int = 400) -> Session:
        return cls(index, result_chars, [{"role": "user", "content": f"Task {index}: fix the failing test."}])

    def body(self) -> dict[str, Any]:
        return {
            "model": "policy",
            "max_tokens": 64,
            "system": "You are a coding agent.",
            "tools": [
                {
                    "name": "bash",
                    "description": "Run a command",
                    "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                }
            ],
            "messages": self.messages,
        }

    def extend(self, reply: dict[str, Any], result_chars: int | None = None) -> None:
        self.messages.append({"role": "assistant", "content": reply["content"]})
        use = next(b for b in reply["content"] if b["type"] == "tool_use")
        text = "lorem ipsum dolor sit amet " * (1 + (result_chars or self.result_chars) // 27)
        self.messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use["id"],
                        "content": text[: result_chars or self.result_chars],
                    }
                ],
            }
        )


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux `/proc`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _proxied_call(http: httpx.AsyncClient, session: Session) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = await http.post(
        "/v1/messages",
        content=json.dumps(session.body()),
        headers={"x-api-key": _token(session.index), "content-type": "application/json"},
    )
    reply = response.json()
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"proxy answered {response.status_code}: {response.text[:300]}")
    return elapsed, reply


async def _direct_call(http: httpx.AsyncClient, ids: list[int], rid: str) -> float:
    start = time.perf_counter()
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 64, "skip_special_tokens": False},
        "rid": rid,
        "return_logprob": True,
    }
    response = await http.post("/generate", content=json.dumps(body), headers={"content-type": "application/json"})
    response.json()
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"engine answered {response.status_code}")
    return elapsed


async def _run_sessions(
    base_url: str, workers: int, sessions: range, calls: int, think_s: float, *, direct: bool, seed: int
) -> list[float]:
    """Latencies of `workers` concurrent agents working through `sessions` (execution indices) of `calls`
    calls each; an agent pauses `think_s` (0.5-1.5x) between calls, as if running a tool."""
    limits = httpx.Limits(max_connections=workers + 8, max_keepalive_connections=workers + 8)
    rng = random.Random(seed)
    latencies: list[float] = []
    todo = list(sessions)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as http:

        async def agent() -> None:
            await asyncio.sleep(rng.random() * think_s)
            while todo:
                session = Session.new(todo.pop())
                prompt_len = 60
                for c in range(calls):
                    if direct:
                        latencies.append(await _direct_call(http, [65] * prompt_len, f"d{session.index}-{c}"))
                        prompt_len += 60 + session.result_chars
                    else:
                        elapsed, reply = await _proxied_call(http, session)
                        latencies.append(elapsed)
                        session.extend(reply)
                    if think_s:
                        await asyncio.sleep(think_s * (0.5 + rng.random()))

        await asyncio.gather(*(agent() for _ in range(workers)))
    return latencies


async def _long_context(
    proxy_url: str, engine_url: str, proxy_pid: int, index: int, sizes: list[int], chunk: int, reps: int
) -> dict[str, dict[str, float]]:
    """Per size: median added ms of a call in an execution already holding that many tokens."""
    out: dict[str, dict[str, float]] = {}
    session = Session.new(index, result_chars=chunk)
    async with (
        httpx.AsyncClient(base_url=proxy_url, timeout=600) as proxy,
        httpx.AsyncClient(base_url=engine_url, timeout=600) as engine,
    ):
        held = 0
        for size in sizes:
            while held < size:  # grow the execution (byte tokenizer: about one token per character)
                _, reply = await _proxied_call(proxy, session)
                held = reply["usage"]["input_tokens"] + reply["usage"]["output_tokens"]
                session.extend(reply, min(chunk, max(1, size - held)))
            proxied, direct = [], []
            cpu = 0.0
            for r in range(reps):
                before = _cpu_s(proxy_pid)
                elapsed, reply = await _proxied_call(proxy, session)
                cpu += _cpu_s(proxy_pid) - before
                proxied.append(elapsed)
                ids = [65] * reply["usage"]["input_tokens"]
                direct.append(await _direct_call(engine, ids, f"long-{size}-{r}"))
                session.extend(reply, 200)
            p, d = statistics.median(proxied), statistics.median(direct)
            out[str(size)] = {
                "added_ms": (p - d) * 1e3,
                "proxied_ms": p * 1e3,
                "direct_ms": d * 1e3,
                "proxy_cpu_ms_per_call": cpu / reps * 1e3,
                "held_tokens": held,
            }
    return out


@dataclass(frozen=True)
class Level:
    """`workers` concurrent sessions; `sessions` in all, `calls` each (contexts stay a few K tokens)."""

    workers: int
    sessions: int
    calls: int
    think_s: float


def _levels(quick: bool) -> list[Level]:
    if quick:
        return [Level(1, 6, 25, 0.0), Level(64, 64, 3, 2.0), Level(256, 256, 2, 4.0)]
    return [Level(1, 40, 25, 0.0), Level(64, 64, 12, 2.0), Level(256, 256, 6, 4.0)]


SERVERS = ("empty_asgi", "proxy_no_log", "proxy")
"""The servers one run measures, in the order they add work: the HTTP floor, the proxy without its log,
the proxy as deployed (its rows are the headline figures)."""


@dataclass(frozen=True)
class Saturation:
    """A closed loop: `workers` sessions call back to back (no think time), `sessions` of `calls` each, driven
    by `clients` load-generator processes (raw HTTP/1.1 clients, `run_load_client`)."""

    workers: int
    sessions: int
    calls: int
    clients: int = 3


def _saturation(quick: bool) -> Saturation:
    return Saturation(33, 33, 15) if quick else Saturation(33, 66, 25)


def _measure_level(
    server_url: str, server_pid: int, level: Level, sessions: range, direct: list[float], engine_pid: int
) -> dict[str, Any]:
    cpu, engine_cpu = _cpu_s(server_pid), _cpu_s(engine_pid)
    proxied = asyncio.run(
        _run_sessions(server_url, level.workers, sessions, level.calls, level.think_s, direct=False, seed=level.workers)
    )
    cpu, engine_cpu = _cpu_s(server_pid) - cpu, _cpu_s(engine_pid) - engine_cpu
    row: dict[str, Any] = {
        "calls": len(proxied),
        "think_s": level.think_s,
        "offered_calls_per_s": level.workers / level.think_s if level.think_s else None,
        "proxy_cpu_ms_per_call": cpu / len(proxied) * 1e3,
        # the instant engine's own CPU a call at this level: the same ~30-line answer whatever the level, so
        # its rise from one session (back to back) to 64 (a call every ~30 ms) is what arriving at an idle,
        # cache-cold process costs on this machine, not work the proxy added
        "engine_cpu_ms_per_call": engine_cpu / len(proxied) * 1e3,
    }
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        d, p = _percentile(direct, q) * 1e3, _percentile(proxied, q) * 1e3
        row |= {f"{name}_direct_ms": d, f"{name}_proxied_ms": p, f"{name}_added_ms": p - d}
    return row


IDLE_S = 5.0


def _idle_cpu(pid: int) -> float:
    """CPU ms a second the server spends serving nothing (its timers and background threads), over `IDLE_S`."""
    cpu = _cpu_s(pid)
    time.sleep(IDLE_S)
    return (_cpu_s(pid) - cpu) / IDLE_S * 1e3


def _measure_saturation(server_url: str, server_pid: int, sat: Saturation, sessions: range) -> dict[str, float]:
    """The server's saturated throughput, driven by `sat.clients` load-generator processes at once (one httpx
    client in one process topped out at 180-260 calls/s even against the empty app: the figure was the
    client's). The CPU is the server process's own (`/proc`), so calls per CPU-second is the server's."""
    share = [range(sessions.start + i, sessions.stop, sat.clients) for i in range(sat.clients)]
    workers = [max(1, sat.workers // sat.clients)] * sat.clients
    clients = [_spawn(f"from benchmarks.proxy_bench import run_load_client; "
                      f"run_load_client({server_url!r}, {list(mine)!r}, {n}, {sat.calls})")
               for mine, n in zip(share, workers, strict=True)]
    try:
        for client in clients:  # each has connected its workers and waits for the word
            assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        cpu = _cpu_s(server_pid)
        start = time.perf_counter()
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.flush()
        results = [json.loads(client.stdout.readline()) for client in clients if client.stdout is not None]
        wall = time.perf_counter() - start
        cpu = _cpu_s(server_pid) - cpu
    finally:
        for client in clients:
            client.kill()
            client.wait(30)
    latencies = [x for r in results for x in r["latencies"]]
    return {
        "calls": len(latencies),
        "workers": sum(workers),
        "clients": sat.clients,
        "client": "raw asyncio HTTP/1.1 (uvloop, orjson), one process per client",
        "calls_per_s": len(latencies) / wall,
        "server_cpu_share": cpu / wall,
        "cpu_ms_per_call": cpu / len(latencies) * 1e3,
        "calls_per_cpu_s": len(latencies) / cpu if cpu else float("inf"),
        "client_cpu_ms_per_call": sum(r["cpu_s"] for r in results) / len(latencies) * 1e3,
        "p50_ms": _percentile(latencies, 0.5) * 1e3,
        "p99_ms": _percentile(latencies, 0.99) * 1e3,
    }


def run_load_client(url: str, sessions: list[int], workers: int, calls: int) -> None:
    """A load-generator process for the saturated figure: `workers` connections work through `sessions`
    (execution indices), `calls` calls each, back to back, over raw HTTP/1.1 (keep-alive, orjson bodies; a
    fraction of httpx's CPU per call). Prints ``ready`` once connected, starts on a line on stdin, then prints
    one JSON line: latencies (s) and this process's CPU seconds."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_load_client(url, sessions, workers, calls))


async def _load_client(url: str, sessions: list[int], workers: int, calls: int) -> None:
    import orjson

    host, port = url.removeprefix("http://").rstrip("/").split(":")
    connections = [await asyncio.open_connection(host, int(port)) for _ in range(workers)]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    todo = list(reversed(sessions))
    latencies: list[float] = []
    cpu = time.process_time()

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while todo:
            session = Session.new(todo.pop())
            token = _token(session.index).encode()
            for _ in range(calls):
                body = orjson.dumps(session.body())
                start = time.perf_counter()
                writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: proxy\r\nx-api-key: %s\r\n"
                             b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (token, len(body), body))
                head = await reader.readuntil(b"\r\n\r\n")
                length = -1
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length < 0:
                    raise RuntimeError(f"an answer without content-length: {head[:300]!r}")
                data = await reader.readexactly(length)
                latencies.append(time.perf_counter() - start)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"proxy answered {head[:40]!r}: {data[:300]!r}")
                session.extend(orjson.loads(data))
        writer.close()

    await asyncio.gather(*(worker(r, w) for r, w in connections))
    print(json.dumps({"latencies": latencies, "cpu_s": time.process_time() - cpu}), flush=True)


def _breakdown(servers: dict[str, Any], direct_p50_ms: float, fsync: dict[str, float]) -> dict[str, float]:
    """Where the proxy's added p50 at one session goes, by difference between the servers of this run.

    The empty app's round trip is the client's and uvicorn's share; a proxied call adds to it its own work
    and a second round trip (to the engine, `direct`)."""
    one = {name: servers[name]["concurrency"]["1"]["p50_proxied_ms"] for name in SERVERS}
    return {
        "direct_engine_ms": direct_p50_ms,
        "empty_asgi_ms": one["empty_asgi"],
        "proxy_no_log_ms": one["proxy_no_log"],
        "proxy_ms": one["proxy"],
        "http_layer_over_raw_server_ms": one["empty_asgi"] - direct_p50_ms,
        "proxy_own_work_ms": one["proxy_no_log"] - one["empty_asgi"] - direct_p50_ms,
        "durable_log_ms": one["proxy"] - one["proxy_no_log"],
        "fsync_floor_ms": fsync["p50_ms"],
    }


def run_benchmark(*, quick: bool = False, directory: Path | None = None) -> dict[str, Any]:
    levels = _levels(quick)
    sat = _saturation(quick)
    sizes = [100_000, 700_000]
    per_server = sum(level.sessions + 1 for level in levels) + sat.sessions + 1  # one warm-up per level, long ctx
    results: dict[str, Any] = {
        "engine": ENGINE_LABEL.format(n=len(_reply_ids())),
        "quick": quick,
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "servers": {},
    }
    with tempfile.TemporaryDirectory(dir=directory, prefix="gyre-proxy-bench-") as tmp:
        results["fsync_floor"] = fsync_floor(Path(tmp))
        engine, engine_url = _instant_engine()
        try:
            directs: dict[str, list[float]] = {}
            first = 0
            for level in levels:  # the engine directly, once per level; every server is compared against it
                directs[str(level.workers)] = asyncio.run(
                    _run_sessions(
                        engine_url,
                        level.workers,
                        range(first, first + level.sessions),
                        level.calls,
                        level.think_s,
                        direct=True,
                        seed=level.workers,
                    )
                )
                first += level.sessions
            codes = {
                "empty_asgi": "from benchmarks.proxy_bench import run_empty_app_process; run_empty_app_process()",
                "proxy_no_log": f"from benchmarks.proxy_bench import run_proxy_process; "
                f"run_proxy_process({engine_url!r}, {per_server}, None)",
                "proxy": f"from benchmarks.proxy_bench import run_proxy_process; "
                f"run_proxy_process({engine_url!r}, {per_server}, {str(Path(tmp) / 'log')!r})",
            }
            for name in SERVERS:
                server = _spawn(codes[name])
                assert server.stdin is not None and server.stdout is not None
                url = server.stdout.readline().strip()
                try:
                    out: dict[str, Any] = {"concurrency": {}, "idle_cpu_ms_per_s": _idle_cpu(server.pid)}
                    first = 0
                    for level in levels:
                        asyncio.run(_run_sessions(url, 1, range(first, first + 1), 5, 0.0, direct=False, seed=0))
                        first += 1  # warm-up: connections, code paths
                        sessions = range(first, first + level.sessions)
                        first += level.sessions
                        out["concurrency"][str(level.workers)] = _measure_level(
                            url, server.pid, level, sessions, directs[str(level.workers)], engine.pid
                        )
                    out["saturated"] = _measure_saturation(url, server.pid, sat, range(first, first + sat.sessions))
                    first += sat.sessions
                    if name == "proxy":
                        out["long_context"] = asyncio.run(
                            _long_context(
                                url,
                                engine_url,
                                server.pid,
                                first,
                                sizes,
                                20_000 if quick else 4_000,
                                5 if quick else 20,
                            )
                        )
                finally:
                    server.stdin.close()
                    server.wait(30)
                results["servers"][name] = out
        finally:
            engine.stdin.close()
            engine.wait(30)
    proxy = results["servers"]["proxy"]
    results["concurrency"] = proxy["concurrency"]
    results["saturated"] = proxy["saturated"]
    results["p50_added_ms"] = {k: v["p50_added_ms"] for k, v in proxy["concurrency"].items()}
    results["p99_added_ms"] = {k: v["p99_added_ms"] for k, v in proxy["concurrency"].items()}
    results["long_context_added_ms"] = {k: v["added_ms"] for k, v in proxy["long_context"].items()}
    results["long_context"] = proxy["long_context"]
    results["breakdown_p50_1_session"] = _breakdown(
        results["servers"], _percentile(directs["1"], 0.5) * 1e3, results["fsync_floor"]
    )
    return results


def run_saturation(*, rounds: int = 1, clients: int = 3, directory: Path | None = None) -> dict[str, Any]:
    """The saturated rows of `run_benchmark` alone (each server in turn, `rounds` times): the empty app, the proxy
    without its log and with it, driven by `clients` load-generator processes; the same run's fsync floor."""
    sat = Saturation(11 * clients, 22 * clients, 25, clients)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()[0],
                               "servers": {name: [] for name in SERVERS}}
    with tempfile.TemporaryDirectory(dir=directory, prefix="gyre-proxy-sat-") as tmp:
        results["fsync_floor"] = fsync_floor(Path(tmp))
        engine, engine_url = _instant_engine()
        try:
            for r in range(rounds):
                for name in SERVERS:
                    log_dir = str(Path(tmp) / f"log-{r}") if name == "proxy" else None
                    code = ("from benchmarks.proxy_bench import run_empty_app_process; run_empty_app_process()"
                            if name == "empty_asgi" else f"from benchmarks.proxy_bench import run_proxy_process; "
                            f"run_proxy_process({engine_url!r}, {sat.sessions + 1}, {log_dir!r})")
                    server = _spawn(code)
                    assert server.stdin is not None and server.stdout is not None
                    url = server.stdout.readline().strip()
                    try:
                        asyncio.run(_run_sessions(url, 1, range(0, 1), 5, 0.0, direct=False, seed=0))  # warm-up
                        results["servers"][name].append(_measure_saturation(url, server.pid, sat,
                                                                            range(1, 1 + sat.sessions)))
                    finally:
                        server.stdin.close()
                        server.wait(30)
        finally:
            engine.stdin.close()
            engine.wait(30)
    results["load_average_at_end"] = os.getloadavg()[0]
    return results


def cpu_ab(roots: dict[str, str], rounds: int = 3, *, log: bool = False, turns: int = 150) -> dict[str, Any]:
    """A/B of the proxy's CPU per call between source trees (name -> checkout root), side by side: each round
    starts one proxy per tree against one engine and drives the same load at both at once (480 calls each,
    4 sessions back to back), so both run under the same machine conditions; `ratio` is each round's second
    tree over the first. With `log` each proxy writes its durable log (fsync before each answer) in a fresh
    directory. The figure for a cut measured on a shared machine, where latencies are noise (taking turns
    instead, rounds of one tree spread +-20% with the load of the moment). `p50_ms` is each round's median
    call latency (client to proxy and back) under that load, and `one_session_p50_ms` the median at one
    session, the trees' calls taking turns (A, B, A, B, ...: the same moments of the machine for both):
    comparable between the trees of a round, not added latencies (the proxies and the client share the
    machine). `one_session_cpu_ms_per_call` is each proxy's CPU per call over those turns, and
    `one_session_cpu_ratio` each round's second tree over the first: the headline case of one session, where
    each call finds the proxy idle (and a commit's fdatasync puts its loop to sleep); `turns` calls of each
    tree (the CPU comes from `/proc` in clock ticks of 10 ms: 150 calls of ~1.5 ms resolve ~5%, 450 ~1.5%)."""
    engine, engine_url = _instant_engine()
    out: dict[str, list[float]] = {name: [] for name in roots}
    p50: dict[str, list[float]] = {name: [] for name in roots}
    one: dict[str, list[float]] = {name: [] for name in roots}
    one_cpu: dict[str, list[float]] = {name: [] for name in roots}
    try:
        for _ in range(rounds):
            with tempfile.TemporaryDirectory(prefix="gyre-proxy-ab-") as directory:
                proxies: dict[str, tuple[subprocess.Popen[str], str]] = {}
                try:
                    for name, root in roots.items():
                        log_dir = str(Path(directory) / f"log-{name}") if log else None
                        code = (f"from benchmarks.proxy_bench import run_proxy_process; "
                                f"run_proxy_process({engine_url!r}, {34 + -(-turns // 15)}, {log_dir!r})")
                        proxy = subprocess.Popen(
                            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=root, env={**os.environ, "PYTHONPATH": root},
                        )
                        assert proxy.stdout is not None
                        proxies[name] = proxy, proxy.stdout.readline().strip()
                    for name, (cpu_ms, p50_ms) in asyncio.run(_side_by_side(proxies)).items():
                        out[name].append(cpu_ms)
                        p50[name].append(p50_ms)
                    for name, (ms, cpu_ms) in asyncio.run(_taking_turns(proxies, turns)).items():
                        one[name].append(ms)
                        one_cpu[name].append(cpu_ms)
                finally:
                    for proxy, _ in proxies.values():
                        assert proxy.stdin is not None
                        proxy.stdin.close()
                        proxy.wait(30)
    finally:
        engine.stdin.close()
        engine.wait(30)
    first, second = out.values()
    ratios = [b / a for a, b in zip(first, second, strict=True)]
    first, second = one_cpu.values()
    one_ratios = [b / a for a, b in zip(first, second, strict=True)]
    return {**{name: {"cpu_ms_per_call": v, "median": statistics.median(v), "p50_ms": p50[name],
                      "median_p50_ms": statistics.median(p50[name]), "one_session_p50_ms": one[name],
                      "median_one_session_p50_ms": statistics.median(one[name]),
                      "one_session_cpu_ms_per_call": one_cpu[name],
                      "median_one_session_cpu_ms": statistics.median(one_cpu[name])} for name, v in out.items()},
            "ratio": ratios, "median_ratio": statistics.median(ratios), "one_session_cpu_ratio": one_ratios,
            "median_one_session_cpu_ratio": statistics.median(one_ratios), "load_average": os.getloadavg()[0]}


async def _side_by_side(proxies: dict[str, tuple[subprocess.Popen[str], str]]) -> dict[str, tuple[float, float]]:
    """CPU ms per call and median latency ms of each proxy, all driven at once with the same sessions (after a
    warm-up)."""
    await asyncio.gather(*(_run_sessions(url, 1, range(0, 2), 10, 0.0, direct=False, seed=0)
                           for _, url in proxies.values()))
    before = {name: _cpu_s(proxy.pid) for name, (proxy, _) in proxies.items()}
    calls = await asyncio.gather(*(_run_sessions(url, 4, range(2, 34), 15, 0.0, direct=False, seed=0)
                                   for _, url in proxies.values()))
    return {name: ((_cpu_s(proxy.pid) - before[name]) / len(done) * 1e3, statistics.median(done) * 1e3)
            for (name, (proxy, _)), done in zip(proxies.items(), calls, strict=True)}


async def _taking_turns(proxies: dict[str, tuple[subprocess.Popen[str], str]],
                        calls: int = 150) -> dict[str, tuple[float, float]]:
    """Median latency ms and CPU ms per call at one session of each proxy, their calls taking turns (sessions
    of 15 calls): the case where each call finds the proxy idle, and a commit's fdatasync is the loop's own."""
    clients = {name: httpx.AsyncClient(base_url=url, timeout=120) for name, (_, url) in proxies.items()}
    latencies: dict[str, list[float]] = {name: [] for name in proxies}
    sessions: dict[str, Session] = {}
    cpu = {name: _cpu_s(proxy.pid) for name, (proxy, _) in proxies.items()}
    try:
        for i in range(calls):
            for name, http in clients.items():
                if i % 15 == 0:
                    sessions[name] = Session.new(34 + i // 15)  # executions 34-43: unused by the load before
                elapsed, reply = await _proxied_call(http, sessions[name])
                latencies[name].append(elapsed)
                sessions[name].extend(reply)
    finally:
        for http in clients.values():
            await http.aclose()
    return {name: (statistics.median(v) * 1e3, (_cpu_s(proxies[name][0].pid) - cpu[name]) / len(v) * 1e3)
            for name, v in latencies.items()}


def read_cost(calls: int = 30, long_chars: int = 400_000, reps: int = 100) -> dict[str, Any]:
    """CPU microseconds (process clock, median of `reps`) of reading one call's request in-process —
    validating, translating and rendering the re-sent conversation, and the call tree's lookup of each unit by
    its text — whole (as without `gyre.proxy.resend`)
    and with the execution's kept arrays and units (its previous request read just before), for the bench's
    session shape at its `calls`-th call and for a session of 20 calls holding ~`long_chars` characters. No
    server, deterministic work: the firm figure for that cut on a shared machine."""
    from gyre.proxy.anthropic_models import MessagesRequest, to_conversation, translate
    from gyre.proxy.http import parse_model
    from gyre.proxy.render import ChatMLRenderer, Rendered
    from gyre.proxy.resend import ResendCache, read_resent

    renderer = ChatMLRenderer()

    def _look_up(rendering: Any) -> None:  # what the call tree's walk costs per unit: a dict lookup by text
        for unit in rendering.units:
            hash(unit.text)
    reply = {"content": [{"type": "text", "text": "On it."},
                         {"type": "tool_use", "id": "toolu_0", "name": "bash", "input": {"cmd": "ls"}}]}

    def whole(raw: bytes) -> None:
        _look_up(renderer.render(to_conversation(parse_model(MessagesRequest, raw))))

    def cached(raw: bytes, cache: ResendCache, kept: list[Rendered]) -> None:
        resent = read_resent(raw, MessagesRequest, "messages", cache, lambda data: parse_model(MessagesRequest, data))
        conversation, items = translate(resent.body, resent.start, resent.earlier)
        resent.remember(items)
        _look_up(renderer.render(conversation, kept))

    def measure(result_chars: int, calls: int) -> dict[str, float]:
        session = Session.new(0, result_chars)
        for _ in range(calls - 2):
            session.extend(reply)
        before = json.dumps(session.body()).encode()
        session.extend(reply)
        raw = json.dumps(session.body()).encode()
        primed, primed_kept = ResendCache(), []  # type: ignore[var-annotated]
        cached(before, primed, primed_kept)  # the execution's previous request
        times: dict[str, list[float]] = {"whole": [], "cached": []}
        for _ in range(reps):
            start = time.process_time()
            whole(raw)
            times["whole"].append(time.process_time() - start)
            cache, kept = ResendCache(), list(primed_kept)  # as primed: what was kept is never changed
            cache._seen = list(primed._seen)
            start = time.process_time()
            cached(raw, cache, kept)
            times["cached"].append(time.process_time() - start)
        out = {"messages": len(session.messages), "body_bytes": len(raw)}
        return out | {f"{name}_us": statistics.median(t) * 1e6 for name, t in times.items()}

    return {f"call_{calls}": measure(400, calls), "long_context": measure(long_chars // 20, 20)}


def frame_cost(calls: int = 1000, passes: int = 3, directory: Path | None = None) -> dict[str, Any]:
    """CPU microseconds per call (process clock, best of ``passes``) of the log's side of a model call, with
    its commit framed as JSON rows (``rows``, the writer's default since #33) and as an Arrow IPC message
    (``arrow``, before): writing a call's two events as the proxy commits them (append, then the write stage
    alone: no fsync, whose cost is the same for both), reading the log back (`LogReader.read`) and building
    the sealer's table of the segment. Proxy-sized events (a 450-id prompt delta, 60 output ids). No server,
    deterministic work: the firm figure for the frame encoding on a shared machine."""
    from gyre.events.models import ModelCallFinished, ModelCallStarted
    from gyre.log import LogReader, LogWriter
    from gyre.log.seal import segment_table
    from gyre.log.segment import list_segments

    def events(i: int) -> list[Any]:
        ids = dict(execution_id=f"bench-{i % 40}", call_id=f"c{i}", cell_id="cell0", parent_call_id=f"c{i - 1}")
        return [ModelCallStarted(**ids, prompt_tokens=900),
                ModelCallFinished(**ids, prefix_len=800, prompt_delta_ids=list(range(450)),
                                  output_ids=list(range(60)), output_logprobs=[-0.25] * 60, latency_s=0.001)]

    calls_events = [events(i) for i in range(calls)]
    best: dict[str, dict[str, float]] = {mode: {} for mode in ("rows", "arrow")}
    for _ in range(passes):
        for mode in best:
            with tempfile.TemporaryDirectory(dir=directory, prefix="gyre-frame-cost-") as tmp:
                path = Path(tmp) / "log"
                with LogWriter(path, run_id="bench", seal=False, row_frames=mode == "rows") as writer:
                    start = time.process_time()
                    for started, finished in calls_events:
                        writer.append(started)
                        writer.write(writer.append(finished).last)
                    figures = {"write_us": time.process_time() - start}
                start = time.process_time()
                rows = sum(batch.num_rows for batch in LogReader(path).read(full_schema=False))
                figures["read_us"] = time.process_time() - start
                assert rows == 2 * calls
                start = time.process_time()
                segment_table(list_segments(path)[0][1])
                figures["seal_table_us"] = time.process_time() - start
            for name, seconds in figures.items():
                best[mode][name] = min(best[mode].get(name, float("inf")), seconds / calls * 1e6)
    return {"calls": calls, **best, "ratio_rows_over_arrow": {name: best["rows"][name] / best["arrow"][name]
                                                              for name in best["rows"]}}


if __name__ == "__main__":  # pragma: no cover
    if "--ab" in sys.argv:  # python -m benchmarks.proxy_bench --ab ROOT_A ROOT_B [--rounds N] [--turns N] [--log-only]
        a, b = sys.argv[sys.argv.index("--ab") + 1 : sys.argv.index("--ab") + 3]
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
        turns = int(sys.argv[sys.argv.index("--turns") + 1]) if "--turns" in sys.argv else 150
        roots = {"a": a, "b": b}  # with and without the durable log, each A/B alternated in one run
        without = {} if "--log-only" in sys.argv else {"without_log": cpu_ab(roots, rounds, turns=turns)}
        print(json.dumps(without | {"with_log": cpu_ab(roots, rounds, log=True, turns=turns)}))
    elif "--saturate" in sys.argv:  # python -m benchmarks.proxy_bench --saturate [--rounds N] [--clients N]
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 1
        clients = int(sys.argv[sys.argv.index("--clients") + 1]) if "--clients" in sys.argv else 3
        print(json.dumps(run_saturation(rounds=rounds, clients=clients)))
    elif "--read" in sys.argv:  # python -m benchmarks.proxy_bench --read: the re-sent conversation's cost
        print(json.dumps(read_cost()))
    elif "--frames" in sys.argv:  # python -m benchmarks.proxy_bench --frames: a call's commit, rows vs Arrow
        print(json.dumps(frame_cost()))
    else:
        print(json.dumps(run_benchmark(quick="--quick" in sys.argv)))
