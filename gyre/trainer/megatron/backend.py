"""The Megatron backend: the trainer protocol over a Megatron-core GPTModel (Qwen2 architecture).

Weights come and go in HF names (``weights.py`` maps them), so the same checkpoint, engine update or test
batch works with either backend. On CUDA the model is wrapped in Megatron's ``DistributedDataParallel``
(gradients accumulate in its fp32 ``main_grad`` buffers and are reduced over its data-parallel group) and
stepped by ``get_megatron_optimizer`` (Adam with decoupled weight decay; Megatron exempts biases and norms
from decay). On CPU the model path is the real one, but the optimizer cannot be built: ``optimizer_step``
raises ``BackendUnavailableError`` instead of pretending to train.
"""

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gyre.trainer import passes
from gyre.trainer.batch import TrainBatch
from gyre.trainer.errors import CheckpointError, TrainerError
from gyre.trainer.megatron import weights
from gyre.trainer.megatron.config import MegatronBackendConfig
from gyre.trainer.megatron.model import DTYPES, build_model, pass_logprobs, transformer_config
from gyre.trainer.megatron.runtime import MegatronRuntime, require_cuda
from gyre.trainer.protocol import MicroStepResult, NamedTensors, StepResult

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "trainer.json"


class MegatronBackend:
    """A trainer replica over Megatron-core, built from an HF config (tp = pp = 1 in this version)."""

    def __init__(
        self,
        hf_config: Any,
        config: MegatronBackendConfig | None = None,
        *,
        runtime: MegatronRuntime,
        policy_version: int = 0,
    ) -> None:
        self.config = config or MegatronBackendConfig()
        if self.config.device == "cuda":
            require_cuda("MegatronBackend(device='cuda')")
        if runtime.device != self.config.device:
            raise TrainerError(f"runtime was set up for {runtime.device!r}, the backend wants {self.config.device!r}")
        self.runtime = runtime
        self.hf_config = hf_config
        self.shape = weights.Shape.from_hf(hf_config)
        self.dtype = DTYPES[self.config.dtype]
        self.pad_token_id = getattr(hf_config, "pad_token_id", None)
        self.model = build_model(hf_config, self.dtype, self.config.device)
        self.policy_version = policy_version
        self.ddp: Any = None
        self.optimizer: Any = None
        if self.config.device == "cuda":
            self._build_cuda_training()

    @classmethod
    def from_hf_model(
        cls, model: Any, config: MegatronBackendConfig | None = None, *, runtime: MegatronRuntime
    ) -> "MegatronBackend":
        """A backend holding the same weights as an HF Qwen2 model."""
        backend = cls(model.config, config, runtime=runtime)
        backend.load_weights(dict(model.named_parameters()))
        return backend

    def _build_cuda_training(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt = self.config.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.config.grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.use_distributed_optimizer,
        )
        self.ddp = DistributedDataParallel(
            transformer_config(self.hf_config, self.dtype, "cuda"), ddp_config, module=self.model
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                adam_eps=opt.eps,
                clip_grad=opt.max_grad_norm if opt.max_grad_norm is not None else 0.0,
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=self.config.use_distributed_optimizer,
            ),
            [self.ddp],
        )

    # -- the protocol ------------------------------------------------------------------------------------

    def load_weights(self, tensors: NamedTensors, *, policy_version: int | None = None) -> None:
        items = dict(tensors.items() if isinstance(tensors, Mapping) else tensors)
        mapped = weights.to_megatron(items, self.shape)
        own = dict(self.model.named_parameters())
        unknown = sorted(set(mapped) - set(own))
        missing = sorted(set(own) - set(mapped))
        if unknown or missing:
            raise TrainerError(f"load_weights: unknown {unknown[:5]}, missing {missing[:5]} (Megatron names)")
        with torch.no_grad():
            for name, tensor in mapped.items():
                if tuple(tensor.shape) != tuple(own[name].shape):
                    raise TrainerError(
                        f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
                    )
                own[name].copy_(tensor)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()
        if policy_version is not None:
            self.policy_version = policy_version

    def forward_backward(self, batch: TrainBatch, *, loss_scale: float = 1.0) -> MicroStepResult:
        self.model.train()
        device = self.config.device
        # Megatron's local attention takes a dense [B, 1, L, L] mask, not gyre's sparse TreeMask: the adapter
        # converts each micro-batch explicitly into padded passes whose mask is bounded by max_attention_area.
        plan = passes.plan(batch, self.config.max_forward_tokens, self.config.max_attention_area)
        return passes.forward_backward(
            batch, lambda group: pass_logprobs(self.model, group, device, self.pad_token_id), plan,
            loss=self.config.loss, device=device, loss_scale=loss_scale,
        )

    def gradient_buffers(self) -> list[torch.Tensor]:
        out = []
        for p in self.model.parameters():
            if self.ddp is not None:
                out.append(p.main_grad)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """Accumulated gradients in HF names and layouts (what the torch backend would hold)."""
        grads = dict(zip((n for n, _ in self.model.named_parameters()), self.gradient_buffers(), strict=True))
        return weights.to_hf(grads, self.shape)

    def zero_grad(self) -> None:
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.model.zero_grad(set_to_none=True)

    def optimizer_step(self, normalizer: float) -> StepResult:
        require_cuda("MegatronBackend.optimizer_step")
        if not normalizer > 0:
            raise TrainerError(f"optimizer_step: normalizer must be > 0, got {normalizer}")
        self.ddp.finish_grad_sync()
        self.ddp.scale_gradients(1.0 / normalizer)
        ok, grad_norm, _ = self.optimizer.step()
        self.zero_grad()
        if not ok:
            raise TrainerError(f"optimizer_step: Megatron's optimizer skipped the step (grad norm {grad_norm})")
        self.policy_version += 1
        return StepResult(policy_version=self.policy_version, grad_norm=float(grad_norm), normalizer=normalizer)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        own = {n: p.detach() for n, p in self.model.named_parameters()}
        yield from weights.to_hf(own, self.shape).items()

    def save_checkpoint(self, directory: str | Path) -> Path:
        """HF-named weights, the optimizer state (CUDA only: none exists on CPU) and the policy version."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous().cpu() for n, t in self.named_tensors()}, str(path / WEIGHTS_FILE))
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), path / OPTIMIZER_FILE)
        meta = {"policy_version": self.policy_version, "optimizer": self.optimizer is not None}
        (path / META_FILE).write_text(json.dumps(meta))
        return path

    def load_checkpoint(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        path = Path(directory)
        if not (path / WEIGHTS_FILE).exists() or not (path / META_FILE).exists():
            raise CheckpointError(f"checkpoint {path} lacks {WEIGHTS_FILE} or {META_FILE}")
        meta = json.loads((path / META_FILE).read_text())
        self.load_weights(load_file(str(path / WEIGHTS_FILE)), policy_version=int(meta["policy_version"]))
        if self.optimizer is not None and meta.get("optimizer"):
            self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=False))
