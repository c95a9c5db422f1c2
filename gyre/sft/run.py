"""`gyre sft CONFIG`: demonstrations (by the scripted expert, when the file is missing), a base checkpoint
(tokenizer trained on them, random-init model), then supervised steps on assistant tokens only.

Progress: one line per step on the console and in ``RUN_DIR/loss.jsonl`` (the loss curve). Resumable:
``checkpoints/step-N`` (the torch backend's checkpoint: weights, AdamW state, step) every ``checkpoint_every``
steps; ``--resume`` loads the last one and trains the rest with the same batches (each step's batch is drawn
from a generator seeded by the run's seed and the step). The result, ``RUN_DIR/model``, is a Hugging Face
checkpoint directory: ``[engine] model = "RUN_DIR/model"`` starts `gyre train` from it.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
)

from gyre.errors import ConfigError

IGNORE = -100


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DemonstrationsSection(_Section):
    path: Path = Field(description="JSONL of conversations (OpenAI or Anthropic format)")
    tasks: Path | None = Field(None, description="when set and `path` is missing: the task set the scripted "
                                                 "expert demonstrates (gyre.sft.expert) to write `path`")
    per_task: NonNegativeInt = 8
    fresh: NonNegativeInt = Field(0, description="also demonstrate this many new tasks of the training split's "
                                                 "families and files (never a held-out word or number)")
    error_rate: float = Field(0.3, ge=0, le=1, description="share of demonstrations with a wrong answer")
    drills: NonNegativeInt = Field(0, description="short copy drills made at start (gyre.sft.families.drill_tasks: "
                                                  "random letter strings read, rewritten and written, never wrong)")


class ModelSection(_Section):
    base: Path | None = Field(None, description="an HF checkpoint to start from (None: tokenizer trained on the "
                                                "demonstrations + a random-init tiny Qwen2 of the shape below)")
    vocab_size: PositiveInt = 600
    hidden_size: PositiveInt = 128
    layers: PositiveInt = 4
    heads: PositiveInt = 4
    kv_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 512
    context: PositiveInt = 4096


class SftConfig(_Section):
    name: str = "sft"
    run_dir: Path = Path("runs/sft")
    seed: NonNegativeInt = 0
    steps: PositiveInt = 200
    batch_size: PositiveInt = 8
    lr: PositiveFloat = 3e-3
    min_lr: NonNegativeFloat | None = Field(None, description="when set: the lr decays from `lr` to this on a "
                                                             "cosine over the run's steps (None: constant)")
    max_grad_norm: PositiveFloat = 1.0
    drill_share: float = Field(0.0, ge=0, lt=1, description="share of steps that train a batch of drills "
                                                            "instead of demonstrations")
    drill_batch_size: PositiveInt = Field(48, description="conversations in a drill step (a drill is ~1/6 of a "
                                                          "demonstration's tokens)")
    checkpoint_every: PositiveInt = 50
    threads: PositiveInt = 1
    demonstrations: DemonstrationsSection
    model: ModelSection = ModelSection()

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> SftConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read sft config {path}: {e}") from e
        for key, value in (overrides or {}).items():
            *sections, name = key.split(".")
            table = data
            for section in sections:
                table = table.setdefault(section, {})
            table[name] = value
        try:
            config = cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"invalid sft config {path}: {e}") from e
        if config.drill_share > 0 and config.demonstrations.drills == 0:
            raise ConfigError(f"invalid sft config {path}: drill_share = {config.drill_share} needs "
                              "[demonstrations] drills > 0")
        return config

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (a function of the step alone, so a resumed run takes the same steps)."""
        if self.min_lr is None:
            return self.lr
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * step / self.steps))


def _base(config: SftConfig, records: list[dict[str, Any]]) -> Path:
    """The checkpoint training starts from (built once per run directory)."""
    if config.model.base is not None:
        return config.model.base
    base = config.run_dir / "base"
    if not (base / "config.json").is_file():
        from gyre.model import build_tokenizer
        from gyre.sft.checkpoint import save_base
        from gyre.sft.data import conversation

        renderer = build_tokenizer()  # the same template; bytes only, to get the texts the BPE learns from
        texts = [renderer.apply_chat_template(m, tools=t, tokenize=False) for m, t in map(conversation, records)]
        m = config.model
        save_base(base, texts, vocab_size=m.vocab_size, seed=config.seed, hidden_size=m.hidden_size,
                  layers=m.layers, heads=m.heads, kv_heads=m.kv_heads, intermediate_size=m.intermediate_size,
                  context=m.context)
    return base


