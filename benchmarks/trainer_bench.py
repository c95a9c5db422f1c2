"""Trainer benchmark: forward-backward time and forwarded/trained tokens of the trainer's micro-batches.

Usage::

    python benchmarks/trainer_bench.py [--quick] [--executions 8] [--max-tokens 8000] [--repeats 3]
                                       [--attn tree|eager|sdpa] [--threads N] [--seed 0]
                                       [--demo-log runs/tiny-cpu/log] [--demo-config examples/tiny-cpu.toml]
                                       [--memory] [--prompt-tokens 49152] [--rollouts 16]

Three parts, one JSON object:

* ``workloads`` — a run is synthesised (``gyre.trajectory.synth``, the tiny model's vocabulary) and both batch
  forms are built from that same log at cap 5; the torch backend (tiny Qwen2, float32, CPU, the attention of
  ``--attn``: gyre's sparse tree attention by default) runs forward-backward over every micro-batch of each
  form, alternating which goes first, ``repeats`` times. ``default`` is the run as ``gyre trajectories synth``
  makes it; ``retry-heavy`` raises the retry rate to 10% so kept trajectories share long prefixes.
* ``demo`` (with ``--demo-log``, a log of ``gyre train examples/tiny-cpu.toml``) — the demo's micro-batches,
  built as its config says: forwarded tokens per trained token with group-shared prefixes and without them
  (what the trainer forwarded before sharing), and the sparse tree attention against HF eager attention
  over the dense ``[B, 1, L, L]`` mask on the same micro-batches, with their losses and gradients compared
  (float32 over all of them, float64 on the first).
* ``memory`` (with ``--memory``) — one group of ``--rollouts`` executions sharing a ``--prompt-tokens`` prompt
  (Claude Code's is ~49K), each with its own three calls after it; the builder packs it under a token budget
  and the trainer runs it: peak resident memory (``VmHWM`` reset before the micro-step), per forwarded
  token, against the bound the budget implies.

Each timed run is measured twice: wall clock, and this process's CPU time (user + system), which other
processes on a shared machine disturb far less; with one torch thread (the default here) CPU time is the
work done. The best of the repeats counts.
"""

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOADS = {"default": None, "retry-heavy": 0.10}
"""Workload name -> per-call retry rate (``None``: the synthesiser's default)."""
ATTENTION = ("tree", "eager", "sdpa")
"""``--attn``: gyre's sparse tree attention, or HF's eager / SDPA kernel over a dense mask."""


def backend_config(attn: str, dtype: str = "float32", **kwargs: Any) -> Any:
    from gyre.trainer import TorchBackendConfig

    if attn == "tree":
        return TorchBackendConfig(dtype=dtype, **kwargs)  # type: ignore[arg-type]
    return TorchBackendConfig(dtype=dtype, attention="dense", attn_implementation=attn, **kwargs)  # type: ignore[arg-type]


def _batches(log: Path, form: str, **config: Any) -> tuple[list[Any], dict[str, Any]]:
    from gyre.trainer import TrainBatch
    from gyre.trajectory import BatchBuilder, TrajectoryConfig

    builder = BatchBuilder(TrajectoryConfig(form=form, **{"cap": 5, **config}))  # type: ignore[arg-type]
    batches = [TrainBatch.from_micro_batch(m) for m in builder.from_log(log)]
    return batches, builder.report.to_dict()


def _shape(batches: list[Any], backend: Any) -> dict[str, Any]:
    from gyre.trainer import passes

    config = backend.config
    dense = [(b, g) for b in batches for g in passes.plan(b, config.max_forward_tokens, config.max_attention_area)]
    tree = [g for b in batches for g in passes.plan_tree(b, config.max_forward_tokens, config.attention_chunk)]
    tokens, trained = sum(b.tokens for b in batches), sum(b.trained_tokens for b in batches)
    return {
        "micro_batches": len(batches),
        "tokens": tokens,
        "trained_tokens": trained,
        "forwarded_per_trained": tokens / trained if trained else None,
        "row_tokens": sum(b.row_tokens for b in batches),
        "attention_blocks": sum(int(b.blocks.shape[0]) for b in batches),
        "passes": sum(len(backend.plan(b)) for b in batches),
        "padded_tokens": sum(g.padded_tokens for _, g in dense),
        "attention_area": sum(g.attention_area for _, g in dense),
        "attended_pairs": sum(int(g.allowed.sum()) - (g.padded_tokens - _real(g, b)) for b, g in dense),
        "tree_scored_pairs": sum(g.attention_area for g in tree),
    }


