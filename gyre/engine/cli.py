"""`gyre engine ...` commands (registered by `gyre.cli` as the `engine` sub-app)."""

from __future__ import annotations

import typer

engine_app = typer.Typer(help="Run the local CPU inference engine (SGLang native API subset).", no_args_is_help=True)


@engine_app.callback()
def _engine() -> None:
    """Run the local CPU inference engine (SGLang native API subset)."""  # keeps `serve` a subcommand


@engine_app.command()
def serve(
    model: str = typer.Option("tiny", help='"tiny" (built in code from --seed) or a Qwen2 checkpoint directory.'),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    advertise: str = typer.Option("", help="Address other engines reach this one's KV transfer endpoint at "
                                  "(default: --host; required when --host is a wildcard)."),
    port: int = typer.Option(30000, min=0, help="TCP port (0: a free one). The URL served is printed on stdout "
                             "once bound."),
    seed: int = typer.Option(0, help="Seed of the tiny model's weights and of unseeded sampling."),
    threads: int = typer.Option(1, help="torch CPU threads."),
    max_running_requests: int = typer.Option(64, help="Sequences decoded together at most."),
    max_step_tokens: int = typer.Option(2048, help="Tokens per forward step (prefill chunk budget)."),
    cache_tokens: int = typer.Option(131072, help="Prefix-cache capacity in tokens (0 disables it)."),
    kv_page_size: int = typer.Option(16, min=1, help="Tokens per KV page, the unit of KV migration (/gyre/kv/*)."),
    kv_pool_tokens: int | None = typer.Option(
        None, min=0, help="Tokens of KV memory populated at start for imported KV (default: the model's context "
        "length; 0: no pool, imports map fresh memory)."),
) -> None:
    """Serve /generate and the admin endpoints until interrupted."""
    from gyre.engine.local import LocalEngine, LocalEngineConfig, SchedulerConfig
    from gyre.engine.local import serve as run_server
    from gyre.transfer import EndpointConfig

    reachable = advertise or host
    if reachable in ("0.0.0.0", "::"):
        raise typer.BadParameter("--host is a wildcard: give --advertise, the address peers reach this engine at",
                                 param_hint="--advertise")
    config = LocalEngineConfig(
        transfer=EndpointConfig(hostname=reachable),
        model=model,
        seed=seed,
        num_threads=threads,
        kv_page_size=kv_page_size,
        kv_pool_tokens=kv_pool_tokens,
        scheduler=SchedulerConfig(
            max_running_requests=max_running_requests,
            max_step_tokens=max_step_tokens,
            cache_capacity_tokens=cache_tokens,
            seed=seed,
        ),
    )
    run_server(LocalEngine(config), host=host, port=port)
