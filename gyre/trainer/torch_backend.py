"""The torch backend: any Hugging Face causal LM, tree-packed forward, AdamW, checkpoints, named tensors.

The forward runs the model's backbone on flat passes of attention blocks with gyre's sparse tree attention
(``attention = "tree"``, registered with transformers as ``gyre_tree``; no ``L x L`` mask) or, as the
reference, on padded groups with a dense 4D additive mask (``attention = "dense"``, eager or SDPA kernel),
always with explicit ``position_ids`` (depths), so a shared prefix is computed once and every path sees the
positions its expanded sequence would. Only the hidden states that predict a trained token go through the
output projection. Each group runs forward, loss and backward before the next (a GSPO unit never spans two
blocks), so gradients accumulate across groups and micro-steps without keeping their activations.
"""

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gyre.trainer import passes, tree_attention
from gyre.trainer.batch import TrainBatch
from gyre.trainer.config import TorchBackendConfig
from gyre.trainer.errors import CheckpointError, TrainerConfigError, TrainerError
from gyre.trainer.protocol import MicroStepResult, NamedTensors, StepResult

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MASKABLE_ATTENTION = ("eager", "sdpa")
"""HF attention kernels that take an arbitrary 4D additive mask (flash-attention and flex do not)."""
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "trainer.json"


