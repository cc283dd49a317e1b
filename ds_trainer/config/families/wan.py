"""Wan's facts (2.1 and 2.2: text to video, image to video, TI2V-5B, the two-expert A14B): a video
diffusion transformer (3-axis RoPE over frames, rows and columns of 1 x 2 x 2 patches) trained by
flow matching on a causal 3D VAE's latents (4x in time, 8x or 16x in space), captions by UMT5; its
single file the transformer alone in the original Wan names, as ComfyUI loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_trainer.config import formats
from ds_trainer.config.families.spec import FamilySpec, Phase, TransformerFile, blocks_mismatch
from ds_trainer.config.problems import Problem

# The caption tokens WanImageToVideoPipeline's attention takes the image tokens after (its processor
# cuts there).
I2V_TEXT_TOKENS = 512


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """The original layout against the architecture: its blocks, width and input channels (16 for
    text to video, 36 for Wan 2.1's and 2.2's image to video, 48 for TI2V-5B)."""
    found = blocks_mismatch(set(shapes), "blocks", int(arch["num_layers"]))
    if found:
        return found
    out_width, in_channels = (shapes.get("patch_embedding.weight", [0, 0]) + [0, 0])[:2]
    if out_width != width:
        return (
            f"a Wan transformer {out_width} wide, the architecture {width}: "
            "another model's transformer"
        )
    if in_channels != int(arch["in_channels"]):
        return (
            f"a Wan transformer of {in_channels} input channels, the architecture "
            f"{arch['in_channels']} (16: text to video, 36: image to video, 48: TI2V-5B)"
        )
    return None


def _config(cfg: Any, folder: str) -> dict[str, Any] | None:
    """A component's config.json in the model's architecture folder (None where it has none)."""
    path = Path(str(cfg.model.architecture)) / folder / "config.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _rules(cfg: Any) -> list[Problem]:
    """model.video.condition against the transformer's inputs (its channels, its image keys) and the
    captions' length; the experts against the pipeline's second transformer."""
    transformer, vae = _config(cfg, "transformer"), _config(cfg, "vae")
    if cfg.model.video is None or transformer is None or vae is None:
        return []
    both = _value(cfg.model.video.expert) == "both"
    return [*_condition(cfg, transformer, int(vae.get("z_dim", 16))), *_experts(cfg),
            *(_both(cfg) if both else []), *_other_expert(cfg)]


def _value(choice: Any) -> str:
    """A choice's name, from its enum or as given."""
    return str(getattr(choice, "value", choice))


def _condition(cfg: Any, transformer: dict[str, Any], z: int) -> list[Problem]:
    """The conditioning the transformer's input channels and image keys take; I2V's caption
    length."""
    condition, channels = cfg.model.video.condition.value, int(transformer["in_channels"])
    image, out = bool(transformer.get("image_dim")), []
    fits = {"none": channels == z, "first_frame": channels == z,
            "latents": channels == 2 * z + 4 and not image,
            "clip_and_latents": channels == 2 * z + 4 and image}
    if not fits[condition]:
        takes = [name for name, fit in fits.items() if fit] or ["none"]
        out.append(Problem(
            "model.video.condition", condition,
            f"model={cfg.model.name}'s transformer takes {channels} input channels ({z}: the "
            f"latents alone; {2 * z + 4}: the latents, a 4-channel mask and the first frame's "
            "latents; CLIP's image tokens with image keys), which fits condition "
            f"{' or '.join(takes)}", f"model.video.condition={takes[0]}"))
    length = int(cfg.model.flow.text_max_length)
    if condition == "clip_and_latents" and length != I2V_TEXT_TOKENS:
        out.append(Problem(
            "model.flow.text_max_length", length,
            f"Wan 2.1 I2V's cross-attention takes the image tokens after the first "
            f"{I2V_TEXT_TOKENS} (its processor cuts there): a shorter caption would be read as "
            "image tokens", f"model.flow.text_max_length={I2V_TEXT_TOKENS}"))
    return out


def _experts(cfg: Any) -> list[Problem]:
    """A boundary where the architecture has two experts (transformer and transformer_2), none
    where it has one."""
    boundary, second = cfg.model.video.boundary, _config(cfg, "transformer_2") is not None
    if boundary is not None and not second:
        return [Problem("model.video.boundary", boundary,
                        f"model={cfg.model.name} has one transformer; a boundary splits the "
                        "timesteps between two experts (Wan 2.2 A14B)",
                        "model.video.boundary=null")]
    if boundary is None and second:
        return [Problem("model.video.boundary", None,
                        f"model={cfg.model.name} has two experts (transformer, transformer_2); the "
                        "boundary says which timesteps each denoises",
                        "model.video.boundary=0.875 (T2V A14B's; 0.9 for I2V A14B)")]
    if boundary is not None and not 0.0 < float(boundary) < 1.0:
        return [Problem("model.video.boundary", boundary,
                        "is a share of the timesteps, between 0 and 1",
                        "model.video.boundary=0.875")]
    return []


def _both(cfg: Any) -> list[Problem]:
    """expert=both: two experts to train, from the pipeline's folder, and what the low-noise phase
    reads of the high-noise one's export (its transformer folder, or its diffusers LoRA file)."""
    out, method = [], _value(cfg.adapter.method)
    if cfg.model.video.boundary is None:
        return [Problem("model.video.expert", "both", f"model={cfg.model.name} has one "
                        "transformer: there is one expert to train",
                        "model.video.expert=high (a one-transformer model ignores it)")]
    if cfg.model.get("transformer"):
        out.append(Problem("model.transformer", cfg.model.transformer, "is one expert's file; "
                           "model.video.expert=both trains both from model.pretrained's folders",
                           "model.transformer=null, or model.video.expert=high|low (the file's)"))
    if cfg.model.video.get("other_expert"):
        out.append(Problem("model.video.other_expert", cfg.model.video.other_expert,
                           "model.video.expert=both trains both: the low-noise phase's other "
                           "expert is the high-noise phase's own", "model.video.other_expert=null"))
    if not cfg.train.export:
        out.append(Problem("train.export", False, "model.video.expert=both: the low-noise phase "
                           "samples and exports beside the high-noise phase's export",
                           "train.export=true"))
    return out + _read_back(cfg, method)


