"""Hugging Face <-> Megatron-core weight names and layouts for Qwen2-architecture models (pure torch).

Megatron's local layer spec (``get_gpt_layer_local_spec``) keeps norms as their own modules and fuses two
pairs of projections:

* ``linear_qkv`` stacks, for each query group ``g``, its query heads, then its key head, then its value head
  (``[q_g0 k_g0 v_g0 q_g1 ...]`` along the output dimension), for the weight and the bias;
* ``linear_fc1`` stacks ``gate_proj`` over ``up_proj`` (the SwiGLU halves, in that order).

Everything else is a rename. ``to_megatron`` and ``to_hf`` are inverses (tested), and they are also used
for gradients, which share the parameters' layout.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from gyre.trainer.errors import TrainerConfigError


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the name mapping needs to know about a model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_hf(cls, config: object) -> "Shape":
        model_type = getattr(config, "model_type", None)
        if model_type != "qwen2":
            raise TrainerConfigError(f"the Megatron backend maps Qwen2 models only, got model_type={model_type!r}")
        hidden = int(config.hidden_size)  # type: ignore[attr-defined]
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        return cls(
            layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.num_key_value_heads),  # type: ignore[attr-defined]
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            tied=bool(config.tie_word_embeddings),  # type: ignore[attr-defined]
        )


_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
)


def to_megatron(tensors: Mapping[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
    """HF-named tensors (every parameter) -> Megatron GPTModel names and layouts."""
    get = _getter(tensors, "HF")
    out = {"embedding.word_embeddings.weight": get("model.embed_tokens.weight")}
    group = shape.heads // shape.kv_heads
    for i in range(shape.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for a, b in _RENAMES:
            out[mg + b] = get(hf + a)
        for kind in ("weight", "bias"):
            q = get(f"{hf}self_attn.q_proj.{kind}")
            k = get(f"{hf}self_attn.k_proj.{kind}")
            v = get(f"{hf}self_attn.v_proj.{kind}")
            tail = q.shape[1:]
            parts = (
                q.reshape(shape.kv_heads, group * shape.head_dim, *tail),
                k.reshape(shape.kv_heads, shape.head_dim, *tail),
                v.reshape(shape.kv_heads, shape.head_dim, *tail),
            )
            out[f"{mg}self_attention.linear_qkv.{kind}"] = torch.cat(parts, dim=1).reshape(-1, *tail)
        gate, up = get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    out["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not shape.tied:
        out["output_layer.weight"] = get("lm_head.weight")
    return out


def to_hf(tensors: Mapping[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
    """Megatron GPTModel tensors -> HF names and layouts (tied models export ``model.embed_tokens`` only)."""
    get = _getter(tensors, "Megatron")
    out = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight")}
    group = shape.heads // shape.kv_heads
    for i in range(shape.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for a, b in _RENAMES:
            out[hf + a] = get(mg + b)
        for kind in ("weight", "bias"):
            qkv = get(f"{mg}self_attention.linear_qkv.{kind}")
            tail = qkv.shape[1:]
            grouped = qkv.reshape(shape.kv_heads, (group + 2) * shape.head_dim, *tail)
            q, k, v = grouped.split([group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
            out[f"{hf}self_attn.q_proj.{kind}"] = q.reshape(-1, *tail)
            out[f"{hf}self_attn.k_proj.{kind}"] = k.reshape(-1, *tail)
            out[f"{hf}self_attn.v_proj.{kind}"] = v.reshape(-1, *tail)
        gate, up = get(mg + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[hf + "mlp.gate_proj.weight"] = gate
        out[hf + "mlp.up_proj.weight"] = up
    out["model.norm.weight"] = get("decoder.final_layernorm.weight")
    if not shape.tied:
        out["lm_head.weight"] = get("output_layer.weight")
    return out


def _getter(tensors: Mapping[str, torch.Tensor], side: str) -> Callable[[str], torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise TrainerConfigError(f"{side} weights lack {name!r}") from None

    return get
