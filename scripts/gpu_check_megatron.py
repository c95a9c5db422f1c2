"""GPU check of the Megatron backend against the torch backend (prepared; run where a GPU is lent).

What it checks, each as one entry of a JSON report (exit code 1 if any check fails):

1. ``environment``  - torch, CUDA, megatron-core and transformers versions, the GPU's name;
2. ``model_path``   - on random tree-packed batches, the Megatron backend's loss and HF-named gradients
   equal the torch backend's on the same weights (fp32);
3. ``optimizer``    - two optimizer steps (Megatron DDP + ``get_megatron_optimizer`` vs torch AdamW, same lr,
   betas, eps, clip, weight decay 0) give the same weights and gradient norms;
4. ``checkpoint``   - a Megatron checkpoint (HF-named weights + optimizer state) reloads into a new backend;
5. ``throughput``   - forward-backward tokens/s of both backends in bf16 on a larger Qwen2-shaped model
   (random weights; ``--big-layers`` etc. size it).

With ``--device cpu`` it runs 1, 2 and 5 on CPU (the optimizer and checkpoint-with-optimizer checks are
reported as not run: Megatron's optimizer needs CUDA), which is how it was tried before any GPU was lent.

Usage on the GPU machine (its python3 is 3.12 with torch and transformers, and it cannot download): carry a
megatron-core wheel for Python 3.12, fetched here with

    pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d .gpu-wheels       # and: echo /.gpu-wheels/ >> .git/info/exclude

then run, with ``.gpu-wheels`` in ``carry``::

    pip install --no-deps .gpu-wheels/megatron_core-0.16.1-*.whl && \
        python3 scripts/gpu_check_megatron.py --out $OUT/gpu_check.json

Only torch, transformers, tokenizers, safetensors, numpy and megatron-core are needed: batches are built here
from random trees (``random_packed_columns``), not through the trajectory processor, whose log and event
code needs packages the GPU image lacks.
"""

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _RandomForest:
    """One packed row: random segments (context then policy tokens) in depth-first order."""

    def __init__(self, rand: Callable[[int, int], int], vocab: int, scale: int) -> None:
        self.rand, self.vocab, self.scale = rand, vocab, scale
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.mask: list[int] = []
        self.parent: list[int] = []
        self.end: list[int] = []
        self.owner: list[int] = []
        self.leaves: list[int] = []

    def segment(self, parent_index: int, depth: int, level: int) -> None:
        """Append one segment and its subtree (0-2 child segments that share it as prefix)."""
        start = len(self.ids)
        context, policy = self.rand(1, 6 * self.scale), self.rand(1, 6 * self.scale)
        for k in range(context + policy):
            self.ids.append(self.rand(0, self.vocab - 1))
            self.pos.append(depth + k)
            self.mask.append(1 if k >= context else 0)
            self.parent.append(parent_index if k == 0 else len(self.ids) - 2)
        last = len(self.ids) - 1
        self.end += [-1] * (context + policy)
        self.owner += [-1] * (context + policy)
        children = self.rand(0, 2) if level < 3 else 0
        first_leaf = len(self.leaves)  # the first trajectory through this segment trains its policy tokens
        if children == 0:
            self.leaves.append(last)
        for _ in range(children):
            self.segment(last, depth + context + policy, level + 1)
        for i in range(start, last + 1):
            self.end[i] = len(self.ids)
            self.owner[i] = first_leaf if self.mask[i] else -1


