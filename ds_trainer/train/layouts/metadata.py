"""What an exported file says of itself in its safetensors header: Stability's model-spec keys (`modelspec.*`, read
by ComfyUI, Forge and model sites) on checkpoints and LoRA files, and kohya's training keys (`ss_*`, read by kohya's
tools and the sites' LoRA pages) on a kohya-layout LoRA file."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

SPEC_VERSION = "1.0.1"  # Stability's ModelSpec, as sd-scripts writes it (library/sai_model_spec.py)
_IMPLEMENTATION = {"sdxl": "https://github.com/Stability-AI/generative-models",
                   "sd3": "https://github.com/Stability-AI/generative-models",
                   "flux": "https://github.com/black-forest-labs/flux"}


def _value(v: object) -> str:
    return str(getattr(v, "value", v))


def architecture(cfg: DictConfig, family: str) -> str:
    """modelspec.architecture of the base model, in sd-scripts' names (SwarmUI reads them too)."""
    name = str(cfg.model.name)
    if family == "sd3":
        return "stable-diffusion-3-5-large" if "large" in name else "stable-diffusion-3-5-medium"
    if family == "flux":
        return "flux-1-schnell" if "schnell" in name else "flux-1-dev"
    return "stable-diffusion-xl-v1-base"


def kohya_version(cfg: DictConfig, family: str) -> str:
    """kohya's ss_base_model_version (sdxl_model_util, flux_utils, SD3's mmdit.model_type)."""
    if family == "sd3":
        return "5-large" if "large" in str(cfg.model.name) else "5-medium"
    return {"flux": "flux1"}.get(family, "sdxl_base_v1-0")


def _prediction(run: Run) -> str:
    return "v" if run.family.schedule(run.cfg).config.prediction_type == "v_prediction" else "epsilon"


def _common(run: Run, kind: str, ema: bool) -> dict[str, str]:
    cfg, family = run.cfg, run.family.name
    title = f"{run.run_dir.name}{' (EMA)' if ema else ''}"
    out = {"modelspec.sai_model_spec": SPEC_VERSION,
           "modelspec.architecture": architecture(cfg, family) + kind,
           "modelspec.implementation": _IMPLEMENTATION[family],
           "modelspec.title": title,
           "modelspec.date": datetime.date.today().isoformat(),
           "modelspec.resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
           "modelspec.description": f"Trained by ds_trainer from {base_model(cfg)}.",
           "modelspec.implementation_version": "ds_trainer",
           }
    if family == "sdxl":  # the flow models have no such choice (sd-scripts leaves it out for Flux)
        out["modelspec.prediction_type"] = _prediction(run)
    return out


def base_model(cfg: DictConfig) -> str:
    return str(cfg.model.transformer or cfg.model.pretrained or cfg.model.name)


def checkpoint(run: Run, ema: bool = False) -> dict[str, str]:
    """A single-file checkpoint's header."""
    return _common(run, "", ema)


def kohya_lora(run: Run, ema: bool, rank: int, alpha: float, steps: int) -> dict[str, str]:
    """A kohya-layout LoRA file's header: the model spec (`.../lora`) and kohya's `ss_*` training keys."""
    cfg, family = run.cfg, run.family.name
    te = cfg.text_encoders.mode.value if "text_encoders" in cfg else "frozen"
    out = _common(run, "/lora", ema)
    out.update({
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": kohya_version(cfg, family),
        "ss_v2": "False",
        "ss_output_name": run.run_dir.name,
        "ss_sd_model_name": Path(base_model(cfg)).name,
        "ss_resolution": f"({cfg.resolution.width}, {cfg.resolution.height})",
        "ss_steps": str(steps),
        "ss_max_train_steps": str(cfg.train.max_steps),
        "ss_learning_rate": str(cfg.optimizer.lr),
        "ss_unet_lr": str(cfg.optimizer.lr),
        "ss_text_encoder_lr": str(cfg.text_encoders.lr if te == "lora" and cfg.text_encoders.lr else
                                  (cfg.optimizer.lr if te == "lora" else 0)),
        "ss_network_train_unet_only": str(te != "lora"),
        "ss_optimizer": _value(cfg.optimizer.name),
        "ss_lr_scheduler": _value(cfg.scheduler.name),
        "ss_lr_warmup_steps": str(cfg.scheduler.get("warmup_steps", 0)),
        "ss_seed": str(cfg.train.seed),
        "ss_mixed_precision": _value(cfg.precision.name),
        "ss_gradient_accumulation_steps": str(cfg.train.gradient_accumulation_steps),
        "ss_batch_size_per_device": str(cfg.train.micro_batch_size),
        "ss_noise_offset": str(cfg.train.noise_offset),
        "ss_min_snr_gamma": str(cfg.train.min_snr_gamma),
        "ss_network_args": json.dumps({"targets": list(cfg.adapter.targets), "dropout": cfg.adapter.dropout}),
        "ss_training_comment": "ds_trainer",
    })
    return out
