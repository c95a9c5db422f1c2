"""The CPU engine's batching curve: decode-step time against batch size and context, fitted to the
simulator's model ``step_ms + n * per_request_ms + context_mtokens * per_mtoken_ms`` (docs/simulator.md).

    .venv/bin/python benchmarks/decode_curve.py [--json] [--quick]

Runs the local engine's real forward step (``RaggedQwen2``, the tiny Qwen2 model, one thread) on batches
of ``n`` sequences whose KV already holds ``context`` tokens, one token each, and keeps the fastest of
several steps (on a shared machine the minimum is the least disturbed estimate).
The fitted ``[decode]`` section lets a live run on the CPU engine be compared with the simulator's
prediction for the same cluster (the cluster issue's live comparison). Timings are noisy on a shared
machine: the fit, not one point, is the figure.
"""

import argparse
import json
import time

import numpy as np
import torch

from gyre.engine.local.forward import RaggedQwen2, StepInput
from gyre.engine.local.kv import SequenceKV
from gyre.model import build_tiny_model


def step_ms(runner: RaggedQwen2, n: int, context: int, repeats: int) -> float:
    kvs = [SequenceKV(runner.kv_shape, context + repeats + 1) for _ in range(n)]
    runner.step([StepInput(kv, [1] * context, False) for kv in kvs])  # prefill
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.step([StepInput(kv, [2], True) for kv in kvs])
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def fit_relative(design: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (every point counts alike, fast or slow): refit
    without any term that comes out negative until none does."""
    keep = list(range(design.shape[1]))
    weighted, target = design / times[:, None], np.ones_like(times)
    while True:
        coef, *_ = np.linalg.lstsq(weighted[:, keep], target, rcond=None)
        if (coef >= 0).all():
            out = np.zeros(design.shape[1])
            out[keep] = coef
            return out
        keep = [k for k, c in zip(keep, coef, strict=True) if c >= 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer points (CI smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # this script's own process: the engine's default
    runner = RaggedQwen2(build_tiny_model(0))
    batches = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32)
    contexts = (64, 1024) if args.quick else (64, 512, 2048, 4096)
    repeats = 3 if args.quick else 7
    points = [{"requests": n, "context": c, "step_ms": round(step_ms(runner, n, c, repeats), 4)}
              for n in batches for c in contexts]
    design = np.array([[1.0, p["requests"], p["requests"] * p["context"] / 1e6] for p in points])
    times = np.array([p["step_ms"] for p in points])
    coef = fit_relative(design, times)
    fixed, per_request, per_mtoken = coef
    fit = {"step_ms": round(float(fixed), 4), "per_request_ms": round(float(per_request), 4),
           "per_mtoken_ms": round(float(per_mtoken), 2)}
    predicted = design @ coef
    errors = np.abs(predicted / times - 1)
    worst, median = float(np.max(errors)), float(np.median(errors))
    out = {"engine": "local CPU engine, tiny Qwen2, 1 thread", "points": points, "fit": fit,
           "worst_relative_error": round(worst, 4), "median_relative_error": round(median, 4)}
    if args.json:
        print(json.dumps(out))
        return
    for p in points:
        print(f"  n={p['requests']:3d} context={p['context']:5d}: {p['step_ms']:8.3f} ms per decode step")
    print(f"[decode]  # fitted; points off by {median:.0%} (median), {worst:.0%} (worst)")
    for key, value in fit.items():
        print(f"{key} = {value}")


if __name__ == "__main__":
    main()