def random_packed_columns(seed: int, rows: int, vocab: int, scale: int = 1) -> dict[str, Any]:
    """Columns of a packed micro-batch (``MicroBatch.to_torch()`` shape) from random execution trees.

    Each row is a forest in depth-first order (one or two roots). A trajectory ends at each leaf; leaves are
    ranked in depth-first order, and each policy token is trained by the first trajectory that contains it.
    Every execution's token weights sum to 1.
    """
    import torch

    g = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    columns: dict[str, list] = {k: [] for k in (
        "input_ids", "position_ids", "loss_mask", "token_weights", "behaviour_logprobs", "advantages",
        "policy_versions", "parent_ids", "subtree_end", "trajectory_ids")}
    cu, ends_offsets, execution_ids = [0], [0], []
    for row in range(rows):
        tree = _RandomForest(rand, vocab, scale)
        for _ in range(rand(1, 2)):
            tree.segment(-1, 0, 0)
        trained, n = sum(tree.mask), len(tree.ids)
        advantage = float(torch.randn(1, generator=g))
        noise = (-5.6 + 0.5 * torch.randn(n, generator=g)).tolist()
        columns["input_ids"] += tree.ids
        columns["position_ids"] += tree.pos
        columns["loss_mask"] += tree.mask
        columns["token_weights"] += [1.0 / trained if m else 0.0 for m in tree.mask]
        columns["behaviour_logprobs"] += [x if m else 0.0 for x, m in zip(noise, tree.mask, strict=True)]
        columns["advantages"] += [advantage] * n
        columns["policy_versions"] += [0] * n
        columns["parent_ids"] += tree.parent
        columns["subtree_end"] += tree.end
        columns["trajectory_ids"] += tree.owner
        cu.append(cu[-1] + n)
        ends_offsets.append(ends_offsets[-1] + len(tree.leaves))
        execution_ids.append(f"e{seed}-{row}")
    out: dict[str, Any] = {
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "trajectory_ends_offsets": torch.tensor(ends_offsets, dtype=torch.int32),
        "execution_id": execution_ids,
    }
    float_columns = ("token_weights", "behaviour_logprobs", "advantages")
    for name, values in columns.items():
        out[name] = torch.tensor(values, dtype=torch.float32 if name in float_columns else torch.int32)
    out["loss_mask"] = out["loss_mask"].bool()
    return out


def batches(count: int, rows: int, vocab: int, scale: int = 1) -> list[Any]:
    from gyre.trainer.batch import TrainBatch

    return [TrainBatch.from_columns("packed", random_packed_columns(s, rows, vocab, scale), index=s)
            for s in range(count)]


def check_environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0]}
    try:
        import megatron.core

        info["megatron_core"] = megatron.core.__version__
    except ImportError:
        info["megatron_core"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    ok = info["megatron_core"] is not None and (args.device == "cpu" or info["cuda_available"])
    return {"ok": ok, **info}


def _pair(args: argparse.Namespace, runtime: Any, model_config: Any = None, dtype: str = "float32",
          lr: float = 1e-3) -> tuple[Any, Any]:
    from gyre.model import build_tiny_model
    from gyre.trainer import GSPOConfig, OptimizerConfig, TorchBackend, TorchBackendConfig
    from gyre.trainer.megatron import MegatronBackend, MegatronBackendConfig

    loss = GSPOConfig(eps_low=0.5, eps_high=0.5, tis_cap=None)
    optimizer = OptimizerConfig(lr=lr, weight_decay=0.0, max_grad_norm=1.0)
    reference = TorchBackend(build_tiny_model(0, model_config),
                             TorchBackendConfig(dtype=dtype, device=args.device, loss=loss, optimizer=optimizer))
    megatron = MegatronBackend.from_hf_model(
        reference.model, MegatronBackendConfig(dtype=dtype, device=args.device, loss=loss, optimizer=optimizer),
        runtime=runtime,
    )
    return reference, megatron


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[n].float().cpu() - b[n].float().cpu()).abs().max()) for n in a)


def check_model_path(args: argparse.Namespace, runtime: Any) -> dict[str, Any]:
    from gyre.model.tokenizer import VOCAB_SIZE

    reference, megatron = _pair(args, runtime)
    losses = []
    for batch in batches(3, rows=4, vocab=VOCAB_SIZE):
        want = reference.forward_backward(batch).stats.loss_sum
        losses.append((want, megatron.forward_backward(batch).stats.loss_sum))
    torch_grads = {n: p.grad for n, p in reference.model.named_parameters()}
    grad_diff = _max_diff(torch_grads, megatron.named_gradients())
    loss_diff = max(abs(a - b) for a, b in losses)
    return {"ok": loss_diff < 1e-4 and grad_diff < 1e-4, "max_loss_diff": loss_diff, "max_grad_diff": grad_diff,
            "losses": losses}


