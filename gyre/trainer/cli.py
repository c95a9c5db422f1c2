"""`gyre trainer ...`: the trainer benchmark and a scripted multi-process training run.

The lead registers ``trainer_app`` in ``gyre/cli.py`` (``app.add_typer(trainer_app, name="trainer")``).
"""

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

trainer_app = typer.Typer(no_args_is_help=True, help="GSPO trainer: benchmark, scripted replica runs.")
console = Console()
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of a table")]


@trainer_app.command()
def bench(
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


@trainer_app.command()
def replicas(
    as_json: JsonOpt = False,
    satellites: Annotated[int, typer.Option(help="satellite processes besides the core")] = 1,
    steps: Annotated[int, typer.Option(help="training steps (each over the same micro-batches)")] = 1,
    executions: Annotated[int, typer.Option(help="synthetic executions (groups of 4)")] = 8,
    out: Annotated[Path | None, typer.Option(help="directory for the model, the log and the weights")] = None,
) -> None:
    """Run scripted training steps with a core and satellites in separate processes; show who did what."""
    from gyre.log import LogReader
    from gyre.model import save_tiny
    from gyre.model.tokenizer import VOCAB_SIZE
    from gyre.trainer.config import GSPOConfig, OptimizerConfig, TorchBackendConfig
    from gyre.trainer.replicas import ReplicaRun, run_replicas
    from gyre.trajectory import BatchBuilder, TrajectoryConfig
    from gyre.trajectory.synth import SynthConfig
    from gyre.trajectory.synth_log import synthesize

    if as_json:  # keep stdout one JSON object: no progress bars from transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    root = out or Path(tempfile.mkdtemp(prefix="gyre-trainer-replicas-"))
    synthesize(root / "rollouts", SynthConfig(executions=executions, group_size=4, min_tokens=1_000,
                                              max_tokens=2_000, vocab_size=VOCAB_SIZE))
    step = tuple(BatchBuilder(TrajectoryConfig(cap=5, token_budget=2_048)).from_log(root / "rollouts"))
    run = ReplicaRun(
        model_dir=save_tiny(root / "model"), log_dir=root / "log", out_dir=root / "weights", steps=(step,) * steps,
        backend=TorchBackendConfig(optimizer=OptimizerConfig(lr=1e-4), loss=GSPOConfig()), ready_interval_s=0.2,
    )
    run_replicas(run, satellites=satellites)
    rows: list[dict[str, Any]] = []
    for event in LogReader(run.log_dir).events():
        row = {"kind": event.kind, **{k: v for k, v in event.payload().items() if v is not None and v != ""}}
        for key in ("step", "cell_id"):
            if getattr(event, key) is not None:
                row[key] = getattr(event, key)
        rows.append(row)
    if as_json:
        print(json.dumps({"directory": str(root), "events": rows}, default=str))
        return
    table = Table("kind", "step", "cell", "micro-step", "detail")
    for row in rows:
        detail = {k: v for k, v in row.items() if k not in ("kind", "step", "cell_id", "micro_step")}
        table.add_row(row["kind"], str(row.get("step", "")), str(row.get("cell_id", "")),
                      str(row.get("micro_step", "")), json.dumps(detail, default=str)[:90])
    console.print(table)
    console.print(f"log, model and weights under {root}")
