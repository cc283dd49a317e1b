"""Chroma's transformer in its makers' layout (Chroma1-HD.safetensors, as ComfyUI loads it and
kohya's sd-scripts names its LoRA): Black Forest Labs' Flux.1 names (`double_blocks.*`,
`single_blocks.*`: train/layouts/ transformers.py, whose parts are those the model has: Chroma's
blocks have no modulation layers) and the shared approximator's
(`distilled_guidance_layer.layers.{i}.in_layer`, RMSNorm weights named `scale`). The reverse of
diffusers' `convert_chroma_transformer_checkpoint_to_diffusers`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds_trainer.train.layouts import table, transformers
from ds_trainer.train.layouts.table import Part

APPROXIMATOR = "distilled_guidance_layer"


def parts(state: Mapping[str, Any], num_layers: int, num_single_layers: int) -> list[Part]:
    """ChromaTransformer2DModel's tensors (diffusers' names -> anything) as its file's parts."""
    out = transformers.flux(state, num_layers, num_single_layers)
    layers = sorted(
        {int(k.split(".")[2]) for k in state if k.startswith(f"{APPROXIMATOR}.layers.")}
    )
    pairs = {"in_proj": "in_proj", "out_proj": "out_proj"}
    for i in layers:
        pairs.update(
            {
                f"layers.{i}.linear_1": f"layers.{i}.in_layer",
                f"layers.{i}.linear_2": f"layers.{i}.out_layer",
            }
        )
    out += [
        Part(f"{APPROXIMATOR}.{theirs}.{kind}", (f"{APPROXIMATOR}.{ours}.{kind}",))
        for ours, theirs in pairs.items()
        for kind in ("weight", "bias")
        if f"{APPROXIMATOR}.{ours}.{kind}" in state
    ]
    out += [
        Part(f"{APPROXIMATOR}.norms.{i}.scale", (f"{APPROXIMATOR}.norms.{i}.weight",))
        for i in layers
    ]
    return out


def tensors(model: Any) -> dict[str, torch.Tensor]:
    """The transformer's tensors under its makers' names (its file holds the transformer alone)."""
    state = model.state_dict()
    return table.weights(
        parts(state, model.config.num_layers, model.config.num_single_layers), state
    )
