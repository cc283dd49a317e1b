"""How the Chroma folders of ds_trainer/assets were made: Chroma's classes at a tiny size (random weights, no
download) and at Chroma1-HD's real size (the planner builds it on the meta device). `python make_assets.py` writes
them again.

Chroma is FLUX.1-schnell's transformer with its per-block modulation pruned to one shared approximator
(`distilled_guidance_layer`), T5-XXL alone (no CLIP), no guidance input. Its VAE, T5 and scheduler are Flux's
(lodestones/Chroma1-HD: Flux's 16-channel AutoencoderKL, T5-XXL, FlowMatchEulerDiscreteScheduler with the
resolution-dependent shift); the transformer's real config is ChromaTransformer2DModel's defaults (19 double- and
38 single-stream blocks, 3072 wide, a 5-layer approximator 5120 wide). The tiny one keeps every trait at a few
tens of thousands of parameters and takes flux_tiny's VAE, T5 and its small T5-style tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TINY = {"attention_head_dim": 16, "num_attention_heads": 2, "axes_dims_rope": [4, 4, 8], "in_channels": 16,
        "joint_attention_dim": 64, "num_layers": 1, "num_single_layers": 1, "approximator_num_channels": 16,
        "approximator_hidden_dim": 32, "approximator_layers": 2}
# name: (transformer config, the Flux folder whose VAE, T5, tokenizer and scheduler it takes)
MODELS = {"chroma_tiny": (TINY, "flux_tiny"), "chroma": ({}, "flux_dev")}


def write(name: str) -> None:
    import torch
    from diffusers import ChromaTransformer2DModel

    transformer, flux = MODELS[name]
    folder = ROOT / name
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        shutil.rmtree(folder / part, ignore_errors=True)
    (folder / "transformer").mkdir(parents=True)
    with torch.device("meta"):
        ChromaTransformer2DModel.from_config(transformer).save_config(folder / "transformer")
    for ours, theirs in (("vae", "vae"), ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"),
                         ("scheduler", "scheduler")):
        shutil.copytree(ROOT / flux / theirs, folder / ours)


if __name__ == "__main__":
    for model in MODELS:
        write(model)