def check_optimizer(args: argparse.Namespace, runtime: Any) -> dict[str, Any]:
    from gyre.model.tokenizer import VOCAB_SIZE

    if args.device != "cuda":
        return {"ok": None, "reason": "Megatron's optimizer allocates CUDA buffers; not run on CPU"}
    reference, megatron = _pair(args, runtime)
    steps = []
    for step, batch in enumerate(batches(2, rows=4, vocab=VOCAB_SIZE)):
        for backend in (reference, megatron):
            backend.forward_backward(batch)
        a, b = reference.optimizer_step(batch.weight), megatron.optimizer_step(batch.weight)
        steps.append({"step": step, "grad_norm_torch": a.grad_norm, "grad_norm_megatron": b.grad_norm,
                      "max_weight_diff": _max_diff(dict(reference.named_tensors()), dict(megatron.named_tensors()))})
    ok = all(s["max_weight_diff"] < 1e-5 and abs(s["grad_norm_torch"] - s["grad_norm_megatron"])
             <= 1e-4 * max(1.0, s["grad_norm_torch"]) for s in steps)
    return {"ok": ok, "steps": steps}


def check_checkpoint(args: argparse.Namespace, runtime: Any) -> dict[str, Any]:
    from gyre.model import build_tiny_model
    from gyre.trainer.megatron import MegatronBackend, MegatronBackendConfig

    _, source = _pair(args, runtime)
    source.policy_version = 3
    with tempfile.TemporaryDirectory() as tmp:
        source.save_checkpoint(Path(tmp) / "ckpt")
        loaded = MegatronBackend(build_tiny_model(0).config, MegatronBackendConfig(device=args.device),
                                 runtime=runtime)
        loaded.load_checkpoint(Path(tmp) / "ckpt")
    diff = _max_diff(dict(source.named_tensors()), dict(loaded.named_tensors()))
    return {"ok": diff == 0.0 and loaded.policy_version == 3, "max_weight_diff": diff,
            "optimizer_state": source.optimizer is not None}


def check_throughput(args: argparse.Namespace, runtime: Any) -> dict[str, Any]:
    import torch

    from gyre.model import TinyModelConfig

    big = args.device == "cuda"
    config = TinyModelConfig(vocab_size=args.big_vocab if big else 265, hidden_size=args.big_hidden if big else 128,
                             intermediate_size=(args.big_hidden * 11 // 4) if big else 512,
                             num_hidden_layers=args.big_layers if big else 2,
                             num_attention_heads=16 if big else 4, num_key_value_heads=4 if big else 2,
                             initializer_range=0.02)
    dtype = "bfloat16" if big else "float32"
    reference, megatron = _pair(args, runtime, config, dtype=dtype)
    work = batches(2, rows=8, vocab=config.vocab_size, scale=args.big_scale if big else 4)
    out: dict[str, Any] = {"ok": True, "dtype": dtype, "tokens": sum(b.tokens for b in work),
                           "model": {"hidden": config.hidden_size, "layers": config.num_hidden_layers,
                                     "vocab": config.vocab_size}}
    for name, backend in (("torch", reference), ("megatron", megatron)):
        backend.forward_backward(work[0])  # warm-up
        if big:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in work:
            backend.forward_backward(batch)
        if big:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out[name] = {"seconds": seconds, "tokens_per_s": out["tokens"] / seconds}
        backend.zero_grad()
    return out


CHECKS: dict[str, Callable[[argparse.Namespace, Any], dict[str, Any]]] = {
    "model_path": check_model_path,
    "optimizer": check_optimizer,
    "checkpoint": check_checkpoint,
    "throughput": check_throughput,
}


def main() -> int:
    parser = argparse.ArgumentParser(description="Megatron backend vs torch backend, on GPU (or CPU: partial)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, help="where to write the JSON report (also printed)")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--big-hidden", type=int, default=1024)
    parser.add_argument("--big-layers", type=int, default=8)
    parser.add_argument("--big-vocab", type=int, default=32_000)
    parser.add_argument("--big-scale", type=int, default=64, help="segment length scale of the throughput batches")
    args = parser.parse_args()
    report: dict[str, Any] = {"device": args.device, "environment": check_environment(args)}
    if report["environment"]["ok"]:
        from gyre.trainer.megatron import MegatronRuntime

        with MegatronRuntime(args.device) as runtime:
            for name in args.only or list(CHECKS):
                started = time.perf_counter()
                try:
                    report[name] = CHECKS[name](args, runtime)
                except Exception:  # a failed check is a result to report, and the next check still runs
                    report[name] = {"ok": False, "error": traceback.format_exc()}
                report[name]["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(v.get("ok") is not False for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
