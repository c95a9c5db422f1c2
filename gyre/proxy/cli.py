"""`gyre proxy ...` (registered by `gyre.cli` as the `proxy` sub-app): serve the proxy, mint execution tokens.

`gyre.cli` registers `serve` (adding the cluster's ``--controller``, which runs `gyre.cluster.proxy_node`
instead) and `bench` (`benchmarks.cli`): the proxy imports neither the cluster nor the benchmarks.
"""

from __future__ import annotations

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


def serve(
    engine: Annotated[list[str] | None, typer.Option(
        help="Engine as CELL=URL (or URL); repeat for several cells.")] = None,
    host: Annotated[str, typer.Option(help="Interface to bind (loopback unless you mean otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    log_dir: Annotated[Path | None, typer.Option(help="Event log directory (default: events kept in memory).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id stamped on the log's events.")] = None,
    markers: Annotated[Path | None, typer.Option(help="Compaction markers (.toml or .json).")] = None,
    tokenizer: Annotated[str, typer.Option(help='"tiny" or a local tokenizer directory.')] = "tiny",
    model_name: Annotated[str, typer.Option(help="Model id listed by GET /v1/models.")] = "gyre-policy",
    executions: Annotated[
        Path | None,
        typer.Option(
            envvar="GYRE_PROXY_EXECUTIONS",
            help="Token file (mode 0600) of the executions to accept, written by `gyre proxy token`.",
        ),
    ] = None,
    max_tokens_cap: Annotated[int | None, typer.Option(help="Clamp every request's max_tokens.")] = None,
    context_length: Annotated[
        int | None,
        typer.Option(min=1, help="Refuse prompts longer than this (default: what the engine reports)."),
    ] = None,
    kv_mover: Annotated[
        str, typer.Option(help="Redirected calls: 'recompute' their KV, or move it with 'mooncake'.")
    ] = "recompute",
) -> None:
    """Serve /v1/messages, /v1/messages/count_tokens, /v1/chat/completions, /v1/responses and /v1/models."""
    if not engine:
        raise typer.BadParameter("give at least one --engine (or --controller for a cluster run)",
                                 param_hint="--engine")
    from gyre.auth import TokenError, TokenFile
    from gyre.errors import GyreError
    from gyre.log import LogWriter
    from gyre.proxy import MarkersConfig, Proxy, ProxyConfig
    from gyre.proxy import serve as run_server
    from gyre.proxy.template_render import codec_renderer
    from gyre.proxy.tokens import TokenCodec
    from gyre.sink import LogSink, MemorySink

    engines = _engines(engine)
    try:
        tokens = TokenFile(executions).read() if executions is not None else {}
    except TokenError as e:
        raise typer.BadParameter(str(e), param_hint="--executions") from e
    if executions is not None and not executions.exists():
        raise typer.BadParameter(
            f"{executions} does not exist; create it with `gyre proxy token`", param_hint="--executions"
        )
    if kv_mover not in ("recompute", "mooncake"):
        raise typer.BadParameter(f"expected 'recompute' or 'mooncake', got {kv_mover!r}", param_hint="--kv-mover")
    config = ProxyConfig(
        engines=engines,
        tokenizer=tokenizer,
        model_name=model_name,
        markers=MarkersConfig.load(markers) if markers else MarkersConfig(),
        max_tokens_cap=max_tokens_cap,
        context_length=context_length,
        kv_mover=kv_mover,  # type: ignore[arg-type]  # validated by ProxyConfig
    )
    try:  # the tokenizer (and its chat template) is checked before anything is opened
        codec = TokenCodec.load(tokenizer)
        renderer = codec_renderer(codec)
    except (OSError, GyreError) as e:
        raise typer.BadParameter(str(e), param_hint="--tokenizer") from e
    sink = LogSink(LogWriter(log_dir, run_id=run_id)) if log_dir else MemorySink()
    proxy = Proxy(config, sink=sink, codec=codec, renderer=renderer)
    for execution_id, token in tokens.items():
        proxy.register_execution(execution_id, token)
    if tokens:
        typer.echo(f"gyre proxy: accepting {len(tokens)} execution(s) from {executions}", err=True)
    else:
        typer.echo(
            "gyre proxy: WARNING: no executions registered, so every model request will be refused (401). "
            "Mint tokens with `gyre proxy token EXECUTION_ID --file tokens.toml` and serve with "
            "`--executions tokens.toml`.",
            err=True,
        )
    try:
        run_server(proxy, host=host, port=port)
    finally:
        sink.close()


@proxy_app.command()
def token(
    execution_ids: Annotated[list[str], typer.Argument(help="Execution id(s) to mint a token for.")],
    file: Annotated[
        Path,
        typer.Option("--file", "-f", envvar="GYRE_PROXY_EXECUTIONS", help="Token file to add to (created 0600)."),
    ],
) -> None:
    """Mint an execution token per id, store it in FILE and print it (one per line) for the harness's env.

    The token never goes on a command line: hand it to the harness as ANTHROPIC_AUTH_TOKEN / OPENAI_API_KEY,
    e.g. `export ANTHROPIC_AUTH_TOKEN=$(gyre proxy token exec-1 -f tokens.toml)`.
    """
    from gyre.auth import TokenError, TokenFile

    store = TokenFile(file)
    try:
        minted = [store.add(execution_id) for execution_id in execution_ids]
    except TokenError as e:
        raise typer.BadParameter(str(e)) from e
    for value in minted:
        typer.echo(value)
