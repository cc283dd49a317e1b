"""What the model families share: where weights come from (`model.pretrained`, a single file, or the architecture's
configs in `ds_trainer/assets/<model>` with random weights, so nothing is downloaded unless the user asks), how the
trained module is built (in fp32, or on the meta device for checks), the dtypes of the frozen parts, and tokenizing."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import weights_file


def source(cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """Where to load from, and the from_pretrained keyword arguments."""
    if cfg.model.pretrained and not weights_file.is_single_file(cfg.model.pretrained):
        kwargs = {"revision": cfg.model.revision, "variant": cfg.model.variant}
        return str(cfg.model.pretrained), {k: v for k, v in kwargs.items() if v}
    return str(cfg.model.architecture), {}


def trained_module(cfg: DictConfig, cls: Any, subfolder: str, single: Any = None) -> Any:
    """The module to train (a diffusers model class whose folder in a pipeline is `subfolder`) in fp32, train mode,
    with gradient checkpointing as `train` asks: from `single` (a single file's path or tensors in its makers'
    layout, its config from the architecture) or `model.pretrained`, else built with random weights."""
    path, kwargs = source(cfg)
    if single is not None:
        model = cls.from_single_file(single, config=str(cfg.model.architecture), subfolder=subfolder,
                                     local_files_only=True, torch_dtype=torch.float32)
    elif cfg.model.pretrained:
        model = cls.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.float32, **kwargs)
    else:
        torch.manual_seed(int(cfg.train.seed))
        model = cls.from_config(cls.load_config(path, subfolder=subfolder))
    if cfg.train.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model


def meta_module(cfg: DictConfig, cls: Any, subfolder: str) -> torch.nn.Module:
    """The module `trained_module` builds, on the meta device (no memory): for checks before training."""
    path, kwargs = source(cfg)
    with torch.device("meta"):
        model: torch.nn.Module = cls.from_config(cls.load_config(path, subfolder=subfolder, **kwargs))
    return model


# The torch dtype of an exported file's `SaveDtype` (adapter.save_dtype, export.dtype).
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FROZEN_DTYPES = {"bf16": "bfloat16", "bf16_pure": "bfloat16", "fp16": "float16", "fp32": "float32"}


def frozen_dtype_name(cfg: DictConfig, kind: str) -> str:
    """The dtype the text encoders (and a VAE without force_upcast) run in: float32 on the CPU (where 16-bit
    is emulated for much of a text encoder and slower), else the run's `precision` (fp16 on GPUs without
    bf16, float32 when asked). Part of the latent cache's identity."""
    return "float32" if kind == "cpu" else FROZEN_DTYPES[cfg.precision.name.value]


def lora_base_dtype(cfg: DictConfig) -> torch.dtype | None:
    """The 16-bit type the frozen base under a LoRA (the UNet's, a text encoder's) is held in during 16-bit
    training, as the forward computes in it; None under fp32."""
    return {"bf16": torch.bfloat16, "bf16_pure": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.name.value)


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """The floating-point parameters of `module` that do not train, to `dtype` in place (the trained ones stay fp32;
    a quantized weight keeps its integers)."""
    for p in module.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def token_ids(tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample's mean squared error, in fp32; with `weight` (the masked loss's map, broadcast over the error's
    shape) the mean of the weighted errors over the whole latent, as kohya's masked loss takes it."""
    error = torch.nn.functional.mse_loss(pred.float(), target.to(pred.device).float(), reduction="none")
    if weight is not None:
        error = error * weight.to(error.device, error.dtype)
    return error.mean(dim=list(range(1, error.ndim)))


def reference_keys(count: int) -> list[str]:
    """A batch's keys of an editing model's `count` references' latents: `control_latents`, then
    `control_latents_1`, ... (the data's cache writes them, the families' losses read them)."""
    return ["control_latents", *(f"control_latents_{n}" for n in range(1, count))]


def source_weights(batch: dict[str, torch.Tensor], losses: torch.Tensor) -> torch.Tensor:
    """`losses` (one per sample) times each sample's source's loss_weight (data.sources), where the batch has them."""
    weights = batch.get("loss_weight")
    return losses if weights is None else losses * weights.to(losses.device, losses.dtype)
