"""`model.pretrained=<file>.safetensors`: a single-file SDXL checkpoint in the original (Stability) key
layout, written here from sdxl_tiny's weights, loads to the same UNet; `model.vae` replaces the VAE."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs

torch = pytest.importorskip("torch")

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
        "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def original_unet_key(key: str, per_block: int, attention_up_blocks: set[int]) -> str:
    """A diffusers UNet key in the original layout (input, middle and output blocks of SDXL's LDM UNet)."""
    for name, old in _TOP.items():
        if key.startswith(name + "."):
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


def original_layout(unet: Any, te1: Any, te2: Any) -> dict[str, torch.Tensor]:
    """UNet, CLIP ViT-L and OpenCLIP bigG weights under the original SDXL checkpoint's key names."""
    per_block, state = unet.config.layers_per_block, unet.state_dict()
    attention_up_blocks = {int(k.split(".")[1]) for k in state if k.startswith("up_blocks.") and ".attentions." in k}
    out = {"model.diffusion_model." + original_unet_key(k, per_block, attention_up_blocks): v for k, v in state.items()}
    for key, value in te1.state_dict().items():  # transformers may flatten CLIPTextModel's text_model
        out["conditioner.embedders.0.transformer." + ("" if key.startswith("text_model.") else "text_model.") + key] = (
            value)
    big_g = "conditioner.embedders.1.model."
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    rename = [("text_model.encoder.layers.", "transformer.resblocks."), ("layer_norm1", "ln_1"),
              ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj"), ("self_attn", "attn")]
    fixed = {"text_model.embeddings.position_embedding.weight": "positional_embedding",
             "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
             "text_model.final_layer_norm.weight": "ln_final.weight",
             "text_model.final_layer_norm.bias": "ln_final.bias"}
    for key, value in te2.state_dict().items():
        if key == "text_projection.weight":
            out[big_g + "text_projection"] = value.T.contiguous()
        elif key in fixed:
            out[big_g + fixed[key]] = value
        elif any(f"self_attn.{p}_proj." in key for p in "qkv"):
            stem, proj, kind = key.rsplit(".", 2)
            qkv.setdefault(f"{stem}.in_proj_{kind}", {})[proj[0]] = value
        else:
            for old, new in rename:
                key = key.replace(old, new)
            out[big_g + key] = value
    for key, parts in qkv.items():
        for old, new in rename:
            key = key.replace(old, new)
        out[big_g + key] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


@pytest.fixture(scope="module")
def files(module_tmp: Callable[[str], Path]) -> dict[str, Any]:
    from safetensors.torch import save_file

    from ds_trainer.train.families import sdxl

    root = module_tmp("single_file")
    cfg = make_cfg("train.seed=3")
    unet, frozen = sdxl.load_unet(cfg), sdxl.load_frozen(cfg)
    checkpoint = root / "sdxl_tiny_original.safetensors"
    save_file({k: v.contiguous() for k, v in original_layout(unet, frozen.text_encoder, frozen.text_encoder_2).items()},
              checkpoint)
    torch.manual_seed(11)
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_config(frozen.vae.config)  # a VAE of its own, to tell the override apart
    vae.save_pretrained(root / "vae")
    save_file({"down_blocks.0.resnets.0.conv1.weight": torch.zeros(1)}, root / "diffusers_unet.safetensors")
    return {"root": root, "checkpoint": checkpoint, "vae": root / "vae", "unet": unet, "frozen": frozen}


def test_single_file_loads_the_unet_and_text_encoders_it_was_written_from(files: dict[str, Any]) -> None:
    from ds_trainer.train.families import sdxl

    cfg = make_cfg(f"model.pretrained={files['checkpoint']}", f"model.vae={files['vae']}")
    loaded, source = sdxl.load_unet(cfg).state_dict(), files["unet"].state_dict()
    assert loaded.keys() == source.keys() and all(torch.equal(loaded[k], source[k]) for k in source)
    frozen = sdxl.load_frozen(cfg)
    for ours, theirs in ((frozen.text_encoder, files["frozen"].text_encoder),
                         (frozen.text_encoder_2, files["frozen"].text_encoder_2)):
        a, b = ours.state_dict(), theirs.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in b)
    vae = json.loads((files["vae"] / "config.json").read_text())
    assert vae["_class_name"] == "AutoencoderKL"
    from diffusers import AutoencoderKL

    expected = AutoencoderKL.from_pretrained(files["vae"]).state_dict()
    assert all(torch.equal(frozen.vae.state_dict()[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_training_from_a_single_file_exports_a_pipeline_and_bad_files_are_named(files: dict[str, Any]) -> None:
    root = files["root"]
    result = run_cli("logger=none", "train.max_steps=1", "data.num_samples=2",
                     f"model.pretrained={files['checkpoint']}", f"model.vae={files['vae']}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    pipeline = run_dirs(root)[0] / "pipeline"
    assert {p.name for p in pipeline.iterdir()} >= {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer",
                                                    "scheduler", "model_index.json"}
    bad = run_cli(f"model.pretrained={root / 'diffusers_unet.safetensors'}", "dry_run=true", cwd=root)
    assert bad.returncode == 2 and "is not an SDXL checkpoint: a diffusers-format model" in bad.stderr
    no_vae = run_cli(f"model.pretrained={files['checkpoint']}", "dry_run=true", cwd=root)
    assert no_vae.returncode == 2 and "holds no VAE" in no_vae.stderr and "model.vae=" in no_vae.stderr
    # A .ckpt (a pickle) is read only when the run loads it: still the user's input, still exit 2, no traceback.
    ckpt = root / "not_sdxl.ckpt"
    torch.save({"state_dict": {"model.layer.weight": torch.zeros(2, 2)}}, ckpt)
    wrong = run_cli(f"model.pretrained={ckpt}", "logger=none", "train.max_steps=1", "data.num_samples=2", cwd=root)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr, wrong.stderr[-3000:]
    assert f"model.pretrained={ckpt} is not an SDXL checkpoint" in wrong.stderr
