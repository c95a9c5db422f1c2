"""Trainer benchmark: forward-backward time of expanded vs tree-packed micro-batches from one synthetic run.

Usage::

    python benchmarks/trainer_bench.py [--quick] [--executions 8] [--max-tokens 8000] [--repeats 3]
                                       [--attn eager|sdpa] [--threads N] [--seed 0]

For each workload a run is synthesised once (``gyre.trajectory.synth``, the tiny model's vocabulary), and
both batch forms are built from that same log at cap 5. The torch backend (tiny Qwen2, float32, CPU) then
runs forward-backward over every micro-batch of each form, alternating which form goes first, ``repeats``
times. Each run is timed twice: wall clock, and this process's CPU time (user + system), which other
processes on a shared machine disturb far less; with one torch thread (the default here) CPU time is the
work done. The best of the repeats counts for each. The two forms must give the same loss (checked), since
they train the same tokens with the same weights.

Besides times, each form reports its forward tokens, its attention area (score entries an eager or SDPA
kernel computes, padding and masked pairs included) and its attended pairs (the entries the tree or causal
mask allows: what a block-sparse kernel would compute), so a speed-up can be read against the work saved.

Workloads: ``default`` is the synthetic run as ``gyre trajectories synth`` makes it; ``retry-heavy`` raises
the per-call retry rate from 0.6% to 10%, so that kept trajectories share long prefixes (the regime where
tree packing pays: retries, context edits, parallel samples of one turn). Prints one JSON object.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOADS = {"default": None, "retry-heavy": 0.10}
"""Workload name -> per-call retry rate (``None``: the synthesiser's default)."""


def _batches(log: Path, form: str) -> tuple[list[Any], dict[str, Any]]:
    from gyre.trainer import TrainBatch
    from gyre.trajectory import BatchBuilder, TrajectoryConfig

    builder = BatchBuilder(TrajectoryConfig(cap=5, form=form))  # type: ignore[arg-type]
    batches = [TrainBatch.from_micro_batch(m) for m in builder.from_log(log)]
    return batches, builder.report.to_dict()


def _shape(batches: list[Any], max_tokens: int, max_area: int) -> dict[str, int]:
    from gyre.trainer import passes

    groups = [g for b in batches for g in passes.plan(b, max_tokens, max_area)]
    return {
        "micro_batches": len(batches),
        "tokens": sum(b.tokens for b in batches),
        "trained_tokens": sum(b.trained_tokens for b in batches),
        "attention_blocks": sum(int(b.blocks.shape[0]) for b in batches),
        "passes": len(groups),
        "padded_tokens": sum(g.padded_tokens for g in groups),
        "attention_area": sum(g.attention_area for g in groups),
        "attended_pairs": sum(int(g.allowed.sum()) - (g.padded_tokens - _real(g, b)) for b in batches
                              for g in passes.plan(b, max_tokens, max_area)),
    }


def _real(group: Any, batch: Any) -> int:
    return sum(int(batch.blocks[i, 1] - batch.blocks[i, 0]) for i in group.blocks)


def _time(backend: Any, batches: list[Any]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and the summed loss of one forward-backward over ``batches``."""
    backend.zero_grad()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = sum(backend.forward_backward(b).stats.loss_sum for b in batches)
    return time.perf_counter() - wall, time.process_time() - cpu, loss


def run_workload(
    name: str, retry_rate: float | None, *, executions: int, max_tokens: int, seed: int, repeats: int,
    attn: str | None, directory: Path,
) -> dict[str, Any]:
    from gyre.model import build_tiny_model
    from gyre.model.tokenizer import VOCAB_SIZE
    from gyre.trainer import TorchBackend, TorchBackendConfig
    from gyre.trajectory.synth import SynthConfig
    from gyre.trajectory.synth_log import synthesize

    extra = {} if retry_rate is None else {"retry_rate": retry_rate}
    if max_tokens < 2_200:
        raise ValueError(f"max_tokens must be >= 2200 (executions span max_tokens / 2 to max_tokens), got {max_tokens}")
    synth = SynthConfig(executions=executions, group_size=executions, seed=seed, min_tokens=min(2_000, max_tokens // 2),
                        max_tokens=max_tokens, vocab_size=VOCAB_SIZE, **extra)
    log = directory / name
    summary = synthesize(log, synth)
    config = TorchBackendConfig(dtype="float32", attn_implementation=attn)
    forms = {form: _batches(log, form) for form in ("packed", "expanded")}
    if not forms["packed"][0]:
        raise ValueError(f"the {name} run left nothing to train (every execution excluded); use more executions")
    backend = TorchBackend(build_tiny_model(0), config)
    _time(backend, forms["packed"][0][:1])  # warm-up: allocator, kernels
    wall = {form: float("inf") for form in forms}
    cpu = dict(wall)
    losses: dict[str, float] = {}
    for r in range(repeats):
        for form in (("packed", "expanded") if r % 2 == 0 else ("expanded", "packed")):
            seconds, cpu_seconds, losses[form] = _time(backend, forms[form][0])
            wall[form], cpu[form] = min(wall[form], seconds), min(cpu[form], cpu_seconds)
    backend.zero_grad()
    shapes = {form: _shape(batches, config.max_forward_tokens, config.max_attention_area)
              for form, (batches, _) in forms.items()}
    report = forms["packed"][1]
    return {
        "workload": name,
        "retry_rate": synth.retry_rate,
        "run": {"executions": executions, "log_tokens": summary.tokens, "model_calls": summary.model_calls,
                "trajectories_kept": report["trajectories_kept"], "retries": summary.retries},
        **{form: {**shapes[form], "wall_s": wall[form], "cpu_s": cpu[form],
                  "tokens_per_cpu_s": shapes[form]["tokens"] / cpu[form]} for form in ("packed", "expanded")},
        "speedup_packed_vs_expanded": cpu["expanded"] / cpu["packed"],
        "speedup_wall": wall["expanded"] / wall["packed"],
        "token_reduction": 1 - shapes["packed"]["tokens"] / shapes["expanded"]["tokens"],
        "attention_area_reduction": 1 - shapes["packed"]["attention_area"] / shapes["expanded"]["attention_area"],
        "attended_pairs_reduction": 1 - shapes["packed"]["attended_pairs"] / shapes["expanded"]["attended_pairs"],
        "loss_packed": losses["packed"],
        "loss_expanded": losses["expanded"],
        "same_loss": abs(losses["packed"] - losses["expanded"]) <= 1e-4 * max(1.0, abs(losses["expanded"])),
        "goal_2x_met": cpu["expanded"] / cpu["packed"] >= 2.0,
    }


def run_benchmark(
    *, quick: bool = False, executions: int | None = None, max_tokens: int | None = None, seed: int = 0,
    repeats: int | None = None, attn: str | None = None, threads: int | None = None,
    workloads: tuple[str, ...] = tuple(WORKLOADS),
) -> dict[str, Any]:
    """Both workloads, both forms; returns one JSON-able dict (settings, then one entry per workload)."""
    import torch

    torch.set_num_threads(threads or 1)
    settings = {
        "executions": executions or (4 if quick else 8),
        "max_tokens": max_tokens or (3_000 if quick else 8_000),
        "repeats": repeats or (1 if quick else 3),
        "seed": seed,
        "attn_implementation": attn or "eager (the tiny model's)",
        "threads": torch.get_num_threads(),
        "cap": 5,
        "dtype": "float32",
    }
    directory = Path(tempfile.mkdtemp(prefix="gyre-trainer-bench-"))
    try:
        results = [
            run_workload(name, WORKLOADS[name], executions=settings["executions"], max_tokens=settings["max_tokens"],
                         seed=seed, repeats=settings["repeats"], attn=attn, directory=directory)
            for name in workloads
        ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"settings": settings, "workloads": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--executions", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn", choices=["eager", "sdpa"])
    parser.add_argument("--threads", type=int, help="torch threads (default 1: CPU time is then the work done)")
    args = parser.parse_args()
    print(json.dumps(run_benchmark(quick=args.quick, executions=args.executions, max_tokens=args.max_tokens,
                                   seed=args.seed, repeats=args.repeats, attn=args.attn, threads=args.threads),
                     indent=2))


if __name__ == "__main__":
    main()
