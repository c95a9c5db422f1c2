"""Exporters: TensorBoard event files and a Weights & Biases offline run, written from scalars.

Both libraries are imported when an exporter is built, not when Gyre is: a run that exports nothing never
loads them. W&B runs in offline mode only (nothing leaves the machine); ``wandb sync DIR`` uploads later.
"""

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from gyre.errors import ConfigError
from gyre.observe.metrics import Scalar

EXPORTERS = ("tensorboard", "wandb")


class Exporter(Protocol):
    def write(self, scalars: Iterable[Scalar]) -> None: ...

    def close(self) -> None:
        """Flush everything written to disk."""
        ...


class TensorBoardExporter:
    """One event file per export under ``directory`` (what ``tensorboard --logdir`` reads)."""

    def __init__(self, directory: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.directory))

    def write(self, scalars: Iterable[Scalar]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for s in scalars:
            summary = Summary(value=[Summary.Value(tag=s.tag, simple_value=s.value)])
            self._writer.add_event(Event(wall_time=s.wall_time, step=s.step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbExporter:
    """A W&B run in offline mode under ``directory``/wandb (system stats, code and git capture off)."""

    def __init__(self, directory: str | Path, *, project: str, name: str, config: dict[str, Any] | None = None
                 ) -> None:
        # wandb.init prints a Weave advert whenever an LLM SDK (openai: the proxy's, the toy agent's) is
        # imported, whatever Settings(silent=True) says: it breaks the CLI's terminal-width table. Its only
        # switch is this variable; a user's own setting wins.
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
        import wandb

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True,
                                  disable_code=True, disable_git=True, save_code=False)
        self._run = wandb.init(mode="offline", dir=str(self.directory), project=project, name=name,
                               config=config or {}, settings=settings, reinit="create_new")
        self._step = -1

    def write(self, scalars: Iterable[Scalar]) -> None:
        rows: dict[int, dict[str, float]] = {}
        for s in scalars:
            rows.setdefault(s.step, {})[s.tag] = s.value
        for step in sorted(rows):
            # W&B steps only move forward: a step already passed is logged at the current one, tagged with its own
            self._step = max(self._step, step)
            self._run.log({**rows[step], "policy_version": step}, step=self._step)

    @property
    def run_dir(self) -> Path:
        return Path(self._run.dir).parent

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() can return before W&B's service process has written the last records; teardown waits for
        # that process to exit, so the offline run file is complete when close() returns
        wandb.teardown()


def make_exporters(names: Sequence[str], run_dir: str | Path, *, run_name: str, project: str = "gyre"
                   ) -> list[Exporter]:
    """Exporters by name, writing under ``run_dir`` (``tensorboard/``, ``wandb/``)."""
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ConfigError(f"unknown exporter(s) {unknown}; choose from {list(EXPORTERS)}")
    run_dir = Path(run_dir)
    out: list[Exporter] = []
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            out.append(TensorBoardExporter(run_dir / "tensorboard"))
        else:
            out.append(WandbExporter(run_dir, project=project, name=run_name))
    return out
