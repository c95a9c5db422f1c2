"""`gyre proxy ...` (registered by `gyre.cli` as the `proxy` sub-app): serve the proxy, benchmark it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

proxy_app = typer.Typer(
    help="Token-in/token-out proxy for Anthropic- and OpenAI-speaking harnesses.", no_args_is_help=True
)


@proxy_app.callback()
def _proxy() -> None:
    """Token-in/token-out proxy for Anthropic- and OpenAI-speaking harnesses."""  # keeps subcommands


def _engines(specs: list[str]) -> dict[str, str]:
    """`cell=URL` pairs (or bare URLs, named cell0, cell1, ...)."""
    engines: dict[str, str] = {}
    for i, spec in enumerate(specs):
        cell, sep, url = spec.partition("=")
        if not sep:
            cell, url = f"cell{i}", spec
        if not url.startswith(("http://", "https://")) or not cell:
            raise typer.BadParameter(f"expected CELL=URL or URL, got {spec!r}", param_hint="--engine")
        if cell in engines:
            raise typer.BadParameter(f"cell {cell!r} given twice", param_hint="--engine")
        engines[cell] = url
    return engines


@proxy_app.command()
def serve(
    engine: Annotated[list[str], typer.Option(help="Engine as CELL=URL (or URL); repeat for several cells.")],
    host: Annotated[str, typer.Option(help="Interface to bind (loopback unless you mean otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    log_dir: Annotated[Path | None, typer.Option(help="Event log directory (default: events kept in memory).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id stamped on the log's events.")] = None,
    markers: Annotated[Path | None, typer.Option(help="Compaction markers (.toml or .json).")] = None,
    tokenizer: Annotated[str, typer.Option(help='"tiny" or a local tokenizer directory.')] = "tiny",
    model_name: Annotated[str, typer.Option(help="Model id listed by GET /v1/models.")] = "gyre-policy",
    execution: Annotated[
        list[str] | None,
        typer.Option(
            help="Register EXECUTION_ID=TOKEN at start (runners embedding the proxy call register_execution)."
        ),
    ] = None,
    max_tokens_cap: Annotated[int | None, typer.Option(help="Clamp every request's max_tokens.")] = None,
) -> None:
    """Serve /v1/messages, /v1/messages/count_tokens, /v1/chat/completions and /v1/models until interrupted."""
    from gyre.log import LogWriter
    from gyre.proxy import MarkersConfig, Proxy, ProxyConfig
    from gyre.proxy import serve as run_server
    from gyre.sink import LogSink, MemorySink

    config = ProxyConfig(
        engines=_engines(engine),
        tokenizer=tokenizer,
        model_name=model_name,
        markers=MarkersConfig.load(markers) if markers else MarkersConfig(),
        max_tokens_cap=max_tokens_cap,
    )
    sink = LogSink(LogWriter(log_dir, run_id=run_id)) if log_dir else MemorySink()
    proxy = Proxy(config, sink=sink)
    for item in execution or []:
        execution_id, sep, token = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"expected EXECUTION_ID=TOKEN, got {item!r}", param_hint="--execution")
        proxy.register_execution(execution_id, token)
    try:
        run_server(proxy, host=host, port=port)
    finally:
        sink.close()


@proxy_app.command()
def bench(
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="A run of about a minute.")] = False,
    directory: Annotated[Path | None, typer.Option("--dir", help="Where the proxy's log goes (a temp dir).")] = None,
) -> None:
    """Added latency of the proxy against calling the engine directly (instant stub engine)."""
    from benchmarks.proxy_bench import run_benchmark

    results = run_benchmark(quick=quick, directory=directory)
    if as_json:
        typer.echo(json.dumps(results))
        return
    typer.echo(f"engine: {results['engine']}")
    for sessions, row in results["concurrency"].items():
        typer.echo(
            f"{sessions:>4} sessions: p50 +{row['p50_added_ms']:.2f} ms, p99 +{row['p99_added_ms']:.2f} ms, "
            f"proxy CPU {row['proxy_cpu_ms_per_call']:.2f} ms/call ({row['calls']} calls)"
        )
    for size, row in results["long_context"].items():
        typer.echo(
            f"{int(size):>7} tokens held: +{row['added_ms']:.2f} ms "
            f"(proxied {row['proxied_ms']:.2f}, direct {row['direct_ms']:.2f})"
        )
