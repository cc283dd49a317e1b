"""FLUX.2's transformer in Black Forest Labs' layout (flux2-dev.safetensors, the klein files, as
ComfyUI loads them and musubi-tuner names its LoRA): `img_in`, `txt_in`, `time_in`/`guidance_in`,
the shared modulations (`double_stream_modulation_img.lin`, ...), `double_blocks.{i}` with each
stream's q, k and v fused into `qkv` and its RMSNorm weights named `scale`,
`single_blocks.{i}.linear1`/`linear2`, and `final_layer` (its adaLN halves in (shift, scale)
order). The reverse of diffusers' `convert_flux2_transformer_checkpoint_to_diffusers`; no tensor
has a bias."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ds_trainer.train.layouts import table
from ds_trainer.train.layouts.table import SWAP, Part

# diffusers' module: Black Forest Labs' (outside the blocks)
OUTER = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
DOUBLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
DOUBLE_NORMS = {
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
SINGLE_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


def _weights(state: Mapping[str, Any], pairs: Mapping[str, str], op: str = "") -> list[Part]:
    return [Part(f"{theirs}.weight", (f"{ours}.weight",), op) for ours, theirs in pairs.items()
            if f"{ours}.weight" in state]


def _norms(pairs: Mapping[str, str]) -> list[Part]:
    return [Part(f"{theirs}.scale", (f"{ours}.weight",)) for ours, theirs in pairs.items()]


def _blocks(state: Mapping[str, Any], prefix: str) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in state if k.startswith(prefix + ".")})


def parts(state: Mapping[str, Any]) -> list[Part]:
    """Flux2Transformer2DModel's tensors (diffusers' names -> anything) as its file's parts."""
    out = _weights(state, OUTER)
    out += _weights(state, {"norm_out.linear": "final_layer.adaLN_modulation.1"}, SWAP)
    for i in _blocks(state, "transformer_blocks"):
        ours, theirs = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out.append(Part(f"{theirs}img_attn.qkv.weight",
                        tuple(f"{ours}attn.to_{p}.weight" for p in "qkv")))
        out.append(Part(f"{theirs}txt_attn.qkv.weight",
                        tuple(f"{ours}attn.add_{p}_proj.weight" for p in "qkv")))
        out += _weights(state, {ours + a: theirs + b for a, b in DOUBLE.items()})
        out += _norms({ours + a: theirs + b for a, b in DOUBLE_NORMS.items()})
    for i in _blocks(state, "single_transformer_blocks"):
        ours, theirs = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out += _weights(state, {ours + a: theirs + b for a, b in SINGLE.items()})
        out += _norms({ours + a: theirs + b for a, b in SINGLE_NORMS.items()})
    return out


def tensors(model: Any) -> dict[str, torch.Tensor]:
    """The transformer's tensors under Black Forest Labs' names (its file holds the transformer
    alone)."""
    state = model.state_dict()
    return table.weights(parts(state), state)
