"""The benchmark commands (`gyre log bench`, `gyre proxy bench`, `gyre trainer bench`).

`gyre.cli` adds them to the `log`, `proxy` and `trainer` sub-apps: the packages they measure sit below the
benchmarks and never import them. Each command imports its benchmark when it runs.
"""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

console = Console()
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of a table")]


def log_bench(
    as_json: JsonOpt = False,
    quick: Annotated[bool, typer.Option("--quick", help="a seconds-long run")] = False,
    directory: Annotated[Path | None, typer.Option("--dir", help="where to write (default: a temp dir "
                                                   "under the current directory's disk)")] = None,
    kill_points: Annotated[int | None, typer.Option(
        help="kill -9 crash points to run (default: 1000, or 0 with --quick)")] = None,
    ab: Annotated[bool, typer.Option(
        "--ab", help="only compare the old writer (frame format v0) with the current one, alternating "
                     "in one run")] = False,
    rounds: Annotated[int, typer.Option(min=1, help="rounds per writer with --ab (medians)")] = 10,
) -> None:
    """Measure the log's durable throughput, commit latency, replay and recovery speed."""
    from benchmarks.log_bench import run_ab, run_benchmark

    if ab:
        results = run_ab(quick=quick, directory=directory, rounds=rounds)
    else:
        if kill_points is None:
            kill_points = 0 if quick else 1000
        results = run_benchmark(quick=quick, directory=directory, kill_points=kill_points)
    if as_json:
        print(json.dumps(results))
        return
    table = Table("metric", "value")
    for key, value in results.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)


def proxy_bench(
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
    breakdown = results["breakdown_p50_1_session"]
    typer.echo("p50 at 1 session, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()))
    for name, server in results["servers"].items():
        sat = server["saturated"]
        levels = ", ".join(f"{s} sessions p50 +{r['p50_added_ms']:.2f} p99 +{r['p99_added_ms']:.2f} ms"
                           for s, r in server["concurrency"].items())
        typer.echo(f"{name}: saturated {sat['calls_per_s']:.0f} calls/s, {sat['cpu_ms_per_call']:.2f} ms CPU/call; "
                   + levels)
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


def trainer_bench(
    as_json: JsonOpt = False,
    quick: Annotated[bool, typer.Option("--quick", help="a seconds-long run: tiny runs, one repeat")] = False,
    executions: Annotated[int | None, typer.Option(help="executions per synthetic run (default 8, quick 4)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="synthetic tokens per execution at most")] = None,
    repeats: Annotated[int | None, typer.Option(help="timed passes per form; the best counts")] = None,
    attn: Annotated[str | None, typer.Option(help="tree (default: sparse tree attention), or HF eager / sdpa "
                                                  "over a dense mask")] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads (default 1)")] = None,
    seed: int = 0,
    demo_log: Annotated[Path | None, typer.Option(help="log of a `gyre train examples/tiny-cpu.toml` run: "
                                                      "compare attentions and tokens on its micro-batches")] = None,
    demo_config: Annotated[Path, typer.Option(help="the demo's config")] = Path("examples/tiny-cpu.toml"),
    memory: Annotated[bool, typer.Option("--memory", help="train one group of --rollouts sharing a "
                                                           "--prompt-tokens prompt; measure peak memory")] = False,
    prompt_tokens: int = 49_152,
    rollouts: int = 16,
) -> None:
    """Forward-backward time and forwarded/trained tokens: expanded vs tree-packed micro-batches of one
    synthetic run, and optionally the demo's micro-batches and a group-shared 49K-token prompt."""
    from benchmarks.trainer_bench import ATTENTION, run_benchmark

    if attn not in (None, *ATTENTION):
        raise typer.BadParameter(f"--attn must be one of {', '.join(ATTENTION)}")
    results = run_benchmark(quick=quick, executions=executions, max_tokens=max_tokens, seed=seed,
                            repeats=repeats, attn=attn, threads=threads, demo_log=demo_log, demo_config=demo_config,
                            memory=memory, prompt_tokens=prompt_tokens, rollouts=rollouts)
    if as_json:
        print(json.dumps(results))
        return
    table = Table("workload", "form", "forwarded", "trained", "fwd/trained", "attended pairs", "CPU s", "wall s",
                  "speed-up")
    for w in results["workloads"]:
        for form in ("expanded", "packed"):
            r = w[form]
            speedup = f"{w['speedup_packed_vs_expanded']:.2f}x" if form == "packed" else ""
            table.add_row(w["workload"], form, str(r["tokens"]), str(r["trained_tokens"]),
                          f"{r['forwarded_per_trained']:.1f}", f"{r['attended_pairs']:.3g}", f"{r['cpu_s']:.2f}",
                          f"{r['wall_s']:.2f}", speedup)
    console.print(table)
    if "demo" in results:
        d = results["demo"]
        a = d["attention"]
        console.print(f"demo: {d['forwarded_tokens']} forwarded / {d['trained_tokens']} trained tokens "
                      f"({d['forwarded_per_trained']:.1f} per trained; {d['forwarded_per_trained_unshared']:.1f} "
                      f"without shared prefixes: {d['forwarded_per_trained_cut']:.2f}x cut); tree attention "
                      f"{a['speedup_tree_vs_eager']:.2f}x eager, float64 gradient diff "
                      f"{a['grad_max_abs_diff_float64']:.1e}")
    if "memory" in results:
        m = results["memory"]
        big = m["runs"][-1]
        console.print(f"memory: {big['rollouts']} rollouts x {big['prompt_tokens']}-token prompt: "
                      f"{big['forwarded_tokens']} forwarded of {big['row_tokens']} row tokens, peak +"
                      f"{big['peak_rss_growth_bytes'] / 2**30:.2f} GiB (bound at budget {m['token_budget']}: "
                      f"{m['bound_bytes_at_budget'] / 2**30:.2f} GiB), {big['cpu_s']:.0f} CPU s")
    console.print(f"settings: {results['settings']}")
