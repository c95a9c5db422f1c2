"""`gyre sft CONFIG`: demonstrations (by the scripted expert, when the file is missing), a base checkpoint
(tokenizer trained on them, random-init model), then supervised steps on assistant tokens only.

Progress: one line per step on the console and in ``RUN_DIR/loss.jsonl`` (the loss curve). Resumable:
``checkpoints/step-N`` (the torch backend's checkpoint: weights, AdamW state, step) every ``checkpoint_every``
steps; ``--resume`` loads the last one and trains the rest with the same batches (each step's batch is drawn
from a generator seeded by the run's seed and the step). The result, ``RUN_DIR/model``, is a Hugging Face
checkpoint directory: ``[engine] model = "RUN_DIR/model"`` starts `gyre train` from it.

A curriculum (``[[phases]]``) runs its phases in order, each with its own steps, lr and share of copy drills; a
phase with ``until_written_loss`` ends at the first written-letter check under it (`gyre.sft.copying`), an end
recorded in ``RUN_DIR/phase_ends.jsonl`` so that a resume knows where each phase began (issue #29: the model
learns to copy only on drills alone, then keeps it through the demonstrations).
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
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from gyre.errors import ConfigError
from gyre.sft.families import COMMAND_FAMILIES, COPYING_FAMILIES, DRILL_FAMILIES, FAMILIES

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
    error_rates: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict, description="a family's own share of wrong answers, in place of `error_rate` (e.g. "
                                          "{ concat = 0.2 }: a family the policy rarely solves slips less, so RL "
                                          "has right answers in its groups to learn from)")
    drills: NonNegativeInt = Field(0, description="short copy drills made at start (gyre.sft.families.drill_tasks: "
                                                  "random letter strings read, rewritten and written, never wrong)")
    reads: NonNegativeInt = Field(0, description="first-read drills made at start (`Expert.first_read`: system "
                                                 "prompt, tools, a training task's prompt, the call reading the "
                                                 "file it names); a phase trains them with `read_share`")
    other_names: float = Field(0.0, ge=0, le=1, description=(
        "share of the fresh tasks, drills and first-read drills whose input file has a random name "
        "(gyre.sft.families.other_name) instead of the training split's: the policy learns to read the file the "
        "prompt names, not the file its family is usually paired with (the held-out pairs stay unseen). "
        "Measured at 0.5 (#29, thirteenth attempt): held-out copy of data.txt 0 -> 83% after RL, but the "
        "policy then invents a name for upper of word.txt (50 -> 0%); off in make demo-learn"))
    commands: tuple[str, ...] = Field(
        ("add",), description="the families the expert solves with a shell command writing the answer file "
                              "(gyre.sft.expert.COMMAND_FAMILIES: add's awk always; reverse's rev, concat's paste) "
                              "in demonstrations and drills, instead of writing the answer letter by letter")
    drill_families: tuple[str, ...] = Field(
        DRILL_FAMILIES,
        description="the families the drills exercise (gyre.sft.families.COPYING_FAMILIES: pyfunc's drills copy "
                    "its K, a digit)")

    @model_validator(mode="after")
    def _known_drills(self) -> DemonstrationsSection:
        if not self.drill_families or set(self.drill_families) - set(COPYING_FAMILIES):
            raise ValueError(f"drill_families {list(self.drill_families)}: name one or more of "
                             f"{', '.join(COPYING_FAMILIES)} (a drill copies its input)")
        if unknown := set(self.error_rates) - set(FAMILIES):
            raise ValueError(f"error_rates {sorted(unknown)}: name families of {', '.join(FAMILIES)}")
        if "add" not in self.commands or set(self.commands) - set(COMMAND_FAMILIES):
            raise ValueError(f"commands {list(self.commands)}: add and any of "
                             f"{', '.join(f for f in COMMAND_FAMILIES if f != 'add')} (the expert's commands)")
        return self


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


class Phase(_Section):
    """One stage of a curriculum (`[[phases]]`): its steps, learning rate and mix of drills."""

    name: str = Field(min_length=1)
    steps: PositiveInt = Field(description="the phase's steps (its cap when `until_written_loss` is set)")
    lr: PositiveFloat
    min_lr: NonNegativeFloat | None = Field(None, description="when set: the lr decays from `lr` to this on a "
                                                             "cosine over the phase's steps (None: constant)")
    drill_share: float = Field(0.0, ge=0, le=1, description="share of steps that train a batch of drills "
                                                            "instead of demonstrations (1: drills only)")
    read_share: float = Field(0.0, ge=0, le=1, description="share of steps that train a batch (`batch_size`) of "
                                                           "first-read drills instead of demonstrations")
    until_written_loss: PositiveFloat | None = Field(
        None, description="end the phase early once the written letters' loss on held-back drills "
                          "(gyre.sft.copying) is under this; checked every `check_every` steps of the phase")
    check_every: PositiveInt | None = Field(None, description="measure the written letters' loss every N steps "
                                                              "of the phase (RUN_DIR/copy_checks.jsonl); "
                                                              "None: 50 with `until_written_loss`, else never")

    @model_validator(mode="after")
    def _shares(self) -> Phase:
        if self.drill_share + self.read_share > 1:
            raise ValueError(f"phase {self.name!r}: drill_share {self.drill_share} + read_share {self.read_share} "
                             "is over 1 (both are shares of the phase's steps)")
        return self

    @property
    def checks(self) -> int | None:
        """Steps between the phase's written-letter checks (None: no check)."""
        return self.check_every or (50 if self.until_written_loss is not None else None)

    def lr_at(self, step: int) -> float:
        """The learning rate of the phase's ``step``-th step (a function of the step alone: a resume takes the
        same steps)."""
        if self.min_lr is None:
            return self.lr
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * step / self.steps))


