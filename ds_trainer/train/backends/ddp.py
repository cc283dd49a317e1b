"""Plain data parallel (`zero=ddp`): Accelerate's DDP wrapper, torch's optimizer (fused where the device has the
kernel) built from the same blocks as DeepSpeed's, one of DeepSpeed's LR schedule classes that the recipe registers
for checkpoints (Accelerate hands it back as it is), gradients clipped here before the optimizer step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.train.backends import accelerator as accel
from ds_trainer.train.backends.params import Whole


@dataclass
class DDP:
    """The DDP backend of a run."""

    cfg: DictConfig
    name: str = field(default="ddp", init=False)
    fused: bool = field(default=True, init=False)
    host_collectives: bool = field(default=False, init=False)
    init_label: str = field(default="DDP init", init=False)

    def start_process(self) -> None:
        from ds_trainer.config import op_cache

        op_cache.use_environment_folder()  # DDP loads no DeepSpeed op: importing DeepSpeed would only cost start-up

    def accelerator_kwargs(self, platform_kind: str) -> tuple[dict[str, Any], list[Any]]:
        from accelerate.utils import DistributedDataParallelKwargs

        kwargs = {"gradient_accumulation_steps": int(self.cfg.train.gradient_accumulation_steps),
                  "cpu": platform_kind == "cpu"}
        # DDP's buckets are the gradients instead of a second copy of them (4 bytes a parameter: 10 GB for SDXL).
        return kwargs, [DistributedDataParallelKwargs(gradient_as_bucket_view=True)]

    def after_accelerator(self, accelerator: Any, platform_kind: str) -> None:
        pass

    def whole(self, accelerator: Any) -> contextlib.AbstractContextManager[None]:  # noqa: ARG002
        return contextlib.nullcontext()

    def before_build(self, accelerator: Any) -> None:
        pass

    def own_optimizer(self, params: list[Any]) -> tuple[Any, Any] | None:  # noqa: ARG002
        return None

    def before_prepare(self, model: Any) -> None:
        # quantize=fp8: torchao's float8 weights (frozen buffers) cannot be flattened for DDP's first broadcast; each
        # rank quantized the same base from the same weights, so they are left out of DDP's syncs.
        quantized = [name for name, b in model.named_buffers() if hasattr(b, "qdata")]  # adapters.quantize.is_float8
        if quantized:
            import torch

            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantized)

    def prepare(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        return accel.prepare(accelerator, model, optimizer, scheduler)

    def masters_from_cast(self, resuming: bool) -> bool:  # noqa: ARG002
        return False  # the fp32 parameters are the masters

    def compute_dtype(self, model: Any) -> Any:  # noqa: ARG002
        import torch

        return torch.float32  # autocast computes in the precision's type

    def clip(self, accelerator: Any, model: Any, limit: float) -> Any:
        return accelerator.clip_grad_norm_(model.parameters(), limit)

    def grad_norm(self, accelerator: Any, measured: Any) -> float | None:  # noqa: ARG002
        return float(measured) if measured is not None else None

    def owns_schedule(self, accelerator: Any) -> bool:  # noqa: ARG002
        return False

    def engine(self, accelerator: Any) -> Any:  # noqa: ARG002
        return None

    def params(self, accelerator: Any) -> Whole:  # noqa: ARG002
        return Whole()

    def keep_trainable_only(self, accelerator: Any) -> dict[str, Any]:
        register_keep_trainable(accelerator)
        return {}

    def load(self, accelerator: Any, path: Path, partial: bool) -> None:
        accelerator.load_state(str(path), **({"strict": False} if partial else {}))


def register_keep_trainable(accelerator: Any) -> None:
    """A save hook that keeps the trainable tensors only (Accelerate would save the whole model)."""

    def keep_trainable(models: list[Any], weights: list[dict[str, Any]], _dir: str) -> None:
        for i, model in enumerate(models[:len(weights)]):
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            weights[i] = {k: v for k, v in weights[i].items() if k in trainable}

    accelerator.register_save_state_pre_hook(keep_trainable)
