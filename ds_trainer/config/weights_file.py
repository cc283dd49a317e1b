"""Model weights in one file (single-file checkpoints, not a run's training checkpoints): SDXL's
(`model.pretrained=<file>.safetensors|.ckpt`, the original Stability layout that model sites ship) and the
transformers' (`model.transformer=<file>.safetensors`: SD3/SD3.5 in Stability's MMDiT layout, Flux.1 in Black Forest
Labs'), recognised from their key names and shapes. Torch-free: a `.safetensors` file's header is read before a run;
a `.ckpt` is checked when it is loaded.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import families
from ds_trainer.config.problems import Problem

SUFFIXES = (".safetensors", ".ckpt")
UNET = "model.diffusion_model."
CLIP_L = "conditioner.embedders.0.transformer."
OPEN_CLIP_G = "conditioner.embedders.1.model."
VAE = "first_stage_model."


def is_single_file(path: str | None) -> bool:
    """Whether `model.pretrained` names one checkpoint file (rather than a diffusers folder or hub id)."""
    return bool(path) and Path(str(path)).suffix.lower() in SUFFIXES and not Path(str(path)).is_dir()


def safetensors_header(path: Path) -> dict[str, Any]:
    """Each tensor's entry (dtype, shape, offsets) in a .safetensors file's header (8 bytes of
    length, then JSON); ValueError saying what is wrong with a file that is not one, or is cut
    short."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little")
        if len(head) < 8 or not 0 < length <= size - 8:
            declared = length if len(head) == 8 else "nothing"
            raise ValueError(f"no safetensors header ({size} bytes; its first 8 declare a header "
                             f"of {declared}): not a .safetensors file")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError("its header is not JSON: damaged, or not a .safetensors "
                             "file") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a table of tensors: not a .safetensors file")
    tensors = {key: value for key, value in header.items() if key != "__metadata__"}
    try:
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise ValueError("its header's tensor entries lack their offsets: damaged") from None
    if 8 + length + end > size:
        raise ValueError(f"cut short: its header places tensors up to byte {8 + length + end}, "
                         f"the file ends at {size}")
    return tensors


