"""Z-Image's transformer in its makers' layout (ComfyUI's z_image_turbo_bf16.safetensors, the
original Z-Image code's names): diffusers' names but for the patch embedder and final layer of the
one patch size (`x_embedder`, `final_layer`), each attention's q, k and v fused into `qkv`, its
output `out`, its norms `q_norm` and `k_norm`. The reverse of diffusers'
`convert_z_image_transformer_checkpoint_to_diffusers`; ComfyUI's kohya-style LoRA names
(`lora_unet_layers_0_attention_qkv`) are these modules'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds_trainer.train.layouts import table
from ds_trainer.train.layouts.table import Part

RENAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
           (".attention.to_out.0.", ".attention.out."),
           (".attention.norm_q.", ".attention.q_norm."),
           (".attention.norm_k.", ".attention.k_norm."))


def original_name(key: str) -> str:
    """A diffusers tensor's name in the makers' file (a fused projection's under its q's)."""
    for ours, theirs in RENAMES:
        key = key.replace(ours, theirs)
    return key.replace(".attention.to_q.", ".attention.qkv.")


def parts(state: Mapping[str, Any]) -> list[Part]:
    """ZImageTransformer2DModel's tensors (diffusers' names -> anything) as its file's parts."""
    out = []
    for key in state:
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue  # fused with to_q's
        if ".attention.to_q." in key:
            fused = tuple(key.replace(".to_q.", f".to_{p}.") for p in "qkv")
            out.append(Part(original_name(key), fused))
        else:
            out.append(Part(original_name(key), (key,)))
    return out


def tensors(model: Any) -> dict[str, torch.Tensor]:
    """The transformer's tensors under its makers' names (its file holds the transformer alone)."""
    state = model.state_dict()
    return table.weights(parts(state), state)
