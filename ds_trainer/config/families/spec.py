"""The record of a model family's facts (`FamilySpec`), torch-free; each family's is in its module
beside this one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TransformerFile:
    """The trained transformer as one file in its makers' layout (`model.transformer`): how to
    recognise it."""

    # A key only this family's layout has (diffusers' single-file loaders detect families by these)
    mark: str
    label: str  # what a message calls such a file
    example: str  # the file its makers ship, for the fix
    # None when a header's shapes (file names -> shape) are the architecture's (its diffusers
    # config, its width); else why not
    mismatch: Callable[[dict[str, list[int]], dict[str, Any], int], str | None]
    # diffusers' loader reads the file's names as they are (no whole checkpoint's
    # model.diffusion_model. prefix)
    bare_names: bool = False
    width: int | None = (
        None  # the only width diffusers' loader converts (Flux.1's fused projection)
    )
    width_model: str = ""  # the model option of that width, for the fix
    # The family whose file's mark this family's file holds too (Chroma's keeps Flux.1's
    # blocks): a file with both marks is this family's
    within: str = ""


@dataclass(frozen=True)
class Phase:
    """One phase of a run in phases (Wan 2.2 A14B's `model.video.expert=both`): a run of its own
    in `folder` under the run's, in order, the config's `overrides` set (a value's `{run}` is the
    run's folder: where an earlier phase left its export); its trained module fills the pipeline's
    `slot` in the run's joined export."""

    name: str  # in the log, summary.json, and the joined LoRA and single-file folders
    folder: str  # relative to the run's folder
    overrides: dict[str, Any]  # dotted config key -> value
    slot: str  # the pipeline component its trained module is (transformer, transformer_2)


@dataclass(frozen=True)
class FamilySpec:
    name: str  # model.family
    label: str  # what a message calls the family ("Flux.1")
    component: str  # the trained module's pipeline component: "unet" or "transformer"
    module_classes: tuple[
        str, ...
    ]  # the trained module's diffusers class (a LoRA file's, FSDP2's subclass's base)
    implementation: str  # "module:Class" of its torch side (train/families/)
    text_encoders: tuple[str, ...]  # as data.text_encoder_dropout names them
    # What its single file holds beside the denoiser, as pipeline components (in the file's order)
    single_file_parts: tuple[str, ...] = ()
    flow: bool = (
        True  # trains by flow matching (model.flow); else DDPM noise with a prediction type
    )
    guidance_input: bool = False  # a distilled guidance input (model.flow.guidance)
    dynamic_shift: bool = (
        False  # the sampler's resolution-dependent shift (model.flow.dynamic_shift)
    )
    # An editing model's caption is encoded with its reference picture (once, into the cache: never
    # dropped or varied)
    caption_sees_reference: bool = False
    # The most reference images its editing pipelines take per sample (model.references), and the
    # pixels its several-reference pipeline gives each to the caption's encoder at (0: the image's)
    references: int = 1
    reference_area: int = 0
    caption_limit: int | None = (
        None  # the pipeline's most caption tokens (model.flow.text_max_length), if bounded
    )
    pipeline: str = ""  # the diffusers pipeline's class, for messages
    fp16: str = ""  # why fp16 cannot train it ("" when it can)
    # Training hands attention a mask (padded captions): CUDA's FlashAttention kernel takes none
    attention_mask: bool = False
    transformer_file: TransformerFile | None = None
    code_url: str = ""  # modelspec.implementation: the reference code
    modelspec_architecture: str = (
        ""  # modelspec.architecture of its base, unless the option names another
    )
    kohya_base_version: str = ""  # kohya's ss_base_model_version, unless the option names another
    kohya_readers: str = ""  # the model card: what reads its kohya-layout LoRA file
    diffusers_lora_in_comfyui: bool = True  # ComfyUI reads its diffusers-layout LoRA too
    tags: tuple[str, ...] = ()  # the model card's tags
    # The cache key leaves out model.family and model.flow (SDXL's caches predate families)
    cache_key_without_family: bool = False
    # The text tokens the trained module attends to (the planner), from the composed config
    text_tokens: Callable[[Any], int] = field(default=lambda cfg: 77)  # noqa: ARG005 - CLIP's 77
    # The trained module's first layer (the sampler casts what it is given to that layer's dtype)
    input_layer: str = "conv_in"
    # Trains on clips (frames x height x width; model.video, data.video): an image is a clip of one
    # frame, and its samples are clips (mp4)
    video: bool = False
    # The VAE's compression in time: a clip's frames are k * temporal_factor + 1
    temporal_factor: int = 1
    # parallel.context: the sequence lengths its transformer's context-parallel plan splits, for a
    # sample of (width, height, frames) pixels under the composed config ({what: tokens}, each a
    # multiple of the context size); None: its module has no sequence to split (a UNet)
    context_lengths: Callable[[Any, int, int, int], dict[str, int]] | None = None
    # The family's own rules before a run (its conditioning against its architecture): the composed
    # config to its problems (config.problems.Problem), asked by config/checks/model.py
    rules: Callable[[Any], list[Any]] = field(default=lambda cfg: [])  # noqa: ARG005 - none
    # A run that trains in phases, one after the other in one command (each a run of its own in a
    # subfolder, config/phases.py): the composed config to its phases; [] for one run
    phases: Callable[[Any], list[Phase]] = field(default=lambda cfg: [])  # noqa: ARG005 - one

    @property
    def module_label(self) -> str:
        """What a message calls the trained module: "UNet" or "transformer"."""
        return "UNet" if self.component == "unet" else "transformer"


def blocks(keys: set[str], prefix: str) -> set[int]:
    """The block numbers under `prefix` (`joint_blocks.`) among a file's keys."""
    return {
        int(k.split(".")[1]) for k in keys if k.startswith(prefix) and k.split(".")[1].isdigit()
    }


def blocks_mismatch(keys: set[str], name: str, ours: int) -> str | None:
    """None when the file holds `ours` blocks under `name.`; else what it holds."""
    theirs = len(blocks(keys, f"{name}."))
    if theirs != ours:
        return f"{theirs} {name}, the architecture {ours}: another model's transformer"
    return None


def width_mismatch(shapes: dict[str, list[int]], key: str, width: int) -> str | None:
    """None when the file's `key` (its first projection) is `width` wide; else how wide it is."""
    file_width = shapes.get(key, [0])[0]
    if file_width != width:
        return (f"a transformer {file_width} wide, the architecture {width}: "
                "another model's transformer")
    return None
