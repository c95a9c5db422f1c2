"""`gyre sft CONFIG`: the supervised warm start (see gyre.sft.run)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gyre.errors import GyreError

console = Console()


def sft(config: Annotated[Path, typer.Argument(help="the SFT config (TOML), e.g. examples/learn-cpu-sft.toml")],
        resume: Annotated[bool, typer.Option(help="continue the run in its run_dir from its last checkpoint")] = False,
        steps: Annotated[int | None, typer.Option(help="override the steps (no [[phases]])")] = None) -> None:
    """Supervised warm start from demonstrations; writes RUN_DIR/model, an HF checkpoint `gyre train` starts from."""
    from gyre.sft.run import SftConfig, run_sft

    try:
        loaded = SftConfig.load(config, {"steps": steps} if steps is not None else None)

        def show(line: dict) -> None:
            if line.get("phase_starts"):
                console.print(f"phase {line['phase']} from step {line['step']}")
            elif "written_letters" in line:
                console.print(f"step {line['step']:>5}  written letters' loss {line['written_letters']:.3f} "
                              f"(guessing {line['guessing']})")
            elif line["step"] % 10 == 0:
                console.print(f"step {line['step']:>5}  loss {line['loss']:.4f}  grad {line['grad_norm']:.3f}  "
                              f"{line['trained_tokens']}/{line['tokens']} tokens  {line['seconds']:.2f}s")

        out = run_sft(loaded, resume=resume, progress=show)
    except GyreError as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from None
    console.print(f"checkpoint: {out}  (loss curve: {loaded.run_dir / 'loss.jsonl'})")
