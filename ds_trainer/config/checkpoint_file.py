"""Single-file SDXL checkpoints (`model.pretrained=<file>.safetensors|.ckpt`, the original Stability
layout that model sites ship): recognising one from its key names. Torch-free: a `.safetensors`
file's keys are read from its JSON header before a run; a `.ckpt` is checked when it is loaded.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig

SUFFIXES = (".safetensors", ".ckpt")
UNET = "model.diffusion_model."
CLIP_L = "conditioner.embedders.0.transformer."
OPEN_CLIP_G = "conditioner.embedders.1.model."
VAE = "first_stage_model."


def is_single_file(path: str | None) -> bool:
    """Whether `model.pretrained` names one checkpoint file (rather than a diffusers folder or hub id)."""
    return bool(path) and Path(str(path)).suffix.lower() in SUFFIXES and not Path(str(path)).is_dir()


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a .safetensors file, from its header (8 bytes of length, then JSON)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length < 1 << 30:
            raise ValueError("no safetensors header")
        header = json.loads(f.read(length))
    return [key for key in header if key != "__metadata__"]


def what_it_is(keys: Iterable[str]) -> str | None:
    """None for an SDXL base checkpoint in the original layout; else what the keys show instead."""
    keys = set(keys)
    if not any(k.startswith(UNET) for k in keys):
        if any(k.startswith(("down_blocks.", "conv_in.", "mid_block.")) for k in keys):
            return "a diffusers-format model (keys like down_blocks.*), not a single-file checkpoint"
        heads = ", ".join(f"{p}.* ({n})" for p, n in Counter(k.split(".")[0] for k in keys).most_common(4))
        return f"no UNet under {UNET}* (its keys start with: {heads or 'nothing, it is empty'})"
    if UNET + "label_emb.0.0.weight" not in keys:
        return "a Stable Diffusion 1.x/2.x checkpoint (its UNet has no SDXL size conditioning, label_emb)"
    if not any(k.startswith(CLIP_L) for k in keys):
        if any(k.startswith("conditioner.embedders.0.model.") for k in keys):
            return "an SDXL refiner (one OpenCLIP text encoder), not an SDXL base model"
        return f"an SDXL UNet without the CLIP ViT-L text encoder ({CLIP_L}*)"
    if not any(k.startswith(OPEN_CLIP_G) for k in keys):
        return f"an SDXL UNet without the OpenCLIP bigG text encoder ({OPEN_CLIP_G}*)"
    return None


def problems(cfg: DictConfig) -> list[tuple[str, object, str, str]]:
    """(key, value, why, fix) for a checkpoint file or VAE that cannot be loaded; checked before a run."""
    out: list[tuple[str, object, str, str]] = []
    pretrained, vae = cfg.model.pretrained, cfg.model.get("vae")
    fix = "model.pretrained=/path/to/sd_xl_base_1.0.safetensors (or a diffusers folder)"
    if pretrained and Path(pretrained).is_file() and not is_single_file(pretrained):
        out.append(("model.pretrained", pretrained, f"is a file but not a checkpoint ({' or '.join(SUFFIXES)})", fix))
    elif is_single_file(pretrained) and Path(pretrained).suffix.lower() == ".safetensors" and Path(pretrained).exists():
        try:
            found = what_it_is(safetensors_keys(Path(pretrained)))
        except (OSError, ValueError) as exc:
            found = f"not a readable safetensors file ({exc})"
        if found:
            out.append(("model.pretrained", pretrained, f"is not an SDXL checkpoint: {found}", fix))
        elif vae is None and not any(k.startswith(VAE) for k in safetensors_keys(Path(pretrained))):
            out.append(("model.pretrained", pretrained, f"holds no VAE ({VAE}*)",
                        "model.vae=/path/to/sdxl_vae.safetensors (or a diffusers VAE folder)"))
    if vae and not Path(vae).exists():
        out.append(("model.vae", vae, "does not exist", "model.vae=/path/to/sdxl_vae.safetensors (or a VAE folder)"))
    return out