def _drills(config: SftConfig, tokenizer: Any) -> list[Any]:
    """The run's copy drills, rendered (made from the run's seed: the same drills on a resume)."""
    if config.demonstrations.drills == 0:
        return []
    from gyre.sft.data import render
    from gyre.sft.expert import Expert
    from gyre.sft.families import drill_tasks

    expert = Expert(seed=config.seed)
    return [render(expert.drill(task), tokenizer) for task in drill_tasks(config.demonstrations.drills, config.seed)]


def run_sft(config: SftConfig, *, resume: bool = False,
            progress: Callable[[dict[str, Any]], None] = lambda line: None) -> Path:
    """Train; returns the HF checkpoint directory written (``RUN_DIR/model``)."""
    import torch

    from gyre.model.tiny import load_tiny
    from gyre.sft.data import read_records, render
    from gyre.trainer import TorchBackend
    from gyre.trainer.config import OptimizerConfig, TorchBackendConfig

    run_dir = config.run_dir
    if run_dir.exists() and not resume:
        raise ConfigError(f"{run_dir} exists: pass --resume to continue that run, or remove it")
    run_dir.mkdir(parents=True, exist_ok=True)
    demos = config.demonstrations
    if not demos.path.is_file():
        if demos.tasks is None:
            raise ConfigError(f"no demonstrations at {demos.path} and no [demonstrations] tasks to write them from")
        from gyre.sft.expert import write_demonstrations

        write_demonstrations(demos.tasks, demos.path, per_task=demos.per_task, seed=config.seed,
                             error_rate=demos.error_rate, fresh=demos.fresh)
    records = read_records(demos.path)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    base = _base(config, records)
    model, tokenizer = load_tiny(base)
    examples = [render(r, tokenizer) for r in records]
    drills = _drills(config, tokenizer)
    backend = TorchBackend(model, TorchBackendConfig(optimizer=OptimizerConfig(
        lr=config.lr, max_grad_norm=config.max_grad_norm)))
    checkpoints = run_dir / "checkpoints"
    done = sorted(checkpoints.glob("step-*[0-9]")) if resume else []
    start = 0
    if done:
        backend.load_checkpoint(done[-1])
        start = backend.policy_version  # = steps trained
    curve = run_dir / "loss.jsonl"
    kept = [line for line in (curve.read_text().splitlines() if curve.exists() else [])
            if json.loads(line)["step"] < start]
    curve.write_text("".join(line + "\n" for line in kept))
    pad = tokenizer.pad_token_id
    with curve.open("a") as log:
        for step in range(start, config.steps):
            started = time.monotonic()
            rng = random.Random(config.seed * 1_000_003 + step)
            drilling = config.drill_share > 0 and rng.random() < config.drill_share
            pool, size = (drills, config.drill_batch_size) if drilling else (examples, config.batch_size)
            batch = [pool[rng.randrange(len(pool))] for _ in range(size)]
            width = max(len(e.input_ids) for e in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, e in enumerate(batch):
                n = len(e.input_ids)
                ids[row, :n] = torch.tensor(e.input_ids)
                attention[row, :n] = 1
                labels[row, :n] = torch.where(torch.tensor(e.assistant), torch.tensor(e.input_ids), IGNORE)
            for group in backend.optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            backend.model.train()
            loss = backend.model(input_ids=ids, attention_mask=attention, labels=labels).loss
            loss.backward()
            result = backend.optimizer_step(normalizer=1.0)  # the loss is already a mean over assistant tokens
            line = {"step": step, "batch": "drills" if drilling else "demonstrations",
                    "loss": round(float(loss.detach()), 5), "grad_norm": round(result.grad_norm, 4),
                    "lr": config.lr_at(step),
                    "tokens": int(attention.sum()), "trained_tokens": int((labels != IGNORE).sum()),
                    "seconds": round(time.monotonic() - started, 3)}
            log.write(json.dumps(line) + "\n")
            log.flush()
            progress(line)
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                backend.save_checkpoint(checkpoints / f"step-{step + 1:06d}")
    out = run_dir / "model"
    if out.exists():
        shutil.rmtree(out)
    backend.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
