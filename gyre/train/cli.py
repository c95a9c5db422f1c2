"""`gyre train CONFIG`: the single-machine RL loop with live progress and a summary."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from gyre.errors import GyreError
from gyre.observe.summary import step_rows, summary_table
from gyre.run.console import print_phase

if TYPE_CHECKING:
    pass

console = Console()


def train(config: Annotated[Path, typer.Argument(help="TOML run configuration, e.g. examples/tiny-cpu.toml")],
          steps: Annotated[int | None, typer.Option(help="override the number of steps")] = None,
          resume: Annotated[bool, typer.Option(
              "--resume", help="continue the run whose log is in the config's run_dir (same config)")] = False,
          ) -> None:
    """Train a policy with RL on one machine: engine, proxy, harnesses, trajectories, GSPO.

    Ctrl-C stops cleanly with the log committed; `--resume` continues a stopped or crashed run.
    """
    from gyre.config import TrainConfig
    from gyre.train.inprocess import TrainingRun

    try:
        settings = TrainConfig.load(config, {"steps": steps} if steps is not None else None)
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None

    status = console.status("starting the engine, the proxy and the trainer")

    def progress(phase: str, figures: dict) -> None:
        if phase == "rolling":
            status.update(f"step {figures['step']}: {figures['running']} running, {figures['queued']} queued, "
                          f"{figures['done']} done on policy v{figures['version']}")
        elif phase == "training":
            status.update(f"step {figures['step']}: training {figures['micro_steps']} micro-steps")
        elif phase == "resumed":
            console.print(f"[dim]resumed at policy v{figures['version']}: {figures['retrained_steps']} steps "
                          f"retrained from their logged batches, open step aborted: {figures['aborted_step']}[/dim]")
        else:
            print_phase(console, phase, figures)

    console.print(f"[bold]gyre train[/bold] {settings.name}: {settings.steps} steps, "
                  f"{settings.rollout.groups_per_step} groups x {settings.rollout.group_size} rollouts per step, "
                  f"run directory {settings.run_dir}")
    try:
        with status:
            summary = TrainingRun(settings, progress, resume=resume).run()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: harnesses stopped, log committed[/yellow]")
        raise typer.Exit(130) from None
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from None

    console.print(summary_table(step_rows(summary.log), console.width, title=f"{settings.name}: {summary.status}"))
    console.print(f"log: {summary.log}  (final policy v{summary.policy_version})")
    console.print(f'query it: gyre log sql {summary.log} '
                  '"SELECT step, reward_mean, clip_fraction, kl, entropy FROM train_steps"', overflow="fold")


def export(run_dir: Annotated[Path, typer.Argument(help="the run directory (holds log/ and weights/)")],
           out: Annotated[Path, typer.Argument(help="where to write the Hugging Face checkpoint")],
           version: Annotated[int | None, typer.Option(help="policy version (default: the last published)")] = None,
           ) -> None:
    """Write a trained policy as a Hugging Face checkpoint (config, safetensors, tokenizer)."""
    from gyre.trainer.export import export_policy

    try:
        written = export_policy(run_dir, out, version)
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from None
    console.print(f"policy v{written.version} of run {written.run_id} -> {written.path}")
