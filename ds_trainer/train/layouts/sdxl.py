"""SDXL in Stability's SGM layout (sd_xl_base_1.0.safetensors): the UNet under `model.diffusion_model.` (LDM's
input, middle and output blocks), the VAE under `first_stage_model.` (LDM's encoder/decoder, attention as 1x1
convolutions), CLIP ViT-L under `conditioner.embedders.0.transformer.` (transformers' own names) and OpenCLIP bigG
under `conditioner.embedders.1.model.` (open_clip's names: fused in_proj, transposed text_projection). Facts from the
diffusers single-file converter (loaders/single_file_utils.py), which reads these files back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ds_trainer.train.layouts import table
from ds_trainer.train.layouts.table import CONV, TRANSPOSE, Part

UNET, VAE, CLIP_L, CLIP_G = ("model.diffusion_model.", "first_stage_model.", "conditioner.embedders.0.transformer.",
                             "conditioner.embedders.1.model.")

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
        "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def unet_key(key: str, per_block: int, attention_up_blocks: set[int]) -> str:
    """A diffusers UNet tensor's (or module's) name in LDM's layout."""
    for name, old in _TOP.items():
        if key == name or key.startswith(name + "."):
            return old + key[len(name):]
    parts = key.split(".")
    if parts[0] == "mid_block":  # resnet, attention, resnet
        kind, rest = parts[1], parts[3:]
        head = f"middle_block.{2 * int(parts[2]) if kind == 'resnets' else 1}"
    else:
        block, kind = int(parts[1]), parts[2]
        if kind == "downsamplers":
            return f"input_blocks.{(block + 1) * (per_block + 1)}.0.op.{parts[-1]}"
        if kind == "upsamplers":  # after the block's last resnet (and attention)
            index = block * (per_block + 1) + per_block
            return f"output_blocks.{index}.{2 if block in attention_up_blocks else 1}.conv.{parts[-1]}"
        layer, rest = int(parts[3]), parts[4:]
        head = (f"input_blocks.{1 + block * (per_block + 1) + layer}" if parts[0] == "down_blocks"
                else f"output_blocks.{block * (per_block + 1) + layer}") + (".0" if kind == "resnets" else ".1")
    if kind == "resnets":
        rest = [_RESNET.get(rest[0], rest[0]), *rest[1:]]
    return ".".join([head, *rest])


def unet(state: Mapping[str, Any], layers_per_block: int) -> list[Part]:
    attention_up = {int(k.split(".")[1]) for k in state if k.startswith("up_blocks.") and ".attentions." in k}
    return [Part(unet_key(k, layers_per_block, attention_up), (k,)) for k in state]


def _vae_key(key: str, blocks: int) -> str:
    """LDM's encoder/decoder names: down.{i}.block.{j}, up.{blocks-1-i}.block.{j} (the decoder counts from the
    bottom), mid.block_{1,2}, mid.attn_1 (norm, q, k, v, proj_out)."""
    parts = key.split(".")
    swaps = {"conv_shortcut": "nin_shortcut", "conv_norm_out": "norm_out"}
    if parts[1] in ("down_blocks", "up_blocks"):
        i = int(parts[2])
        side = "down" if parts[1] == "down_blocks" else "up"
        index = i if side == "down" else blocks - 1 - i
        if parts[3] == "resnets":
            head = [parts[0], side, str(index), "block", parts[4]]
            rest = parts[5:]
        else:  # downsamplers.0 / upsamplers.0
            head, rest = [parts[0], side, str(index), "downsample" if side == "down" else "upsample"], parts[5:]
    elif parts[1] == "mid_block":
        if parts[2] == "resnets":
            head, rest = [parts[0], "mid", f"block_{int(parts[3]) + 1}"], parts[4:]
        else:  # attentions.0
            attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}
            head, rest = [parts[0], "mid", "attn_1"], [attn[parts[4]], *parts[5 + (parts[4] == "to_out"):]]
    else:
        head, rest = parts[:1], parts[1:]
    return ".".join(head + [swaps.get(p, p) for p in rest])


def vae(state: Mapping[str, torch.Tensor], blocks: int) -> list[Part]:
    out = []
    for k in state:
        key = _vae_key(k, blocks)
        linear = ".mid.attn_1." in key and key.endswith(".weight") and key.split(".")[-2] in ("q", "k", "v", "proj_out")
        out.append(Part(key, (k,), CONV if linear else ""))
    return out


def clip_l(state: Mapping[str, torch.Tensor]) -> list[Part]:
    """transformers' names, under `text_model.` (which transformers may leave out of a CLIPTextModel's keys)."""
    return [Part(k if k.startswith("text_model.") else "text_model." + k, (k,)) for k in state]


_G_RENAME = [("text_model.encoder.layers.", "transformer.resblocks."), ("layer_norm1", "ln_1"),
             ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"),
             ("self_attn.out_proj", "attn.out_proj")]
_G_FIXED = {"text_model.embeddings.position_embedding.weight": "positional_embedding",
            "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
            "text_model.final_layer_norm.weight": "ln_final.weight",
            "text_model.final_layer_norm.bias": "ln_final.bias"}


def clip_g(state: Mapping[str, torch.Tensor]) -> list[Part]:
    """open_clip's names: q, k and v fused into `attn.in_proj_weight/bias`, `text_projection` stored [in, out]."""
    out = []
    for k in state:
        if k == "text_projection.weight":
            out.append(Part("text_projection", (k,), TRANSPOSE))
        elif k in _G_FIXED:
            out.append(Part(_G_FIXED[k], (k,)))
        elif ".self_attn.q_proj." in k:
            stem, kind = k.split(".self_attn.q_proj.")
            key = f"{stem}.attn.in_proj_{kind}"
            for old, new in _G_RENAME:
                key = key.replace(old, new)
            out.append(Part(key, tuple(f"{stem}.self_attn.{p}_proj.{kind}" for p in "qkv")))
        elif ".self_attn.k_proj." in k or ".self_attn.v_proj." in k:
            continue  # in q's part
        else:
            key = k
            for old, new in _G_RENAME:
                key = key.replace(old, new)
            out.append(Part(key, (k,)))
    return out


def constants(positions: int) -> dict[str, torch.Tensor]:
    """What the original file holds beyond diffusers' models: CLIP ViT-L's position ids (a buffer transformers no
    longer saves) and OpenCLIP's logit scale (its contrastive temperature, at the ln 100 it is clamped to; no text
    encoder reads it)."""
    return {CLIP_L + "text_model.embeddings.position_ids": torch.arange(positions, dtype=torch.int64)[None],
            CLIP_G + "logit_scale": torch.tensor(math.log(100.0))}


def unet_tensors(model: Any) -> dict[str, torch.Tensor]:
    """A diffusers UNet's tensors under the file's names."""
    state = model.state_dict()
    return table.weights(unet(state, model.config.layers_per_block), state, UNET)


def vae_tensors(model: Any) -> dict[str, torch.Tensor]:
    """A diffusers VAE's tensors under the file's names (SDXL's and SD3's files hold it so)."""
    state = model.state_dict()
    return table.weights(vae(state, len(model.config.block_out_channels)), state, VAE)


def encoder_tensors(clip_l_model: Any, clip_g_model: Any) -> dict[str, torch.Tensor]:
    """Both text encoders' tensors under the file's names, with the constants the original file holds."""
    te1, te2 = clip_l_model.state_dict(), clip_g_model.state_dict()
    out = table.weights(clip_l(te1), te1, CLIP_L)
    out.update(table.weights(clip_g(te2), te2, CLIP_G))
    out.update(constants(clip_l_model.config.max_position_embeddings))
    return out
