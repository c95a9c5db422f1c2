"""One forward step over a ragged batch of sequences, using the HF Qwen2 model's own modules.

Every weight-bearing op (embedding, q/k/v/o projections, RMSNorms, MLP, lm_head) runs once on the flat
`[total_new_tokens, hidden]` tensor of all sequences in the step, so the batch shares each matmul.
Only attention is per sequence: each sequence's new queries attend to its own KV buffer (cached prefix +
new keys) with a causal offset. No padding, no attention-mask bookkeeping, and a prefill chunk of one
sequence can share a step with single-token decodes of the others (continuous batching).
The math is Qwen2's (`modeling_qwen2.py`); `tests/engine` checks logits against the HF forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gyre.engine.local.kv import KVShape, SequenceKV


@dataclass(slots=True)
class StepInput:
    """Feed `token_ids` to a sequence whose KV holds `kv.length` tokens; `want_logits` asks for the
    next-token logits after the last of them."""

    kv: SequenceKV
    token_ids: list[int]
    want_logits: bool


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RaggedQwen2:
    """Runs a `Qwen2ForCausalLM` over ragged batches with externally held per-sequence KV."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        if getattr(cfg, "model_type", None) != "qwen2":
            raise ValueError(f"the local engine runs Qwen2-architecture models, got {cfg.model_type!r}")
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the local engine")
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.max_positions = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.kv_shape = KVShape(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=next(model.parameters()).dtype,
        )

    @torch.inference_mode()
    def step(self, batch: list[StepInput]) -> list[torch.Tensor | None]:
        """Feed every sequence its tokens, extend its KV, return `[vocab]` float32 logits where asked."""
        inner = self.model.model
        sizes = [len(s.token_ids) for s in batch]
        assert all(sizes), "every step input carries at least one token"
        ids = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(s.kv.length, s.kv.length + n) for s, n in zip(batch, sizes, strict=True)])
        for s, n in zip(batch, sizes, strict=True):
            s.kv.reserve(n)

        h = inner.embed_tokens(ids)  # [T, hidden]
        cos, sin = inner.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, head_dim]
        total = ids.shape[0]
        for layer_idx, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(total, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(total, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(total, self.num_kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out = torch.empty_like(q)
            start = 0
            for s, n in zip(batch, sizes, strict=True):
                end, past = start + n, s.kv.length
                s.kv.write(layer_idx, past, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1))
                keys, values = s.kv.keys_values(layer_idx, past + n)
                out[start:end] = self._attend(q[start:end].transpose(0, 1), keys, values, past).transpose(0, 1)
                start = end
            h = h + attn.o_proj(out.reshape(total, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))

        for s, n in zip(batch, sizes, strict=True):
            s.kv.length += n
        ends = torch.tensor(sizes).cumsum(0) - 1
        wanted = [i for i, s in enumerate(batch) if s.want_logits]
        results: list[torch.Tensor | None] = [None] * len(batch)
        if wanted:
            last = inner.norm(h[ends[wanted]])
            logits = self.model.lm_head(last).float()
            for row, i in enumerate(wanted):
                results[i] = logits[row]
        return results

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int) -> torch.Tensor:
        """`q` `[heads, n, d]` against `[kv_heads, past + n, d]`; query i sees keys `0..past + i`."""
        n = q.shape[1]
        mask = None
        if n > 1:
            mask = torch.arange(past + n).unsqueeze(0) <= (torch.arange(n) + past).unsqueeze(1)
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=self.scale, enable_gqa=True
        ).squeeze(0)
