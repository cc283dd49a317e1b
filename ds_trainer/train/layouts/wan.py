"""Wan's transformer in the original Wan names (Wan-Video's wan/modules/model.py), which ComfyUI's
single files, musubi-tuner's LoRA files (`lora_unet_blocks_0_self_attn_q`) and the official
checkpoints use: each diffusers tensor renamed, none fused. diffusers' own converter
(convert_wan_transformer_to_diffusers) reads these names back; a test holds the two to each other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from ds_trainer.train.layouts.table import Part

# diffusers' name -> the original one, in order (the first that matches a name's start or part).
_EMBEDDERS = (
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
    ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
    ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
    ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),
    ("proj_out.", "head.head."),
)
# Inside a block (blocks.N.<this>)
_BLOCK = (
    ("attn1.to_q.", "self_attn.q."),
    ("attn1.to_k.", "self_attn.k."),
    ("attn1.to_v.", "self_attn.v."),
    ("attn1.to_out.0.", "self_attn.o."),
    ("attn1.norm_q.", "self_attn.norm_q."),
    ("attn1.norm_k.", "self_attn.norm_k."),
    ("attn2.to_q.", "cross_attn.q."),
    ("attn2.to_k.", "cross_attn.k."),
    ("attn2.to_v.", "cross_attn.v."),
    ("attn2.to_out.0.", "cross_attn.o."),
    ("attn2.norm_q.", "cross_attn.norm_q."),
    ("attn2.norm_k.", "cross_attn.norm_k."),
    ("attn2.add_k_proj.", "cross_attn.k_img."),
    ("attn2.add_v_proj.", "cross_attn.v_img."),
    ("attn2.norm_added_k.", "cross_attn.norm_k_img."),
    ("norm2.", "norm3."),  # the cross-attention's LayerNorm: diffusers' norm2 is the original norm3
    ("ffn.net.0.proj.", "ffn.0."),
    ("ffn.net.2.", "ffn.2."),
    ("scale_shift_table", "modulation"),
)
_BLOCK_NAME = re.compile(r"^(blocks\.\d+\.)(.*)$")


def original_name(name: str) -> str:
    """A diffusers tensor name of WanTransformer3DModel in the original Wan names."""
    if name == "scale_shift_table":
        return "head.modulation"
    block = _BLOCK_NAME.match(name)
    if block is not None:
        head, rest = block.groups()
        for ours, theirs in _BLOCK:
            if rest.startswith(ours):
                return head + theirs + rest[len(ours) :]
        return name
    for ours, theirs in _EMBEDDERS:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name  # patch_embedding


def parts(names: Iterable[str]) -> list[Part]:
    """The original file's tensors, one a diffusers tensor each."""
    return [Part(original_name(name), (name,)) for name in names]


def tensors(model: Any) -> dict[str, torch.Tensor]:
    """The transformer's tensors in the original names (its persistent state: RoPE's tables are
    not)."""
    return {original_name(name): value for name, value in model.state_dict().items()}