def unreadable(path: Path) -> str | None:
    """Why a .safetensors file cannot be read (damaged, cut short, not one), or None."""
    try:
        safetensors_header(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a .safetensors file."""
    return list(safetensors_header(path))


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


def problems(cfg: DictConfig) -> list[Problem]:
    """A checkpoint file or VAE that cannot be loaded; checked before a run (`config.checks.paths`)."""
    out: list[Problem] = []
    pretrained, vae = cfg.model.pretrained, cfg.model.get("vae")
    fix = "model.pretrained=/path/to/sd_xl_base_1.0.safetensors (or a diffusers folder)"
    if pretrained and Path(pretrained).is_file() and not is_single_file(pretrained):
        out.append(Problem("model.pretrained", pretrained, f"is a file but not a checkpoint ({' or '.join(SUFFIXES)})",
                           fix))
    elif is_single_file(pretrained) and Path(pretrained).suffix.lower() == ".safetensors" and Path(pretrained).exists():
        try:
            found = what_it_is(safetensors_keys(Path(pretrained)))
        except (OSError, ValueError) as exc:
            found = f"not a readable safetensors file ({exc})"
        if found:
            out.append(Problem("model.pretrained", pretrained, f"is not an SDXL checkpoint: {found}", fix))
        elif vae is None and not any(k.startswith(VAE) for k in safetensors_keys(Path(pretrained))):
            out.append(Problem("model.pretrained", pretrained, f"holds no VAE ({VAE}*)",
                               "model.vae=/path/to/sdxl_vae.safetensors (or a diffusers VAE folder)"))
    if vae:
        out += _vae(str(vae))
    return out + _pretrained_folder(cfg)


VAE_FIX = "model.vae=/path/to/sdxl_vae.safetensors (or a diffusers VAE folder), or model.vae=null"
VAE_KEYS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", VAE)


def _vae(vae: str) -> list[Problem]:
    """`model.vae`: a diffusers VAE folder (its config.json, beside or under vae/), or one weights
    file whose header is whole and holds a VAE's keys."""
    path = Path(vae)
    if not path.exists():
        return [Problem("model.vae", vae, "does not exist", VAE_FIX)]
    if path.is_dir():
        if not ((path / "config.json").is_file() or (path / "vae" / "config.json").is_file()):
            return [Problem("model.vae", vae, "is a folder without a VAE's config.json (nor vae/"
                            "config.json): not a diffusers VAE folder", VAE_FIX)]
        return []
    if path.suffix.lower() not in SUFFIXES:
        kinds = " or ".join(SUFFIXES)
        return [Problem("model.vae", vae, f"is not a weights file ({kinds})", VAE_FIX)]
    if path.suffix.lower() == ".ckpt":
        return []  # read with torch's weights-only loader when it is loaded
    try:
        keys = safetensors_keys(path)
    except (OSError, ValueError) as exc:
        return [Problem("model.vae", vae, f"cannot be read: {exc}", VAE_FIX)]
    if not any(k.startswith(VAE_KEYS) for k in keys):
        counts = Counter(k.split(".")[0] for k in keys).most_common(4)
        heads = ", ".join(f"{p}.* ({n})" for p, n in counts) or "nothing, it is empty"
        return [Problem("model.vae", vae, f"holds no VAE (no encoder.*/decoder.* keys; its keys "
                        f"start with: {heads}): another model's file", VAE_FIX)]
    return []


def _pretrained_folder(cfg: DictConfig) -> list[Problem]:
    """A local `model.pretrained` folder is a diffusers pipeline: its model_index.json names the
    components, each a subfolder."""
    pretrained = cfg.model.pretrained
    path = Path(str(pretrained)) if pretrained else None
    if path is None or not path.is_dir():
        return []
    fix = ("model.pretrained=<a diffusers folder (model_index.json, unet/ or transformer/, "
           "vae/, ...)>, a single .safetensors file, or a hub id")
    try:
        index = json.loads((path / "model_index.json").read_text())
    except FileNotFoundError:
        inside = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
        return [Problem("model.pretrained", str(pretrained), f"is not a diffusers folder: no "
                        f"model_index.json (it holds {inside})", fix)]
    except (OSError, ValueError) as exc:
        return [Problem("model.pretrained", str(pretrained), f"its model_index.json cannot be read "
                        f"({exc})", fix)]
    if not isinstance(index, dict):
        return [Problem("model.pretrained", str(pretrained), "its model_index.json is not a table "
                        "of components", fix)]
    parts = [name for name, value in index.items()
             if not name.startswith("_") and isinstance(value, list) and value and value[0]]
    missing = sorted(name for name in parts if not (path / name).is_dir())
    if missing:
        return [Problem("model.pretrained", str(pretrained), f"its model_index.json names "
                        f"{', '.join(missing)}, which the folder lacks (a partial download?)", fix)]
    return []


def transformer_mismatch(header: dict[str, Any], family: str, arch: dict[str, Any]) -> str | None:
    """None when `header` (a .safetensors header) holds the transformer `arch` (its diffusers config) describes,
    in the original layout of `family` that diffusers' single-file loader reads; else what it holds instead."""
    shapes = {k.removeprefix(UNET): v.get("shape", []) for k, v in header.items()}
    keys = set(shapes)
    files = {s.name: s.transformer_file for s in families.SPECS.values() if s.transformer_file is not None}
    marked = [name for name, file in files.items() if file.mark in keys]
    # a file of a family built on another's blocks holds that family's mark too: it is the newer's
    found = next((n for n in marked if not any(files[o].within == n for o in marked)), None)
    if found is None:
        if any(k.startswith(("transformer_blocks.", "single_transformer_blocks.")) for k in keys):
            return ("a diffusers-format transformer (keys like transformer_blocks.*), not one in its makers' layout: "
                    "a diffusers folder goes to model.pretrained")
        if any(k.startswith(("input_blocks.", "down_blocks.")) for k in keys):
            return "a UNet (SDXL or older Stable Diffusion), not a transformer"
        heads = ", ".join(f"{p}.* ({n})" for p, n in Counter(k.split(".")[0] for k in keys).most_common(4))
        return f"no {family} transformer (its keys start with: {heads or 'nothing, it is empty'})"
    if found != family:
        return f"{files[found].label}, not {family}'s"
    file = files[family]
    if file.bare_names and any(k.startswith(UNET) for k in header):
        return (f"a {families.spec(family).label} transformer under a whole checkpoint's {UNET}* names, which "
                f"diffusers' {families.spec(family).label} loader does not strip: the transformer's own file "
                "(ComfyUI's models/diffusion_models one)")
    return file.mismatch(shapes, arch, width_of(arch))


def width_of(arch: dict[str, Any]) -> int:
    """A transformer's width from its diffusers config: its heads times their size (Z-Image's `dim`)."""
    if "dim" in arch:
        return int(arch["dim"])
    return int(arch["num_attention_heads"]) * int(arch["attention_head_dim"])


def transformer_problems(cfg: DictConfig) -> list[Problem]:
    """A `model.transformer` file that cannot be loaded as the model's transformer (`config.checks.model`)."""
    path, spec = cfg.model.transformer, families.of(cfg)
    file = spec.transformer_file
    if file is None:
        readers = ", ".join(s.name for s in families.SPECS.values() if s.transformer_file is not None)
        return [Problem("model.transformer", path, f"is for the transformer families ({readers}); an {spec.label} "
                        "checkpoint file is read through model.pretrained",
                        "model.transformer=null model.pretrained=/path/to/sd_xl_base_1.0.safetensors")]
    fix = f"model.transformer=/path/to/{file.example} (for model={cfg.model.name}), or model.transformer=null"
    if Path(path).suffix.lower() != ".safetensors":
        return [Problem("model.transformer", path, "is read as one .safetensors file (as SD3.5, Flux.1 and ComfyUI's "
                        "Qwen-Image ship)", fix)]
    if not Path(path).is_file():
        return [Problem("model.transformer", path, "no such file", fix)]
    arch = json.loads((Path(cfg.model.architecture) / "transformer" / "config.json").read_text())
    width = width_of(arch)
    if file.width is not None and width != file.width:
        return [Problem("model.transformer", path, f"model={cfg.model.name}'s transformer is {width} wide; diffusers' "
                        f"{spec.label} single-file loader reads {spec.label}'s width ({file.width}) only",
                        f"model={file.width_model} (or a diffusers folder in model.pretrained)")]
    try:
        found = transformer_mismatch(safetensors_header(Path(path)), spec.name, arch)
    except (OSError, ValueError) as exc:
        found = f"not a readable safetensors file ({exc})"
    if found:
        return [Problem("model.transformer", path, f"is not model={cfg.model.name}'s transformer: it is {found}", fix)]
    return []
