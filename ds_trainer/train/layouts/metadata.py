"""What an exported file says of itself in its safetensors header: Stability's model-spec keys (`modelspec.*`, read
by ComfyUI, Forge and model sites) on checkpoints and LoRA files, and kohya's training keys (`ss_*`, read by kohya's
tools and the sites' LoRA pages) on a kohya-layout LoRA file."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from ds_trainer.config import families, schema

if TYPE_CHECKING:
    from ds_trainer.train.families import Family

SPEC_VERSION = "1.0.1"  # Stability's ModelSpec, as sd-scripts writes it (library/sai_model_spec.py)


def value_of(v: object) -> str:
    """A config value as text: an enum's value, anything else as it prints."""
    return str(getattr(v, "value", v))


def architecture(cfg: DictConfig) -> str:
    """modelspec.architecture of the base model, in sd-scripts' names (SwarmUI reads them too): the model option's
    (`model.about`), else its family's."""
    return str(about(cfg).get("modelspec_architecture") or families.of(cfg).modelspec_architecture)


def kohya_version(cfg: DictConfig) -> str:
    """kohya's ss_base_model_version (sdxl_model_util, flux_utils, SD3's mmdit.model_type): the option's, else its
    family's."""
    return str(about(cfg).get("kohya_base_version") or families.of(cfg).kohya_base_version)


def about(cfg: DictConfig) -> DictConfig:
    """What the model option says it is (`model.about`: license, base id, ...); empty where a
    config has none."""
    return cfg.model.get("about") or DictConfig({})


def _prediction(cfg: DictConfig, family: Family) -> str:
    return "v" if family.schedule(cfg).config.prediction_type == "v_prediction" else "epsilon"


def _common(cfg: DictConfig, model: Family, run_dir: Path, kind: str, ema: bool) -> dict[str, str]:
    title = f"{run_dir.parent.name} {run_dir.name}{' (EMA)' if ema else ''}"
    out = {"modelspec.sai_model_spec": SPEC_VERSION,
           "modelspec.architecture": architecture(cfg) + kind,
           "modelspec.implementation": model.spec.code_url,
           "modelspec.title": title,
           "modelspec.date": datetime.date.today().isoformat(),
           "modelspec.resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
           "modelspec.description": f"Trained by ds_trainer from {base_model(cfg)}.",
           "modelspec.implementation_version": "ds_trainer",
           }
    if not model.spec.flow:  # the flow models have no such choice (sd-scripts leaves it out for Flux)
        out["modelspec.prediction_type"] = _prediction(cfg, model)
    return out


def base_model(cfg: DictConfig) -> str:
    return str(cfg.model.transformer or cfg.model.pretrained or cfg.model.name)


def checkpoint(cfg: DictConfig, model: Family, run_dir: Path, ema: bool = False) -> dict[str, str]:
    """A single-file checkpoint's header."""
    return _common(cfg, model, run_dir, "", ema)


def kohya_lora(cfg: DictConfig, model: Family, run_dir: Path, ema: bool = False) -> dict[str, str]:
    """A kohya-layout LoRA file's header: the model spec (`.../lora`) and kohya's `ss_*` training keys."""
    te = value_of(cfg.text_encoders.mode) if "text_encoders" in cfg else "frozen"
    rank, alpha, steps = int(cfg.adapter.rank), float(cfg.adapter.alpha), int(cfg.train.max_steps)
    out = _common(cfg, model, run_dir, "/lora", ema)
    method = value_of(cfg.adapter.method)
    lycoris = {"algo": method, **({"factor": str(cfg.adapter.factor)} if method == "lokr" else {})}
    out.update({
        # LoKr and LoHa as LyCORIS' kohya module names them (sd-scripts' --network_module lycoris.kohya)
        "ss_network_module": "lycoris.kohya" if method in schema.LYCORIS_METHODS else "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": kohya_version(cfg),
        "ss_v2": "False",
        "ss_output_name": f"{run_dir.parent.name}_{run_dir.name}",
        "ss_sd_model_name": Path(base_model(cfg)).name,
        "ss_resolution": f"({cfg.resolution.width}, {cfg.resolution.height})",
        "ss_steps": str(steps),
        "ss_max_train_steps": str(cfg.train.max_steps),
        "ss_learning_rate": str(cfg.optimizer.lr),
        "ss_unet_lr": str(cfg.optimizer.lr),
        "ss_text_encoder_lr": str(cfg.text_encoders.lr if te == "lora" and cfg.text_encoders.lr else
                                  (cfg.optimizer.lr if te == "lora" else 0)),
        "ss_network_train_unet_only": str(te != "lora"),
        "ss_optimizer": value_of(cfg.optimizer.name),
        "ss_lr_scheduler": value_of(cfg.scheduler.name),
        "ss_lr_warmup_steps": str(cfg.scheduler.get("warmup_steps", 0)),
        "ss_seed": str(cfg.train.seed),
        "ss_mixed_precision": value_of(cfg.precision.name),
        "ss_gradient_accumulation_steps": str(cfg.train.gradient_accumulation_steps),
        "ss_batch_size_per_device": str(cfg.train.micro_batch_size),
        "ss_noise_offset": str(cfg.train.noise_offset),
        "ss_min_snr_gamma": str(cfg.train.min_snr_gamma),
        "ss_network_args": json.dumps({**(lycoris if method in schema.LYCORIS_METHODS else {}),
                                       "targets": list(cfg.adapter.targets), "dropout": cfg.adapter.dropout}),
        "ss_training_comment": "ds_trainer",
    })
    return out