_PER_PHASE = ("steps", "lr", "min_lr", "drill_share", "read_share")


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
    read_share: float = Field(0.0, ge=0, le=1, description="share of steps that train a batch of first-read drills "
                                                           "instead of demonstrations")
    drill_batch_size: PositiveInt = Field(48, description="conversations in a drill step (a drill is ~1/6 of a "
                                                          "demonstration's tokens)")
    phases: list[Phase] = Field(default_factory=list, description="a curriculum, run in order (`[[phases]]`); "
                                                                  "empty: one phase of the top-level steps, lr, "
                                                                  "min_lr, drill_share and read_share")
    checkpoint_every: PositiveInt = 50
    threads: PositiveInt = 1
    demonstrations: DemonstrationsSection
    model: ModelSection = ModelSection()

    @model_validator(mode="after")
    def _consistent(self) -> SftConfig:
        if self.phases:
            if clash := [f for f in _PER_PHASE if f in self.model_fields_set]:
                raise ValueError(f"{', '.join(clash)} set at the top level and [[phases]] given: with phases, set "
                                 f"{', '.join(_PER_PHASE)} in each phase")
            names = [p.name for p in self.phases]
            if len(set(names)) != len(names):
                raise ValueError(f"phase names must be unique: {names}")
        plan = self.plan()  # the top-level fields' phase is checked here too, not when the run starts
        if self.demonstrations.drills == 0:
            for phase in plan:
                if phase.drill_share > 0:
                    raise ValueError(f"drill_share = {phase.drill_share} (phase {phase.name!r}) needs "
                                     "[demonstrations] drills > 0")
        if self.demonstrations.reads == 0:
            for phase in plan:
                if phase.read_share > 0:
                    raise ValueError(f"read_share = {phase.read_share} (phase {phase.name!r}) needs "
                                     "[demonstrations] reads > 0")
        return self

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
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"invalid sft config {path}: {e}") from e

    def plan(self) -> list[Phase]:
        """The phases the run trains, in order."""
        return self.phases or [Phase(name="sft", steps=self.steps, lr=self.lr, min_lr=self.min_lr,
                                     drill_share=self.drill_share, read_share=self.read_share)]

    def lr_at(self, step: int) -> float:
        """The learning rate of the run's ``step`` when no phase ends early."""
        local = step
        for phase in self.plan():
            if local < phase.steps:
                return phase.lr_at(local)
            local -= phase.steps
        raise ValueError(f"step {step} is past the run's last phase")


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

    demos = config.demonstrations
    expert = Expert(seed=config.seed, commands=demos.commands)
    return [render(expert.drill(task), tokenizer)
            for task in drill_tasks(demos.drills, config.seed, demos.drill_families, demos.other_names)]


def _reads(config: SftConfig, tokenizer: Any) -> list[Any]:
    """The run's first-read drills, rendered: fresh training-split tasks (never a held-out word or number), from
    the run's seed + 1 (other tasks than the demonstrations' fresh ones, made from the seed)."""
    if config.demonstrations.reads == 0:
        return []
    from gyre.sft.data import render
    from gyre.sft.expert import Expert
    from gyre.sft.families import fresh_training_tasks

    expert = Expert(seed=config.seed, commands=config.demonstrations.commands)
    return [render(expert.first_read(task), tokenizer)
            for task in fresh_training_tasks(config.demonstrations.reads, config.seed + 1,
                                             config.demonstrations.other_names)]


EARLY_ENDS = "phase_ends.jsonl"
"""Phases that ended before their steps (`until_written_loss`): ``{"phase", "end"}`` per line."""
COPY_CHECKS = "copy_checks.jsonl"
"""The written-letter checks of phases with `check_every` or `until_written_loss` (gyre.sft.copying)."""


def _kept(path: Path, start: int, *, after_step: bool = False) -> Path:
    """``path`` (a JSONL of ``step``-keyed lines) cut to what the checkpoint resumed from (``start`` steps done)
    had seen: lines of the steps before ``start``, or with ``after_step`` (``step`` counts the steps done, a
    check of the weights after them) up to and including ``start``."""
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if json.loads(line)["step"] < start + after_step]
    path.write_text("".join(line + "\n" for line in kept))
    return path


