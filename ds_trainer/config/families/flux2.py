"""FLUX.2's facts ([dev] and [klein] 4B/9B): a transformer of double- and single-stream blocks
with shared modulation, trained by flow matching with the resolution-dependent shift on
AutoencoderKLFlux2's patchified, batch-norm-normalised latents (one token per 2 x 2 patch of
them), 4-axis position ids; captions by one language model's stacked hidden states ([dev]: Mistral
Small 3.1; [klein]: Qwen3); [dev]'s distilled guidance input; its single file the transformer
alone in Black Forest Labs' layout, as ComfyUI loads flux2-dev.safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_trainer.config.families.flux import SPEC as FLUX
from ds_trainer.config.families.spec import (
    FamilySpec,
    TransformerFile,
    blocks_mismatch,
    width_mismatch,
)
from ds_trainer.config.problems import Problem

HAS = {True: "with", False: "without"}


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """Black Forest Labs' file against the architecture: its guidance input, blocks and width."""
    keys = set(shapes)
    guided = "guidance_in.in_layer.weight" in keys
    if guided != bool(arch.get("guidance_embeds")):
        return (f"a FLUX.2 transformer {HAS[guided]} a guidance input ([dev] has one, [klein] "
                f"not), the architecture {HAS[bool(arch.get('guidance_embeds'))]}")
    for name, key in (("double_blocks", "num_layers"), ("single_blocks", "num_single_layers")):
        found = blocks_mismatch(keys, name, int(arch[key]))
        if found:
            return found
    return width_mismatch(shapes, "img_in.weight", width)


def _text_tokens(cfg: Any) -> int:
    """The language model's sequence, padded to model.flow.text_max_length (the pipelines' 512)."""
    return int(cfg.model.flow.text_max_length)


def _context_lengths(cfg: Any, width: int, height: int,
                     frames: int) -> dict[str, int]:  # noqa: ARG001 - a still image
    """diffusers' plan splits the image's packed tokens and the caption's (their ids with them)."""
    return {"image tokens": (width // 16) * (height // 16),
            "caption tokens (model.flow.text_max_length)": int(cfg.model.flow.text_max_length)}


def _guided(cfg: Any) -> bool | None:
    """Whether the architecture's transformer has a guidance input (None: its config unread)."""
    config = Path(str(cfg.model.architecture)) / "transformer" / "config.json"
    try:
        return bool(json.loads(config.read_text()).get("guidance_embeds"))
    except (OSError, ValueError):
        return None


def _rules(cfg: Any) -> list[Problem]:
    """model.flow.guidance against the transformer's guidance input; no negative prompt (FLUX.2's
    pipelines take none)."""
    out, guided = [], _guided(cfg)
    flow = cfg.model.get("flow")
    guidance = None if flow is None else flow.guidance
    if guided is not None and guided != (guidance is not None):
        fix, takes = "model.flow.guidance=null", "has no"
        if guided:
            fix, takes = "model.flow.guidance=3.5 (what model=flux2_dev trains with)", "takes"
        out.append(Problem("model.flow.guidance", guidance, f"model={cfg.model.name}'s transformer "
                           f"{takes} guidance input (FLUX.2 [dev] has one, [klein] not)", fix))
    samples = cfg.get("samples")
    if samples is not None and samples.enabled and str(samples.negative_prompt):
        why = ("FLUX.2's pipelines take no negative prompt ([dev] is guidance-distilled; [klein] "
               "guides against the empty caption)")
        out.append(Problem("samples.negative_prompt", samples.negative_prompt, why,
                           "samples.negative_prompt=''"))
    return out


SPEC = FamilySpec(
    name="flux2",
    label="FLUX.2",
    component="transformer",
    module_classes=("Flux2Transformer2DModel",),
    implementation="ds_trainer.train.families.flux2:Flux2",
    text_encoders=("llm",),  # Mistral Small 3.1 ([dev]) or Qwen3 ([klein]): one language model
    guidance_input=True,
    dynamic_shift=True,
    pipeline="Flux2Pipeline",
    fp16=(
        "FLUX.2's transformer leaves fp16's range (diffusers clips its single-stream blocks' "
        "activations to +-65504 in fp16) and it and its text encoders are released in bf16"
    ),
    transformer_file=TransformerFile(
        mark="single_stream_modulation.lin.weight",
        label="a FLUX.2 transformer (Black Forest Labs' layout, as flux2-dev.safetensors)",
        example="flux2-dev.safetensors",
        mismatch=_mismatch,
        within=FLUX.name,
    ),
    code_url="https://github.com/black-forest-labs/flux2",
    modelspec_architecture="flux-2-dev",
    kohya_base_version="flux2",
    kohya_readers="ComfyUI (`models/loras`), musubi-tuner, diffusers' `load_lora_weights`",
    diffusers_lora_in_comfyui=False,
    tags=("flux2", "text-to-image"),
    text_tokens=_text_tokens,
    context_lengths=_context_lengths,
    input_layer="x_embedder",
    rules=_rules,
)