class TorchBackend:
    """A trainer replica on one device, built from an HF causal LM and a ``TorchBackendConfig``."""

    def __init__(self, model: Any, config: TorchBackendConfig | None = None, *, policy_version: int = 0) -> None:
        self.config = config or TorchBackendConfig()
        if self.config.dtype is not None:
            model = model.to(DTYPES[self.config.dtype])
        self.model = model.to(self.config.device)
        if self.config.attention == "tree":
            self.model.set_attn_implementation(tree_attention.register())
        elif self.config.attn_implementation is not None:
            self.model.set_attn_implementation(self.config.attn_implementation)
        attention = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if self.config.attention == "dense" and attention not in MASKABLE_ATTENTION:
            raise TrainerConfigError(
                f"attention implementation {attention!r} cannot take the tree mask; use one of {MASKABLE_ATTENTION}"
            )
        self.head = self.model.get_output_embeddings()
        if self.head is None:
            raise TrainerConfigError(f"{type(model).__name__} has no output embeddings: not a causal LM")
        self.backbone = self.model.base_model
        if self.backbone is self.model:
            raise TrainerConfigError(f"{type(model).__name__} exposes no backbone (base_model): not an HF causal LM")
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)
        self.dtype = next(self.model.parameters()).dtype
        self.policy_version = policy_version
        opt = self.config.optimizer
        params = self._parameters()
        groups = [  # Megatron's convention (and most trainers'): biases and norm scales are not decayed
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)

    @classmethod
    def from_pretrained(cls, path: str | Path, config: TorchBackendConfig | None = None) -> "TorchBackend":
        """Load an HF checkpoint directory offline (eager attention unless the config says otherwise)."""
        from transformers import AutoModelForCausalLM

        attention = (config.attn_implementation if config else None) or "eager"
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, local_files_only=True)
        return cls(model, config)

    # -- the protocol ------------------------------------------------------------------------------------

    def load_weights(self, tensors: NamedTensors, *, policy_version: int | None = None) -> None:
        items = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
        targets = dict(self.model.state_dict(keep_vars=True))
        unknown = sorted(set(items) - set(targets))
        if unknown:
            raise TrainerError(f"load_weights: unknown tensor names {unknown[:5]}")
        provided = {id(targets[name]) for name in items}
        missing = [name for name, p in self.model.named_parameters() if id(p) not in provided]
        if missing:
            raise TrainerError(f"load_weights: every parameter is required, missing {missing[:5]}")
        with torch.no_grad():
            for name, tensor in items.items():
                target = targets[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise TrainerError(
                        f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)
        if policy_version is not None:
            self.policy_version = policy_version

    def forward_backward(self, batch: TrainBatch, *, loss_scale: float = 1.0) -> MicroStepResult:
        limit = self.config.max_micro_batch_tokens
        if limit is not None and batch.tokens > limit:
            raise TrainerError(
                f"micro-batch {batch.index} forwards {batch.tokens} tokens, over max_micro_batch_tokens={limit}; "
                "lower the trajectory token_budget to at most that"
            )
        self.model.train()
        return passes.forward_backward(
            batch, self._logprobs, self.plan(batch), loss=self.config.loss, device=self.config.device,
            loss_scale=loss_scale,
        )

    def plan(self, batch: TrainBatch) -> list[passes.Pass]:
        """The forward passes this backend runs a micro-batch in (flat tree passes, or dense padded ones)."""
        if self.config.attention == "tree":
            return list(passes.plan_tree(batch, self.config.max_forward_tokens, self.config.attention_chunk))
        return list(passes.plan(batch, self.config.max_forward_tokens, self.config.max_attention_area))

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of the batch's trained tokens under the current weights (no gradient), in trained order."""
        out = torch.zeros(batch.trained_tokens, dtype=torch.float64)
        with torch.no_grad():
            for group in self.plan(batch):
                if group.trained.numel():
                    out[group.trained] = self._logprobs(group).double().cpu()
        return out

    def gradient_buffers(self) -> list[torch.Tensor]:
        buffers = []
        for p in self._parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buffers.append(p.grad)
        return buffers

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, normalizer: float) -> StepResult:
        if not normalizer > 0:
            raise TrainerError(
                f"optimizer_step: normalizer must be > 0 (the step's total token weight), got {normalizer}"
            )
        params = self._parameters()
        grads = self.gradient_buffers()
        for grad in grads:
            grad.div_(normalizer)
        max_norm = self.config.optimizer.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        grad_norm = float(norm)
        if not torch.isfinite(norm):
            self.zero_grad()
            raise TrainerError(f"optimizer_step: gradient norm is {grad_norm}; the step was not applied")
        self.optimizer.step()
        self.zero_grad()
        self.policy_version += 1
        return StepResult(policy_version=self.policy_version, grad_norm=grad_norm, normalizer=normalizer)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Weights (safetensors, HF names), AdamW state and the policy version; written then renamed."""
        from safetensors.torch import save_file

        target = Path(directory)
        tmp = target.with_name(target.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous().cpu() for n, t in self.named_tensors()}, str(tmp / WEIGHTS_FILE))
        torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps({"policy_version": self.policy_version, "shapes": self._shapes()}))
        if target.exists():
            _remove_tree(target)
        tmp.rename(target)
        return target

    def load_checkpoint(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(directory)
        for name in (WEIGHTS_FILE, OPTIMIZER_FILE, META_FILE):
            if not (path / name).exists():
                raise CheckpointError(f"checkpoint {path} lacks {name}")
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("shapes") != self._shapes():
            raise CheckpointError(f"checkpoint {path} belongs to another model (parameter names or shapes differ)")
        self.load_weights(load_file(str(path / WEIGHTS_FILE)), policy_version=int(meta["policy_version"]))
        state = torch.load(path / OPTIMIZER_FILE, map_location=self.config.device, weights_only=True)
        self.optimizer.load_state_dict(state)

    # -- internals ---------------------------------------------------------------------------------------

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.model.named_parameters()]

    def _shapes(self) -> dict[str, list[int]]:
        return {name: list(p.shape) for name, p in self.model.named_parameters()}

    def _logprobs(self, group: passes.Pass) -> torch.Tensor:
        """Log-prob of each trained token of a pass (differentiable, float32 at least)."""
        device = self.config.device
        if isinstance(group, passes.TreePass):
            mask: dict[str, Any] = {"tree": group.tree}
        else:
            mask = {"attention_mask": group.additive_mask(self.dtype).to(device)}
        hidden = self.backbone(
            input_ids=group.input_ids.to(device),
            position_ids=group.position_ids.to(device),
            use_cache=False,
            **mask,
        ).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, group.parent_slots.to(device))
        logits = self.head(picked)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return torch.log_softmax(logits, dim=-1).gather(1, group.targets.to(device)[:, None]).squeeze(1)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
