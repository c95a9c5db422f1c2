"""`gyre export RUN DIR --version V`: a trained policy as a Hugging Face checkpoint.

The weights come from the durable file `weights_published` names (its checksum checked), the architecture
and tokenizer from the run's recorded config (the tiny model built from its seed, or the checkpoint
directory the run started from); version 0 is the starting model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config import TrainConfig
from gyre.errors import ConfigError
from gyre.events.models import RunStarted
from gyre.log import LogReader
from gyre.state import RunView, replay
from gyre.trainer.weights import WeightStore


@dataclass(frozen=True)
class Exported:
    run_id: str
    version: int
    path: Path


def export_policy(run_dir: str | Path, out: str | Path, version: int | None = None) -> Exported:
    run_dir, out = Path(run_dir), Path(out)
    log = run_dir / "log"
    if not log.is_dir():
        raise ConfigError(f"{run_dir} holds no run log (expected {log})")
    start = next(LogReader(log).events(to_seq=0), None)
    if not isinstance(start, RunStarted):
        raise ConfigError(f"{log} does not begin with run_started")
    config = TrainConfig.model_validate_json(start.config)
    published = replay(RunView(), log)[0].published
    if version is None:
        version = max(published, default=0)
    tensors = None
    if version:
        if version not in published:
            raise ConfigError(f"run {start.run_id} published no version {version}; it has {sorted(published)}")
        record = published[version]
        tensors = WeightStore(run_dir).load(record.location, record.sha256)
    write_checkpoint(config, tensors, out, version)
    return Exported(start.run_id, version, out)


def write_checkpoint(config: TrainConfig, tensors: Mapping[str, Any] | None, out: Path, version: int) -> Path:
    """The run's model (``config.engine.model``: tiny from its seed, or a checkpoint directory) with
    ``tensors`` loaded (None: the starting weights), written to ``out`` as a Hugging Face checkpoint."""
    from gyre.engine.local import LocalEngineConfig
    from gyre.engine.local.engine import load_model

    model, tokenizer = load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))
    if tensors is not None:
        missing, unexpected = model.load_state_dict(dict(tensors), strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise ConfigError(f"weights v{version} do not fit the run's model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
