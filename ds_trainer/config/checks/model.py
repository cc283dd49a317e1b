"""The `model` group against the rest: the resolution its VAE and denoiser take, and what each model family trains
with (SDXL's DDPM noise and levers, the transformers' flow matching and their single-file weights). Torch-free,
read-only.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from ds_trainer.config import families, weights_file
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig) -> list[Problem]:
    """The resolution, then the family's rules."""
    return _resolution(cfg) + _family(cfg)


def _resolution(cfg: DictConfig) -> list[Problem]:
    factor, out = int(cfg.model.downsample_factor), []
    for side in ("width", "height"):
        value = int(cfg.resolution[side])
        if value < factor or value % factor:
            nearest = max(factor, round(value / factor) * factor)
            out.append(Problem(f"resolution.{side}", value,
                               f"{cfg.model.name} needs a positive multiple of {factor} "
                               f"(VAE x UNet downsampling)", f"resolution.{side}={nearest}"))
    return out


def _family(cfg: DictConfig) -> list[Problem]:
    """What a model family trains with: the flow-matching families need `model.flow`, SDXL's DDPM noise refuses
    it; the `model.transformer` file is checked."""
    family, flow, spec = cfg.model.family.value, cfg.model.flow, families.of(cfg)
    out = weights_file.transformer_problems(cfg) if cfg.model.get("transformer") else []
    flowing = [s.name for s in families.with_flow()]
    if not spec.flow:
        if flow is not None:
            out.append(Problem("model.flow", "{...}", f"model.family={family} trains with DDPM noise (its "
                               "scheduler's epsilon or v-prediction); flow matching is the "
                               f"{', '.join(flowing[:-1])} and {flowing[-1]} families'",
                               f"drop the flow block from the model's yaml, or model.family={'|'.join(flowing)} for "
                               "those models"))
        return out
    if flow is None:
        out.append(Problem("model.flow", None, f"model.family={family} trains by flow matching, which model.flow "
                           "sets (timestep density, shift, loss weighting, T5's tokens)",
                           f"model={family}_tiny shows the block "
                           f"(conf/model/{family}_tiny.yaml); copy it into your model's yaml"))
        return out
    return out + _flow(cfg) + _sdxl_levers(cfg) + list(spec.rules(cfg))


def _flow(cfg: DictConfig) -> list[Problem]:
    """`model.flow`'s ranges; the resolution-dependent shift and the guidance input where the family has them."""
    family, flow, spec, out = cfg.model.family.value, cfg.model.flow, families.of(cfg), []
    for key, value, ok, fix in (
            ("shift", flow.shift, flow.shift > 0, "model.flow.shift=3.0 (SD3's), or 1.0 for no shift"),
            ("logit_std", flow.logit_std, flow.logit_std > 0, "model.flow.logit_std=1.0"),
            ("t5_max_length", flow.t5_max_length, 1 <= flow.t5_max_length <= 512,
             "model.flow.t5_max_length=256 (SD3's; T5 takes at most 512)")):
        if not (math.isfinite(value) and ok):
            out.append(Problem(f"model.flow.{key}", value, "out of range", fix))
    limit = spec.caption_limit
    if limit is not None and not 1 <= flow.text_max_length <= limit:
        out.append(Problem("model.flow.text_max_length", flow.text_max_length, f"out of range: {spec.pipeline} "
                           f"takes at most {limit} tokens of a caption", "model.flow.text_max_length=512 (the "
                           "pipeline's default)"))
    if flow.dynamic_shift and not spec.dynamic_shift:
        shifting = " and ".join(f"{s.label}'s" for s in families.SPECS.values() if s.dynamic_shift)
        out.append(Problem("model.flow.dynamic_shift", True, f"the resolution-dependent shift is {shifting}; "
                           f"{family}'s sampler shifts by the fixed model.flow.shift, and training must match it",
                           "model.flow.dynamic_shift=false"))
    if flow.dynamic_shift and flow.shift != 1.0:
        out.append(Problem("model.flow.shift", flow.shift, "model.flow.dynamic_shift=true shifts each level by the "
                           "image's token count instead; a fixed shift on top would train other levels than the "
                           "sampler uses", "model.flow.shift=1.0"))
    if flow.guidance is not None and not spec.guidance_input:
        out.append(Problem("model.flow.guidance", flow.guidance, f"{family}'s transformer has no guidance input "
                           "(Flux.1-dev's distilled guidance)", "model.flow.guidance=null"))
    return out


def _sdxl_levers(cfg: DictConfig) -> list[Problem]:
    """SDXL's own levers (noise offset, min-SNR, trained text encoders, a replacement VAE, a whole single-file
    checkpoint), refused on the transformers."""
    why_sdxl, out = f"is SDXL's; model={cfg.model.name} ({cfg.model.family.value}) ", []
    if cfg.train.noise_offset:
        out.append(Problem("train.noise_offset", cfg.train.noise_offset, why_sdxl + "trains by flow matching, which "
                           "has no offset noise", "train.noise_offset=0"))
    if cfg.train.min_snr_gamma:
        out.append(Problem("train.min_snr_gamma", cfg.train.min_snr_gamma, why_sdxl + "weighs its loss with "
                           "model.flow.weighting", "train.min_snr_gamma=null (and model.flow.weighting=cosmap or "
                           "sigma_sqrt if you want a weighting)"))
    if cfg.text_encoders.mode.value != "frozen":
        out.append(Problem("text_encoders", cfg.text_encoders.mode.value, why_sdxl + "keeps its CLIP and T5 "
                           "encoders frozen (their outputs cached); training them is not built for this family",
                           "text_encoders=frozen"))
    if cfg.model.vae is not None:
        out.append(Problem("model.vae", cfg.model.vae, why_sdxl + "uses its own VAE (its latent "
                           "scale and shift)",
                           "model.vae=null"))
    if weights_file.is_single_file(cfg.model.pretrained):
        out.append(Problem("model.pretrained", cfg.model.pretrained, f"model={cfg.model.name} loads its VAE and text "
                           "encoders from a diffusers folder or hub id; its transformer alone may come from one file",
                           "model.pretrained=<a diffusers folder or hub id> (stabilityai/stable-diffusion-3.5-medium, "
                           "black-forest-labs/FLUX.1-dev) model.transformer=<the file>"))
    return out
