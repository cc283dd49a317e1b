"""The transformers in their makers' layouts: SD3/SD3.5's MMDiT in Stability's (`joint_blocks.*`, as in
sd3.5_medium.safetensors) and Flux.1's in Black Forest Labs' (`double_blocks.*`, `single_blocks.*`, as in
flux1-dev.safetensors). The reverse of diffusers' single-file converters (loaders/single_file_utils.py
`convert_sd3_transformer_checkpoint_to_diffusers`, `convert_flux_transformer_checkpoint_to_diffusers`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds_trainer.train.layouts import table
from ds_trainer.train.layouts.sdxl import UNET
from ds_trainer.train.layouts.table import SWAP, Part


def _renamed(state: Mapping[str, Any], pairs: Mapping[str, str], op: str = "") -> list[Part]:
    """{diffusers module: maker module}: a part for each of its weight and bias the model has."""
    return [Part(f"{old}.{kind}", (f"{new}.{kind}",), op) for new, old in pairs.items() for kind in ("weight", "bias")
            if f"{new}.{kind}" in state]


def _fused(state: Mapping[str, Any], old: str, news: list[str]) -> list[Part]:
    return [Part(f"{old}.{kind}", tuple(f"{new}.{kind}" for new in news)) for kind in ("weight", "bias")
            if f"{news[0]}.{kind}" in state]


def sd3(state: Mapping[str, Any], num_layers: int) -> list[Part]:
    """SD3Transformer2DModel's tensors in Stability's MMDiT layout (AdaLayerNormContinuous keeps (scale, shift),
    the MMDiT code (shift, scale): the final norm's and the last block's text-stream norm's halves swap)."""
    parts = [Part("pos_embed", ("pos_embed.pos_embed",))]
    parts += _renamed(state, {"pos_embed.proj": "x_embedder.proj", "context_embedder": "context_embedder",
                              "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
                              "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
                              "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
                              "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
                              "proj_out": "final_layer.linear"})
    parts += _renamed(state, {"norm_out.linear": "final_layer.adaLN_modulation.1"}, SWAP)
    for i in range(num_layers):
        new, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        last = i == num_layers - 1
        parts += _fused(state, f"{x}attn.qkv", [f"{new}attn.to_{p}" for p in "qkv"])
        parts += _fused(state, f"{c}attn.qkv", [f"{new}attn.add_{p}_proj" for p in "qkv"])
        parts += _fused(state, f"{x}attn2.qkv", [f"{new}attn2.to_{p}" for p in "qkv"])
        parts += _renamed(state, {f"{new}norm1_context.linear": f"{c}adaLN_modulation.1"}, SWAP if last else "")
        pairs = {"attn.to_out.0": "x_block.attn.proj", "attn2.to_out.0": "x_block.attn2.proj",
                 "norm1.linear": "x_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
                 "ff.net.2": "x_block.mlp.fc2", "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
                 "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
                 "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
        if not last:  # the last block's text stream ends after its attention
            pairs.update({"attn.to_add_out": "context_block.attn.proj",
                          "ff_context.net.0.proj": "context_block.mlp.fc1",
                          "ff_context.net.2": "context_block.mlp.fc2"})
        parts += _renamed(state, {new + a: f"joint_blocks.{i}." + b for a, b in pairs.items()})
    return parts


def flux(state: Mapping[str, Any], num_layers: int, num_single_layers: int) -> list[Part]:
    """FluxTransformer2DModel's tensors in Black Forest Labs' layout (RMSNorm weights named `scale`; a single
    block's q, k, v and MLP input fused into `linear1`)."""
    parts = _renamed(state, {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
                             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
                             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
                             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
                             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
                             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
                             "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"})
    parts += _renamed(state, {"norm_out.linear": "final_layer.adaLN_modulation.1"}, SWAP)
    for i in range(num_layers):
        new, old = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        parts += _fused(state, f"{old}img_attn.qkv", [f"{new}attn.to_{p}" for p in "qkv"])
        parts += _fused(state, f"{old}txt_attn.qkv", [f"{new}attn.add_{p}_proj" for p in "qkv"])
        parts += _renamed(state, {new + a: old + b for a, b in {
            "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "ff.net.0.proj": "img_mlp.0",
            "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
            "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}.items()})
        parts += [Part(f"{old}{b}.scale", (f"{new}attn.{a}.weight",)) for a, b in {
            "norm_q": "img_attn.norm.query_norm", "norm_k": "img_attn.norm.key_norm",
            "norm_added_q": "txt_attn.norm.query_norm", "norm_added_k": "txt_attn.norm.key_norm"}.items()]
    for i in range(num_single_layers):
        new, old = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        parts += _fused(state, f"{old}linear1", [*(f"{new}attn.to_{p}" for p in "qkv"), f"{new}proj_mlp"])
        parts += _renamed(state, {new + "norm.linear": old + "modulation.lin", new + "proj_out": old + "linear2"})
        parts += [Part(f"{old}norm.query_norm.scale", (f"{new}attn.norm_q.weight",)),
                  Part(f"{old}norm.key_norm.scale", (f"{new}attn.norm_k.weight",))]
    return parts


def sd3_tensors(model: Any) -> dict[str, torch.Tensor]:
    """SD3/SD3.5's MMDiT's tensors under Stability's names (under the whole checkpoint's `model.diffusion_model.`)."""
    state = model.state_dict()
    return table.weights(sd3(state, model.config.num_layers), state, UNET)


def flux_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Flux.1's transformer's tensors under Black Forest Labs' names (its file holds the transformer alone)."""
    state = model.state_dict()
    return table.weights(flux(state, model.config.num_layers, model.config.num_single_layers), state)