def _real(group: Any, batch: Any) -> int:
    return sum(int(batch.blocks[i, 1] - batch.blocks[i, 0]) for i in group.blocks)


def _time(backend: Any, batches: list[Any]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and the summed loss of one forward-backward over ``batches``."""
    backend.zero_grad()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = sum(backend.forward_backward(b).stats.loss_sum for b in batches)
    return time.perf_counter() - wall, time.process_time() - cpu, loss


def _grads(backend: Any) -> list[Any]:
    return [g.clone() for g in backend.gradient_buffers()]


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def run_workload(
    name: str, retry_rate: float | None, *, executions: int, max_tokens: int, seed: int, repeats: int,
    attn: str, directory: Path,
) -> dict[str, Any]:
    from gyre.model import build_tiny_model
    from gyre.model.tokenizer import VOCAB_SIZE
    from gyre.trainer import TorchBackend
    from gyre.trajectory.synth import SynthConfig
    from gyre.trajectory.synth_log import synthesize

    extra = {} if retry_rate is None else {"retry_rate": retry_rate}
    if max_tokens < 2_200:
        raise ValueError(f"max_tokens must be >= 2200 (executions span max_tokens / 2 to max_tokens), got {max_tokens}")
    synth = SynthConfig(executions=executions, group_size=executions, seed=seed, min_tokens=min(2_000, max_tokens // 2),
                        max_tokens=max_tokens, vocab_size=VOCAB_SIZE, **extra)
    log = directory / name
    summary = synthesize(log, synth)
    forms = {form: _batches(log, form) for form in ("packed", "expanded")}
    if not forms["packed"][0]:
        raise ValueError(f"the {name} run left nothing to train (every execution excluded); use more executions")
    backend = TorchBackend(build_tiny_model(0), backend_config(attn))
    _time(backend, forms["packed"][0][:1])  # warm-up: allocator, kernels
    wall = {form: float("inf") for form in forms}
    cpu = dict(wall)
    losses: dict[str, float] = {}
    for r in range(repeats):
        for form in (("packed", "expanded") if r % 2 == 0 else ("expanded", "packed")):
            seconds, cpu_seconds, losses[form] = _time(backend, forms[form][0])
            wall[form], cpu[form] = min(wall[form], seconds), min(cpu[form], cpu_seconds)
    backend.zero_grad()
    shapes = {form: _shape(batches, backend) for form, (batches, _) in forms.items()}
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


def compare_attention(batches: list[Any], repeats: int) -> dict[str, Any]:
    """Sparse tree attention against HF eager over the dense mask, on the same micro-batches."""
    from gyre.model import build_tiny_model
    from gyre.trainer import TorchBackend

    backends = {name: TorchBackend(build_tiny_model(0), backend_config(name)) for name in ("tree", "eager")}
    for b in backends.values():
        _time(b, batches[:1])  # warm-up
    cpu = {name: float("inf") for name in backends}
    wall = dict(cpu)
    losses: dict[str, float] = {}
    grads: dict[str, list[Any]] = {}
    for r in range(repeats):
        for name in (("tree", "eager") if r % 2 == 0 else ("eager", "tree")):
            seconds, cpu_seconds, losses[name] = _time(backends[name], batches)
            wall[name], cpu[name] = min(wall[name], seconds), min(cpu[name], cpu_seconds)
            grads[name] = _grads(backends[name])
    exact = {name: TorchBackend(build_tiny_model(0), backend_config(name, "float64")) for name in ("tree", "eager")}
    for b in exact.values():
        b.forward_backward(batches[0])
    float64_diff = _max_diff(_grads(exact["tree"]), _grads(exact["eager"]))
    return {
        "micro_batches": len(batches),
        "tree": {"cpu_s": cpu["tree"], "wall_s": wall["tree"], "loss": losses["tree"]},
        "eager": {"cpu_s": cpu["eager"], "wall_s": wall["eager"], "loss": losses["eager"]},
        "speedup_tree_vs_eager": cpu["eager"] / cpu["tree"],
        "speedup_wall": wall["eager"] / wall["tree"],
        "grad_max_abs_diff_float32": _max_diff(grads["tree"], grads["eager"]),
        "grad_max_abs_diff_float64": float64_diff,
        "grads_equal_float64_1e-5": float64_diff <= 1e-5,
        "goal_2x_met": cpu["eager"] / cpu["tree"] >= 2.0,
    }


def run_demo(log: Path, config_path: Path, repeats: int) -> dict[str, Any]:
    """The demo's micro-batches: tokens with and without group-shared prefixes, tree vs eager attention."""
    from gyre.config import TrainConfig
    from gyre.trainer import TrainBatch
    from gyre.trajectory import BatchBuilder, TrajectoryConfig

    section = TrainConfig.load(config_path).trajectory
    config = TrajectoryConfig(cap=section.cap, min_valid_per_group=section.min_valid_per_group,
                              token_budget=section.token_budget, form=section.form)  # type: ignore[arg-type]
    micro = list(BatchBuilder(config).from_log(log))
    if not micro:
        raise ValueError(f"{log} holds no complete group to train on")
    shared = [TrainBatch.from_micro_batch(m) for m in micro]
    rows = [TrainBatch.from_micro_batch(m, share=False) for m in micro]
    trained = sum(b.trained_tokens for b in shared)
    before = sum(b.tokens for b in rows) / trained
    after = sum(b.tokens for b in shared) / trained
    attention = compare_attention(shared, repeats)
    from gyre.model import build_tiny_model
    from gyre.trainer import TorchBackend

    today = TorchBackend(build_tiny_model(0), backend_config("eager"))
    today_cpu = min(_time(today, rows)[1] for _ in range(max(1, repeats - 1)))
    return {
        "log": str(log),
        "config": str(config_path),
        "micro_batches": len(micro),
        "row_tokens": sum(b.tokens for b in rows),
        "forwarded_tokens": sum(b.tokens for b in shared),
        "trained_tokens": trained,
        "forwarded_per_trained_unshared": before,
        "forwarded_per_trained": after,
        "forwarded_per_trained_cut": before / after,
        "goal_3x_cut_met": before / after >= 3.0,
        "attention": attention,
        "unshared_eager_cpu_s": today_cpu,
        "speedup_vs_unshared_eager": today_cpu / attention["tree"]["cpu_s"],
    }


def _peak_rss() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM restarts from the current RSS


def shared_prompt_group(prompt_tokens: int, rollouts: int, seed: int = 0) -> Any:
    """One GSPO group: ``rollouts`` executions that start from the same prompt, each with three calls of its
    own after it (256 output tokens each, 1,024-token tool results between them)."""
    import numpy as np

    from gyre.events import ModelCallFinished
    from gyre.model.tokenizer import VOCAB_SIZE
    from gyre.trajectory import ExecutionCalls, ExecutionOutcome, Group, Member

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB_SIZE, prompt_tokens).tolist()
    members = []
    for e in range(rollouts):
        execution_id = f"e{e}"
        events, full = [], 0
        for k in range(3):
            delta = prompt if k == 0 else rng.integers(0, VOCAB_SIZE, 1_024).tolist()
            output = rng.integers(0, VOCAB_SIZE, 256).tolist()
            events.append(ModelCallFinished(
                execution_id=execution_id, call_id=f"{execution_id}/c{k}", cell_id="cell-0", branch="main",
                parent_call_id=None if k == 0 else f"{execution_id}/c{k - 1}", prefix_len=full,
                prompt_delta_ids=delta, output_ids=output, output_logprobs=(-5.6 + rng.normal(0, 0.1, 256)).tolist(),
                policy_version=0))
            full += len(delta) + len(output)
        outcome = ExecutionOutcome(execution_id=execution_id, group_id="g", task_id="t", status="completed",
                                   reward=float(e % 2), calls=3)
        members.append(Member(outcome, ExecutionCalls.from_events(events)))
    return Group("g", tuple(members))


