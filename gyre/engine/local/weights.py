"""Loading new weights into the running model: from a checkpoint directory or named tensors.

Weights are copied in place into the existing parameters (same names, same shapes), so the KV layout,
the runner and every reference to the model stay valid. Anything that does not fit is rejected with an
`EngineRequestError` naming the tensor before a single parameter is touched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gyre.engine.errors import EngineRequestError


def read_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint: a directory of `*.safetensors` (sharded or not) or one file."""
    path = Path(model_path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [path / name for name in shard_names]
        else:
            files = sorted(path.glob("*.safetensors"))
    else:
        raise EngineRequestError("model_path", f"{model_path} does not exist")
    if not files:
        raise EngineRequestError("model_path", f"no *.safetensors files in {model_path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise EngineRequestError("model_path", f"cannot read {f}: {e}") from e
    return tensors


def apply_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, require_all: bool, field: str) -> int:
    """Copy `tensors` into `model`'s parameters/buffers in place; returns how many were updated.

    `require_all` (a full checkpoint) demands every parameter; a tensor update may be partial.
    Tied weights: `lm_head.weight` and `model.embed_tokens.weight` name the same tensor, either may be sent.
    """
    targets = dict(model.state_dict(keep_vars=True))
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        raise EngineRequestError(field, f"unknown tensor names: {unknown[:5]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(targets[name].shape):
            raise EngineRequestError(
                field, f"{name} has shape {tuple(t.shape)}, the model expects {tuple(targets[name].shape)}"
            )
    if require_all:
        provided = {id(targets[n]) for n in tensors}
        missing = sorted(n for n, p in model.named_parameters() if id(p) not in provided)
        if missing:
            raise EngineRequestError(field, f"checkpoint lacks parameters: {missing[:5]}")
    with torch.no_grad():
        for name, t in tensors.items():
            targets[name].copy_(t)
    return len(tensors)
