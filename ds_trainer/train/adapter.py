"""What a run trains: the whole UNet (`adapter=none`) or LoRA adapters on a frozen UNet (`adapter=lora`).

The recipe calls it at named points: `build` after loading the UNet (inject, freeze, cast the frozen
base to 16-bit), `parameters` for the optimizer, `save_kwargs`/`load_kwargs` for checkpoints that hold
the trainable state only, `on_save` with each checkpoint and `export` at the end (the diffusers LoRA file).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config.adapter_rules import Rule
from ds_trainer.train import lora_file
from ds_trainer.train.lora_file import adaptable_names

log = logging.getLogger("ds_trainer")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def enabled(cfg: DictConfig) -> bool:
    return bool(cfg.adapter.method.value == "lora")


def lora_config(cfg: DictConfig) -> Any:
    """peft's LoraConfig of `cfg.adapter` (B starts at zero: the adapted UNet starts as the base)."""
    from peft import LoraConfig

    a = cfg.adapter
    return LoraConfig(r=int(a.rank), lora_alpha=int(a.alpha), lora_dropout=float(a.dropout),
                      target_modules=list(a.targets), init_lora_weights="gaussian")


def _inject(cfg: DictConfig, unet: torch.nn.Module) -> None:
    """Freeze the UNet, then add the adapters (peft makes only them trainable)."""
    unet.requires_grad_(False)
    unet.add_adapter(lora_config(cfg))  # type: ignore[operator]


def _meta_unet(cfg: DictConfig) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    from ds_trainer.train.models import _source

    path, kwargs = _source(cfg)
    with torch.device("meta"):
        unet: torch.nn.Module = UNet2DConditionModel.from_config(
            UNet2DConditionModel.load_config(path, subfolder="unet", **kwargs))
    return unet


def inspect(cfg: DictConfig) -> tuple[list[Rule], int]:
    """Before training, on the UNet built on the meta device (no memory): the problems only the model
    shows (targets that match no module, listing the names that exist; an `adapter.init_from` file whose
    tensors do not fit) and the number of trainable parameters."""
    if not enabled(cfg):
        return [], int(cfg.model.param_count)
    unet = _meta_unet(cfg)
    names = adaptable_names(unet)
    unmatched = [t for t in cfg.adapter.targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        endings = sorted({".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]
                          for n in names})
        return [("adapter.targets", list(cfg.adapter.targets),
                 f"{', '.join(unmatched)}: no Linear/Conv module of the UNet has such a name; the names end "
                 f"with: {', '.join(endings)}", "adapter.targets=[to_q,to_k,to_v,to_out.0] (or adapter=lora_wide)")], 0
    _inject(cfg, unet)
    count = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    if cfg.adapter.init_from is not None:
        why = lora_file.mismatch(Path(cfg.adapter.init_from), unet)
        if why:
            return [("adapter.init_from", cfg.adapter.init_from, why,
                     "the adapter.rank and adapter.targets the file was trained with, or another file")], count
    return [], count


@dataclass
class Trained:
    """The trained part of the UNet. With `adapter=none` every method does what the full fine-tune did."""

    cfg: DictConfig
    unet: torch.nn.Module
    names: list[str] = field(default_factory=list)  # the trainable parameters' names (LoRA only)

    @property
    def lora(self) -> bool:
        return bool(self.names)

    @property
    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """What the optimizer gets: the trainable parameters only (frozen ones would get fp32 copies)."""
        if not self.lora:
            return self.unet.parameters()
        return [p for p in self.unet.parameters() if p.requires_grad]

    def count(self) -> int:
        return sum(p.numel() for p in self.unet.parameters() if p.requires_grad)

    def save_kwargs(self, deepspeed: bool) -> dict[str, Any]:
        """`accelerator.save_state` keyword arguments: DeepSpeed leaves frozen parameters out."""
        return {"exclude_frozen_parameters": True} if self.lora and deepspeed else {}

    def load_kwargs(self, deepspeed: bool) -> dict[str, Any]:
        """`accelerator.load_state` keyword arguments: the frozen base comes from the model, not the checkpoint."""
        if not self.lora:
            return {}
        return {"load_module_strict": False} if deepspeed else {"strict": False}

    def after_prepare(self, accelerator: Any, unet: Any) -> None:
        """Collective, after `accelerator.prepare`: exact fp32 masters from `adapter.init_from`, and without
        DeepSpeed a save hook (Accelerate would save the whole model) that keeps the trainable tensors only."""
        if not self.lora:
            return
        engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if self.cfg.adapter.init_from is not None:
            lora_file.set_fp32(accelerator.unwrap_model(unet), self.names, Path(self.cfg.adapter.init_from),
                               engine.engine if engine else None)
        if engine is not None:
            return

        def keep_trainable(models: list[Any], weights: list[dict[str, Any]], _dir: str) -> None:
            for i, model in enumerate(models[:len(weights)]):
                trainable = {n for n, p in model.named_parameters() if p.requires_grad}
                weights[i] = {k: v for k, v in weights[i].items() if k in trainable}

        accelerator.register_save_state_pre_hook(keep_trainable)

    def on_save(self, accelerator: Any, unet: Any, ema: Any, run_dir: Path) -> None:
        """Collective, after each checkpoint: the LoRA file of the weights so far."""
        if self.lora:
            self.export(accelerator, unet, ema, run_dir)

    def export(self, accelerator: Any, unet: Any, ema: Any, run_dir: Path) -> None:
        """Collective: `<run>/lora/pytorch_lora_weights.safetensors` (and `<run>/lora_ema/` with EMA) from
        the fp32 master weights, gathered on every rank whatever the ZeRO stage; rank 0 writes."""
        engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
        module = accelerator.unwrap_model(unet)
        weights = lora_file.gather_fp32(module, self.names, engine.engine if engine else None,
                                        accelerator.is_main_process)
        shadow = ema.full(dst=0) if ema is not None else None  # collective: the EMA is sharded across the ranks
        if not accelerator.is_main_process:
            return
        dtype = _DTYPES[self.cfg.adapter.save_dtype.value]
        lora_file.write(run_dir / "lora", module, weights, dtype)
        if shadow is not None:
            lora_file.write(run_dir / "lora_ema", module, shadow, dtype)


def build(cfg: DictConfig, unet: torch.nn.Module) -> Trained:
    """Before `accelerator.prepare`: with `adapter=lora` inject the adapters, freeze and cast the base to
    the training precision's 16-bit type (the adapters stay fp32), and load `adapter.init_from`."""
    if not enabled(cfg):
        return Trained(cfg, unet)
    _inject(cfg, unet)
    half = {"bf16": torch.bfloat16, "bf16_pure": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.name.value)
    if half is not None:
        for p in unet.parameters():
            if not p.requires_grad:
                p.data = p.data.to(half)
    if cfg.adapter.init_from is not None:
        lora_file.load_into(Path(cfg.adapter.init_from), unet)
        log.info("LoRA initialised from %s", cfg.adapter.init_from)
    trained = Trained(cfg, unet, [n for n, p in unet.named_parameters() if p.requires_grad])
    total = sum(p.numel() for p in unet.parameters())
    log.info("adapter=lora: training %d of %d UNet parameters (%.2f%%), rank %d, alpha %g, targets %s",
             trained.count(), total, 100 * trained.count() / total, cfg.adapter.rank, cfg.adapter.alpha,
             list(cfg.adapter.targets))
    return trained
