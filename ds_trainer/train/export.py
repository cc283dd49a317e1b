"""The end of a run: the UNet (and EMA UNet) in diffusers format; for sdxl_tiny and a run from a single-file
checkpoint a whole pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import checkpoint_file
from ds_trainer.train import models, portable
from ds_trainer.train.ema import EMA


def diffusers(cfg: DictConfig, accelerator: Any, unet: Any, optimizer: Any, ema: EMA | None, frozen: models.Frozen,
              run_dir: Path) -> None:
    """Collective: under ZeRO-3 every rank takes part in gathering the weights (`get_state_dict`, the fp32
    masters); rank 0 writes `<run>/unet`, `<run>/unet_ema` and, for sdxl_tiny, `<run>/pipeline`.

    The UNet is exported at its most precise: in 16-bit training DeepSpeed's module holds bf16/fp16 copies and
    the fp32 master weights live in its optimizer, so the trained weights are read from there (as the portable
    state and the LoRA file do); FSDP's and DDP's modules hold the fp32 weights themselves. A bf16 run exported
    from ZeRO and one exported from FSDP so agree to the training's noise, not to bf16's rounding."""
    from diffusers import UNet2DConditionModel

    state = accelerator.get_state_dict(unet)
    masters = _masters(accelerator, unet, optimizer)  # collective
    shadow = ema.full(dst=0) if ema else None  # collective: the EMA is sharded across the ranks
    if not accelerator.is_main_process:
        return
    config = accelerator.unwrap_model(unet).config
    exported = {}
    for name, weights in (("unet", {**state, **masters}), ("unet_ema", shadow)):
        if weights is None:
            continue
        model = UNet2DConditionModel.from_config(config)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        model.save_pretrained(run_dir / name)
        exported[name] = model
    if cfg.model.name == "sdxl_tiny" or checkpoint_file.is_single_file(cfg.model.pretrained):
        _pipeline(cfg, frozen, exported.get("unet_ema", exported["unet"]), run_dir)


def _masters(accelerator: Any, unet: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Collective: the fp32 masters of the trained parameters where DeepSpeed keeps them apart from a 16-bit
    module (on rank 0; empty elsewhere and where the module's own weights are the masters)."""
    module = accelerator.unwrap_model(unet)
    if portable._engine(accelerator) is None or all(p.dtype == torch.float32 for _, p in portable.trainable(module)):
        return {}
    base = portable._base_optimizer(accelerator, optimizer)
    keep = accelerator.is_main_process
    return {name: values[0].detach().to("cpu", torch.float32, copy=True)
            for name, _, values in portable.full_values(accelerator, unet, base, moments=False)
            if keep and values[0] is not None}


def _pipeline(cfg: DictConfig, frozen: models.Frozen, unet: Any, run_dir: Path) -> None:
    from diffusers import StableDiffusionXLPipeline
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a "Writing model shards" bar per text encoder, on the terminal
    parts = (frozen.vae, frozen.text_encoder, frozen.text_encoder_2)
    if any(p.dtype != torch.float32 for p in parts):
        # Training ran them in 16 bits (a GPU run): up-casting those copies would save rounded weights as
        # float32. The pipeline gets them as loaded, from the source, on the CPU.
        frozen = models.load_frozen(cfg)
    for part in (frozen.vae, frozen.text_encoder, frozen.text_encoder_2):
        part.to("cpu")
    pipe = StableDiffusionXLPipeline(vae=frozen.vae, text_encoder=frozen.text_encoder,
                                     text_encoder_2=frozen.text_encoder_2, tokenizer=frozen.tokenizer,
                                     tokenizer_2=frozen.tokenizer_2, unet=unet,
                                     scheduler=models.inference_scheduler(cfg))
    pipe.save_pretrained(run_dir / "pipeline")  # type: ignore[attr-defined]


def base_pipeline(cfg: DictConfig, accelerator: Any, frozen: models.Frozen, run_dir: Path) -> None:
    """With `adapter=lora` on sdxl_tiny (random weights nobody else has): the untrained base pipeline on
    rank 0, so that `<run>/lora` can be loaded into it with `load_lora_weights`."""
    if cfg.model.name == "sdxl_tiny" and accelerator.is_main_process:
        _pipeline(cfg, frozen, models.load_unet(cfg).eval(), run_dir)