def _read_back(cfg: Any, method: str) -> list[Problem]:
    """The low-noise phase reads the high-noise phase's export back (formats.py's `read_back`
    records): a format of it among the run's, holding the adapter's method."""
    key = "adapter" if method != "none" else "export"
    readable = [f for f in (formats.LORA if key == "adapter" else formats.MODEL).values()
                if f.read_back]
    given = formats.names(cfg[key].formats)
    if key == "adapter" and not any(method in f.methods for f in readable):
        held = sorted({m for f in readable for m in f.methods})
        return [Problem("adapter.method", method, "model.video.expert=both: the low-noise phase "
                        "reads the high-noise phase's adapter back with "
                        f"{', '.join(f.readers for f in readable)}, which holds {', '.join(held)}",
                        f"adapter={held[0]}, or model.video.expert=high, then low, in runs of "
                        "their own")]
    if not any(f.name in given for f in readable):
        wanted = [*given, *(f.name for f in readable)]
        return [Problem(f"{key}.formats", given, "model.video.expert=both: the low-noise phase "
                        "reads the high-noise phase's export back from "
                        f"{' or '.join(f.name for f in readable)} files",
                        f"{key}.formats=[{','.join(wanted)}]")]
    return []


def _other_expert(cfg: Any) -> list[Problem]:
    """model.video.other_expert: a model of two experts, and a transformer or LoRA folder."""
    given = cfg.model.video.get("other_expert")
    if not given:
        return []
    if cfg.model.video.boundary is None:
        return [Problem("model.video.other_expert", given, f"model={cfg.model.name} has one "
                        "transformer: there is no other expert", "model.video.other_expert=null")]
    path = Path(str(given))
    readable = (path / "config.json", path / "pytorch_lora_weights.safetensors")
    if any(p.is_file() for p in readable) or (path.is_file() and path.suffix == ".safetensors"):
        return []
    return [Problem("model.video.other_expert", given, "is neither a diffusers transformer folder "
                    "(its config.json) nor a diffusers-layout LoRA (pytorch_lora_weights"
                    ".safetensors)", "model.video.other_expert=<run>/transformer (a full "
                    "fine-tune's) or <run>/lora, or null (the source's)")]


def _phases(cfg: Any) -> list[Phase]:
    """expert=both: the high-noise expert's run on its timesteps, then the low-noise one's on its,
    beside the first phase's export (what its pipeline holds: the EMA where one trained, the LoRA
    on the source's), so that the low-noise phase's samples and export hold both trained."""
    video = cfg.model.get("video")
    if video is None or video.boundary is None or _value(video.expert) != "both":
        return []
    trained = "transformer"
    if _value(cfg.adapter.method) != "none":
        trained = "lora"
    elif cfg.train.ema:
        trained = "transformer_ema"
    low = {"model.video.expert": "low",
           "model.video.other_expert": f"{{run}}/experts/high/{trained}"}
    return [Phase("high", "experts/high", {"model.video.expert": "high"}, "transformer"),
            Phase("low", "experts/low", low, "transformer_2")]


def _text_tokens(cfg: Any) -> int:
    """UMT5's caption tokens: the pipeline pads every caption to max_sequence_length with zeros."""
    return int(cfg.model.flow.text_max_length)


def _context_lengths(cfg: Any, width: int, height: int, frames: int) -> dict[str, int]:
    """The plan splits the clip's tokens (latent frames x rows x columns of 1 x 2 x 2 patches;
    TI2V's timesteps with them); the caption is not split."""
    side = int(cfg.model.downsample_factor)
    return {"clip tokens": ((frames - 1) // 4 + 1) * (height // side) * (width // side)}


SPEC = FamilySpec(
    name="wan",
    label="Wan",
    component="transformer",
    module_classes=("WanTransformer3DModel",),
    implementation="ds_trainer.train.families.wan:Wan",
    text_encoders=("t5",),  # UMT5-XXL: data.text_encoder_dropout.t5 names it
    caption_limit=512,
    pipeline="WanPipeline",
    fp16=(
        "Wan's UMT5 overflows in fp16 as T5 does, and Wan's transformers were trained and are "
        "released in bf16"
    ),
    transformer_file=TransformerFile(
        mark="blocks.0.cross_attn.norm_k.weight",
        label="a Wan transformer (the original Wan layout, as ComfyUI's file)",
        example="wan2.1_t2v_14B_bf16.safetensors",
        mismatch=_mismatch,
    ),
    code_url="https://github.com/Wan-Video/Wan2.2",
    # musubi-tuner's name (the official weights carry no model spec)
    modelspec_architecture="wan2.1",
    kohya_base_version="wan",
    kohya_readers="ComfyUI (`models/loras`), musubi-tuner, diffusers' `load_lora_weights`",
    diffusers_lora_in_comfyui=False,
    tags=("wan", "text-to-video"),
    text_tokens=_text_tokens,
    input_layer="patch_embedding",
    video=True,
    temporal_factor=4,
    rules=_rules,
    context_lengths=_context_lengths,
    phases=_phases,
)