def _early_ends(path: Path, plan: list[Phase], start: int) -> dict[str, int]:
    """Per phase, the step it ended at early, as far as the checkpoint resumed from (``start``) knows."""
    names = {p.name for p in plan}
    ends: dict[str, int] = {}
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record["end"] > start:
            continue
        if record["phase"] not in names:
            raise ConfigError(f"{path}: phase {record['phase']!r} ended early in this run but is not in the "
                              f"config's phases {sorted(names)}")
        ends[record["phase"]] = record["end"]
        kept.append(line)
    if path.exists():
        path.write_text("".join(line + "\n" for line in kept))
    return ends


def _train_step(backend: Any, batch: list[Any], pad: int, lr: float) -> dict[str, Any]:
    """One optimizer step on ``batch`` (rendered examples, right-padded) at ``lr``: mean loss over its assistant
    tokens; the loss curve's figures."""
    import torch

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
        group["lr"] = lr
    backend.model.train()
    loss = backend.model(input_ids=ids, attention_mask=attention, labels=labels).loss
    loss.backward()
    result = backend.optimizer_step(normalizer=1.0)  # the loss is already a mean over assistant tokens
    return {"loss": round(float(loss.detach()), 5), "grad_norm": round(result.grad_norm, 4), "lr": lr,
            "tokens": int(attention.sum()), "trained_tokens": int((labels != IGNORE).sum())}


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
                             error_rate=demos.error_rate, fresh=demos.fresh,
                             other_names=demos.other_names, commands=demos.commands,
                             error_rates=demos.error_rates)
    records = read_records(demos.path)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    base = _base(config, records)
    model, tokenizer = load_tiny(base)
    examples = [render(r, tokenizer) for r in records]
    drills = _drills(config, tokenizer)
    reads = _reads(config, tokenizer)
    backend = TorchBackend(model, TorchBackendConfig(optimizer=OptimizerConfig(
        lr=config.plan()[0].lr, max_grad_norm=config.max_grad_norm)))
    checkpoints = run_dir / "checkpoints"
    done = sorted(checkpoints.glob("step-*[0-9]")) if resume else []
    start = 0
    if done:
        backend.load_checkpoint(done[-1])
        start = backend.policy_version  # = steps trained
    plan = config.plan()
    early = _early_ends(run_dir / EARLY_ENDS, plan, start)
    curve = _kept(run_dir / "loss.jsonl", start)
    checks = _kept(run_dir / COPY_CHECKS, start, after_step=True)
    pad = tokenizer.pad_token_id
    step, phase_start = start, 0
    with curve.open("a") as log, checks.open("a") as check_log:
        for phase in plan:
            end = early.get(phase.name, phase_start + phase.steps)
            if step >= end:
                phase_start = end
                continue
            if step == phase_start:
                progress({"step": step, "phase": phase.name, "phase_starts": True})
            while step < end:
                started = time.monotonic()
                local = step - phase_start
                rng = random.Random(config.seed * 1_000_003 + step)
                # no draw in a phase of demonstrations only: its batches stay those it drew before reads existed
                draw = rng.random() if phase.drill_share + phase.read_share > 0 else 1.0
                kind = ("drills" if draw < phase.drill_share else
                        "reads" if draw < phase.drill_share + phase.read_share else "demonstrations")
                pool, size = {"drills": (drills, config.drill_batch_size), "reads": (reads, config.batch_size),
                              "demonstrations": (examples, config.batch_size)}[kind]
                batch = [pool[rng.randrange(len(pool))] for _ in range(size)]
                line = {"step": step, "phase": phase.name, "batch": kind,
                        **_train_step(backend, batch, pad, phase.lr_at(local)),
                        "seconds": round(time.monotonic() - started, 3)}
                log.write(json.dumps(line) + "\n")
                log.flush()
                progress(line)
                step += 1
                if phase.checks is not None and (step - phase_start) % phase.checks == 0:
                    from gyre.sft.copying import written_letter_loss

                    check = {"step": step, "phase": phase.name, **written_letter_loss(backend.model, tokenizer)}
                    check_log.write(json.dumps(check) + "\n")
                    check_log.flush()
                    progress(check)
                    if phase.until_written_loss is not None and check["written_letters"] < phase.until_written_loss \
                            and step < end:
                        end = step
                        # recorded before the checkpoint: a resume from an earlier one drops it and decides again
                        with (run_dir / EARLY_ENDS).open("a") as ends:
                            ends.write(json.dumps({"phase": phase.name, "end": step}) + "\n")
                if step % config.checkpoint_every == 0 or step == end:
                    backend.save_checkpoint(checkpoints / f"step-{step:06d}")
            phase_start = end
    out = run_dir / "model"
    if out.exists():
        shutil.rmtree(out)
    backend.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
