"""A Megatron-core GPTModel equivalent to an HF Qwen2 config, and its tree-packed forward.

The forward does what ``GPTModel.forward`` does (embedding, decoder, output layer) with two differences
that tree packing needs: rotary embeddings are computed from explicit ``position_ids`` (depths in the
tree) instead of ``0..L-1``, and the attention mask is the tree mask (Megatron's convention: ``True`` =
masked). Only hidden states that predict a trained token reach the output layer, and log-probs come from
``vocab_parallel_cross_entropy``, which stays correct under tensor parallelism.
"""

from typing import Any

import torch

from gyre.trainer.errors import TrainerConfigError
from gyre.trainer.passes import ForwardPass

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def transformer_config(hf_config: Any, dtype: torch.dtype, device: str) -> Any:
    """HF Qwen2 config -> Megatron ``TransformerConfig`` (local spec, no fusions, dropout 0)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if getattr(hf_config, "model_type", None) != "qwen2":
        raise TrainerConfigError(f"the Megatron backend builds Qwen2 models only, got {hf_config.model_type!r}")
    if getattr(hf_config, "use_sliding_window", False):
        raise TrainerConfigError("the Megatron backend does not build sliding-window attention")
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise TrainerConfigError("the Megatron backend runs with attention dropout 0 (RL trainers do)")
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    return TransformerConfig(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf_config.num_key_value_heads),
        kv_channels=int(getattr(hf_config, "head_dim", None) or hidden // heads),
        ffn_hidden_size=int(hf_config.intermediate_size),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        add_bias_linear=False,
        add_qkv_bias=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=dtype != torch.float64,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device == "cpu",
    )


def rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise TrainerConfigError(f"the Megatron backend supports default RoPE only, got {params.get('rope_type')!r}")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def build_model(hf_config: Any, dtype: torch.dtype, device: str) -> Any:
    """A randomly initialised GPTModel shaped like ``hf_config``; load weights into it afterwards."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=transformer_config(hf_config, dtype, device),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(hf_config.max_position_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        pre_process=True,
        post_process=True,
    )
    return model.to(device=device, dtype=dtype)  # local norms are created in float32 whatever params_dtype says


def pass_logprobs(model: Any, group: ForwardPass, device: str, pad_token_id: int | None = None) -> torch.Tensor:
    """Log-prob of each trained token of a pass (differentiable), computed in float32 at least.

    ``pad_token_id`` mirrors HF's ``nn.Embedding(padding_idx=...)``: occurrences of that token as input send
    no gradient into its embedding row (the row still learns through a tied output layer), so both backends
    train the same function.
    """
    from megatron.core import tensor_parallel

    ids = group.input_ids.to(device).contiguous()
    positions = group.position_ids.to(device)
    inv_freq = model.rotary_pos_emb.inv_freq.to(device)
    freqs = positions.t()[..., None].float() * inv_freq  # [L, B, dim/2]
    rotary = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]  # [L, B, 1, dim]: broadcasts over heads
    hidden = model.embedding(input_ids=ids, position_ids=positions)  # [L, B, H]
    if pad_token_id is not None:
        frozen = (ids == pad_token_id).t()[..., None]
        hidden = torch.where(frozen, hidden.detach(), hidden)
    masked = (~group.allowed)[:, None].to(device)  # [B, 1, L, L], True = may not attend
    hidden = model.decoder(hidden_states=hidden, attention_mask=masked, rotary_pos_emb=rotary)
    flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
    picked = flat.index_select(0, group.parent_slots.to(device))[:, None, :]  # [T, 1, H]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(picked, weight=weight)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits, group.targets.to(device)[:, None])
    return -nll[:, 0]
