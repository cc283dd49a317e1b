"""Diffusers transformers written as the single files their makers ship: SD3/SD3.5 in Stability's layout
(`joint_blocks.*`, as in sd3.5_medium.safetensors) and Flux.1 in Black Forest Labs' (`double_blocks.*`, as in
flux1-dev.safetensors). The reverse of diffusers' single-file converters, for tests: a file written here and read
back by diffusers' `from_single_file` must give the weights it was written from."""

from __future__ import annotations

import torch


def _swap(weight: torch.Tensor) -> torch.Tensor:
    """AdaLayerNormContinuous's halves: diffusers keeps (scale, shift), the original code (shift, scale)."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _rename(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor], pairs: dict[str, str]) -> None:
    for new, old in pairs.items():
        for kind in ("weight", "bias"):
            if f"{new}.{kind}" in state:
                out[f"{old}.{kind}"] = state[f"{new}.{kind}"]


def sd3(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """SD3Transformer2DModel's weights under the keys of Stability's MMDiT files."""
    out = {"pos_embed": state["pos_embed.pos_embed"]}
    _rename(state, out, {"pos_embed.proj": "x_embedder.proj", "context_embedder": "context_embedder",
                         "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
                         "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
                         "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
                         "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
                         "proj_out": "final_layer.linear"})
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap(state[f"norm_out.linear.{kind}"])
    for i in range(num_layers):
        new, x, c = f"transformer_blocks.{i}.", f"joint_blocks.{i}.x_block.", f"joint_blocks.{i}.context_block."
        last = i == num_layers - 1
        for kind in ("weight", "bias"):
            out[f"{x}attn.qkv.{kind}"] = torch.cat([state[f"{new}attn.to_{p}.{kind}"] for p in "qkv"])
            out[f"{c}attn.qkv.{kind}"] = torch.cat([state[f"{new}attn.add_{p}_proj.{kind}"] for p in "qkv"])
            if f"{new}attn2.to_q.{kind}" in state:
                out[f"{x}attn2.qkv.{kind}"] = torch.cat([state[f"{new}attn2.to_{p}.{kind}"] for p in "qkv"])
            context_norm = state[f"{new}norm1_context.linear.{kind}"]
            out[f"{c}adaLN_modulation.1.{kind}"] = _swap(context_norm) if last else context_norm
        pairs = {"attn.to_out.0": "x_block.attn.proj", "attn2.to_out.0": "x_block.attn2.proj",
                 "norm1.linear": "x_block.adaLN_modulation.1", "ff.net.0.proj": "x_block.mlp.fc1",
                 "ff.net.2": "x_block.mlp.fc2", "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
                 "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
                 "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
        if not last:  # the last block's text stream ends after its attention
            pairs.update({"attn.to_add_out": "context_block.attn.proj",
                          "ff_context.net.0.proj": "context_block.mlp.fc1",
                          "ff_context.net.2": "context_block.mlp.fc2"})
        _rename(state, out, {new + a: f"joint_blocks.{i}." + b for a, b in pairs.items()})
    return out


def flux(state: dict[str, torch.Tensor], num_layers: int, num_single_layers: int) -> dict[str, torch.Tensor]:
    """FluxTransformer2DModel's weights under the keys of Black Forest Labs' files."""
    out: dict[str, torch.Tensor] = {}
    _rename(state, out, {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
                         "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
                         "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
                         "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
                         "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
                         "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
                         "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"})
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = _swap(state[f"norm_out.linear.{kind}"])
    for i in range(num_layers):
        new, old = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{old}img_attn.qkv.{kind}"] = torch.cat([state[f"{new}attn.to_{p}.{kind}"] for p in "qkv"])
            out[f"{old}txt_attn.qkv.{kind}"] = torch.cat([state[f"{new}attn.add_{p}_proj.{kind}"] for p in "qkv"])
        _rename(state, out, {new + a: old + b for a, b in {
            "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "ff.net.0.proj": "img_mlp.0",
            "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
            "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}.items()})
        for a, b in {"norm_q": "img_attn.norm.query_norm", "norm_k": "img_attn.norm.key_norm",
                     "norm_added_q": "txt_attn.norm.query_norm", "norm_added_k": "txt_attn.norm.key_norm"}.items():
            out[f"{old}{b}.scale"] = state[f"{new}attn.{a}.weight"]
    for i in range(num_single_layers):
        new, old = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{old}linear1.{kind}"] = torch.cat([*(state[f"{new}attn.to_{p}.{kind}"] for p in "qkv"),
                                                     state[f"{new}proj_mlp.{kind}"]])
        _rename(state, out, {new + "norm.linear": old + "modulation.lin", new + "proj_out": old + "linear2"})
        out[f"{old}norm.query_norm.scale"] = state[f"{new}attn.norm_q.weight"]
        out[f"{old}norm.key_norm.scale"] = state[f"{new}attn.norm_k.weight"]
    return out