def run_memory(prompt_tokens: int, rollouts: int, budget: int | None = None) -> dict[str, Any]:
    """Peak memory of one micro-step over a group-shared micro-batch, against the bound its token budget gives.

    Two sizes are run (the prompt and an eighth of it) to measure memory per forwarded token; the bound of a
    budget is the small run's peak plus that rate times the tokens the budget adds."""
    from gyre.model import build_tiny_model
    from gyre.trainer import TorchBackend, TrainBatch
    from gyre.trajectory import BatchBuilder, TrajectoryConfig

    own = 3 * 256 + 2 * 1_024
    budget = budget or prompt_tokens + rollouts * own + 8_192
    runs = []
    for prompt in (max(1_024, prompt_tokens // 8), prompt_tokens):
        builder = BatchBuilder(TrajectoryConfig(cap=5, token_budget=budget))
        micro = list(builder.batches([shared_prompt_group(prompt, rollouts)]))
        batch = TrainBatch.from_micro_batch(micro[0])
        backend = TorchBackend(build_tiny_model(0), backend_config("tree", max_forward_tokens=budget,
                                                                  max_micro_batch_tokens=budget))
        backend.zero_grad()
        _reset_peak()
        before = _rss()
        wall, cpu = time.perf_counter(), time.process_time()
        result = backend.forward_backward(batch)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = _peak_rss() - before
        runs.append({
            "prompt_tokens": prompt, "rollouts": rollouts, "micro_batches": len(micro),
            "row_tokens": sum(m.tokens for m in micro), "forwarded_tokens": result.tokens,
            "trained_tokens": result.trained_tokens, "peak_rss_growth_bytes": peak, "peak_rss_bytes": _peak_rss(),
            "cpu_s": cpu, "wall_s": wall, "loss_sum": result.stats.loss_sum,
        })
        del backend, batch, micro
    small, large = runs
    rate = (large["peak_rss_growth_bytes"] - small["peak_rss_growth_bytes"]) / max(
        1, large["forwarded_tokens"] - small["forwarded_tokens"])
    bound = small["peak_rss_growth_bytes"] + rate * (budget - small["forwarded_tokens"])
    return {
        "token_budget": budget,
        "runs": runs,
        "bytes_per_forwarded_token": rate,
        "bound_bytes_at_budget": bound,
        "one_micro_batch": large["micro_batches"] == 1,
        "within_bound": large["peak_rss_growth_bytes"] <= bound and large["forwarded_tokens"] <= budget,
    }


def run_benchmark(
    *, quick: bool = False, executions: int | None = None, max_tokens: int | None = None, seed: int = 0,
    repeats: int | None = None, attn: str | None = None, threads: int | None = None,
    workloads: tuple[str, ...] = tuple(WORKLOADS), demo_log: Path | None = None,
    demo_config: Path = Path("examples/tiny-cpu.toml"), memory: bool = False, prompt_tokens: int = 49_152,
    rollouts: int = 16,
) -> dict[str, Any]:
    """The workloads (both forms), the demo's micro-batches and the memory run; one JSON-able dict."""
    import torch

    torch.set_num_threads(threads or 1)
    attn = attn or "tree"
    if attn not in ATTENTION:
        raise ValueError(f"attn must be one of {ATTENTION}, got {attn!r}")
    settings = {
        "executions": executions or (4 if quick else 8),
        "max_tokens": max_tokens or (3_000 if quick else 8_000),
        "repeats": repeats or (1 if quick else 3),
        "seed": seed,
        "attention": attn,
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
    out: dict[str, Any] = {"settings": settings, "workloads": results}
    if demo_log is not None:
        out["demo"] = run_demo(demo_log, demo_config, settings["repeats"])
    if memory:
        out["memory"] = run_memory(prompt_tokens, rollouts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--executions", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn", choices=list(ATTENTION))
    parser.add_argument("--threads", type=int, help="torch threads (default 1: CPU time is then the work done)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated; '' for none")
    parser.add_argument("--demo-log", type=Path, help="log of a `gyre train examples/tiny-cpu.toml` run")
    parser.add_argument("--demo-config", type=Path, default=Path("examples/tiny-cpu.toml"))
    parser.add_argument("--memory", action="store_true", help="train one group-shared micro-batch, measure memory")
    parser.add_argument("--prompt-tokens", type=int, default=49_152)
    parser.add_argument("--rollouts", type=int, default=16)
    args = parser.parse_args()
    names = tuple(n for n in args.workloads.split(",") if n)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    print(json.dumps(run_benchmark(quick=args.quick, executions=args.executions, max_tokens=args.max_tokens,
                                   seed=args.seed, repeats=args.repeats, attn=args.attn, threads=args.threads,
                                   workloads=names, demo_log=args.demo_log, demo_config=args.demo_config,
                                   memory=args.memory, prompt_tokens=args.prompt_tokens, rollouts=args.rollouts),
                     indent=2))


if __name__ == "__main__":
    main()
