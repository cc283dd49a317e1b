"""Exports in the layouts people load: single files in the makers' layout (the released files' keys and shapes, read
back exactly by diffusers' single-file loaders) and LoRA in kohya's layout (read by diffusers' kohya converter and by
ComfyUI's rule to the same weights as the diffusers file, and continued from). The trained runs' exports are checked
where those runs train (test_matrix, test_lora, test_text_encoders)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg

torch = pytest.importorskip("torch")

RELEASED = Path(__file__).parent / "data" / "released_keys"
ASSETS = Path(__file__).parents[1] / "ds_trainer" / "assets"


def released(name: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for line in (RELEASED / f"{name}.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            key, shape = line.split(" ", 1)
            out[key] = tuple(int(n) for n in re.findall(r"\d+", shape.rsplit(" ", 1)[0]))
    return out


def _meta_parts(model: str) -> tuple[str, Any, dict[str, Any]]:
    """A full-size architecture's denoiser and its file's other parts, on the meta device."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    folder = str(ASSETS / model)
    with torch.device("meta"):
        if model == "flux_dev":
            return "flux", FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(
                folder, subfolder="transformer")), {}
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder, subfolder="vae"))
        if model.startswith("sd35"):
            return "sd3", SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(
                folder, subfolder="transformer")), {"vae": vae}
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder, subfolder="unet"))
        te1 = CLIPTextModel(CLIPTextConfig.from_pretrained(folder, subfolder="text_encoder"))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(folder, subfolder="text_encoder_2"))
    return "sdxl", unet, {"vae": vae, "text_encoder": te1, "text_encoder_2": te2}


@pytest.mark.parametrize(("model", "file"), [("sdxl_base", "sd_xl_base_1.0"), ("sd35_medium", "sd3.5_medium"),
                                             ("sd35_large", "sd3.5_large"), ("flux_dev", "flux1-dev")])
def test_the_single_file_has_the_released_files_keys_and_shapes(model: str, file: str) -> None:
    """Every tensor the makers' file holds, by name and shape, and nothing else (so also every module a kohya LoRA
    names: kohya's names are these modules')."""
    from ds_trainer.train.export import single_file

    family, denoiser, parts = _meta_parts(model)
    ours = {k: tuple(v.shape) for k, v in single_file.tensors(family, denoiser, parts).items()}
    theirs = released(file)
    assert sorted(set(theirs) - set(ours)) == [] and sorted(set(ours) - set(theirs)) == []
    assert {k: s for k, s in ours.items() if theirs[k] != s} == {}


def test_single_files_read_back_to_the_weights_they_were_written_from(tmp_path: Path) -> None:
    """Through the loaders a run uses (`model.pretrained=<file>` for SDXL, `model.transformer=<file>` for SD3, both on
    diffusers' single-file converters), in fp32 exactly and in bf16 to the bf16 of each weight; SD3's VAE too."""
    from diffusers import AutoencoderKL

    from ds_trainer.train import families
    from ds_trainer.train.export import single_file
    from ds_trainer.train.families import common

    cfg = make_cfg("train.seed=3")
    sdxl = families.of(cfg)
    unet, frozen = sdxl.load_trained(cfg), sdxl.load_frozen(cfg)
    parts = {"vae": frozen.vae, "text_encoder": frozen.text_encoder, "text_encoder_2": frozen.text_encoder_2}
    state = single_file.tensors("sdxl", unet, parts)
    for dtype in ("fp32", "bf16"):
        path = single_file.write(tmp_path / f"sdxl_{dtype}.safetensors", state, dtype, {"modelspec.title": "t"})
        loaded_cfg = make_cfg(f"model.pretrained={path}")
        to = common.SAVE_DTYPES[dtype]
        pairs = [(sdxl.load_trained(loaded_cfg), unet)]
        again = sdxl.load_frozen(loaded_cfg)
        pairs += [(again.vae, frozen.vae), (again.text_encoder, frozen.text_encoder),
                  (again.text_encoder_2, frozen.text_encoder_2)]
        for ours, source in pairs:
            a, b = ours.state_dict(), source.state_dict()
            assert all(torch.equal(a[k].float(), b[k].to(to).float()) for k in b), (dtype, type(source).__name__)

    cfg = make_cfg("model=sd3_tiny", "train.seed=5")
    sd3 = families.of(cfg)
    transformer, frozen = sd3.load_trained(cfg), sd3.load_frozen(cfg)
    path = single_file.write(tmp_path / "sd3.safetensors", single_file.tensors("sd3", transformer, {"vae": frozen.vae}),
                             "fp32", {})
    loaded = sd3.load_trained(make_cfg("model=sd3_tiny", f"model.transformer={path}"))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in transformer.state_dict().items())
    vae = AutoencoderKL.from_single_file(str(path), config=str(ASSETS / "sd3_tiny"), subfolder="vae",
                                         local_files_only=True)
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in frozen.vae.state_dict().items())


def _random_lora(model: Any, seed: int) -> None:
    """B away from its zero start, so that the LoRA moves the weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _adapted(model_name: str, *overrides: str) -> tuple[Any, Any]:
    from ds_trainer.train import families
    from ds_trainer.train.adapters import adapter

    cfg = make_cfg(f"model={model_name}", "adapter=lora", "adapter.rank=4", "adapter.alpha=2", "precision=fp32",
                   *overrides)
    module = families.of(cfg).load_trained(cfg)
    trained = adapter.build(cfg, module)
    _random_lora(module, 7)
    return cfg, trained


def _comfy_merge(weights: dict[str, Any], kohya: dict[str, Any], prefix: str) -> dict[str, Any]:
    """ComfyUI's reading of a LoRA on a checkpoint (comfy/lora.py `model_lora_keys_unet`: `lora_unet_<the file's key
    with _ for .>`; comfy/weight_adapter/lora.py: W + alpha / rank * up @ down)."""
    out = {k: v.clone() for k, v in weights.items()}
    names = {"lora_unet_" + k[len(prefix):-len(".weight")].replace(".", "_"): k for k in weights
             if k.startswith(prefix) and k.endswith(".weight")}
    heads = {k.removesuffix(".lora_down.weight") for k in kohya if k.endswith(".lora_down.weight")}
    assert heads <= set(names), sorted(heads - set(names))[:3]
    for head in heads:
        down, up = kohya[head + ".lora_down.weight"].float(), kohya[head + ".lora_up.weight"].float()
        key = names[head]
        delta = float(kohya[head + ".alpha"]) / down.shape[0] * (up.flatten(1) @ down.flatten(1))
        out[key] = out[key] + delta.reshape(out[key].shape)
    return out


@pytest.mark.parametrize("model_name", ["sd3_tiny", "flux_tiny", "sdxl_tiny"])
def test_a_kohya_lora_is_the_diffusers_lora_for_comfyui_and_reads_back(tmp_path: Path, model_name: str) -> None:
    """The kohya file's LoRA applied by ComfyUI's rule to the single file in the makers' layout gives the makers'
    layout of the diffusers model with the LoRA merged (Flux's fused single-block linear1 with proj_mlp left out,
    SD3's fused qkv); read back by `adapter.init_from`'s reader it is the adapters' own values."""
    from peft.utils import get_peft_model_state_dict

    from ds_trainer.train.adapters import kohya_file, lora_file
    from ds_trainer.train.export import single_file
    from ds_trainer.train.layouts import kohya

    cfg, trained = _adapted(model_name)
    module = trained.module
    weights = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}
    path = kohya_file.write(tmp_path, module, weights, torch.float32, {"ss_network_dim": "4"})
    from safetensors.torch import load_file

    file = load_file(str(path))
    assert file and all(k.startswith("lora_unet_") for k in file)
    assert all(file[k].ndim == 0 and float(file[k]) > 0 for k in file if k.endswith(".alpha"))

    # ComfyUI's merge on the makers' layout = the makers' layout of peft's merge.
    from peft.tuners.tuners_utils import BaseTunerLayer

    family, family_parts = families_parts(cfg)
    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]

    def plain() -> Any:
        copy = type(module).from_config(module.config)
        copy.load_state_dict({k.replace(".base_layer", ""): v.detach().clone() for k, v in module.state_dict().items()
                              if "lora_" not in k})
        return copy

    bare = plain()
    for layer in layers:
        layer.merge()  # peft's own merge: W + alpha / r * B @ A
    merged = plain()
    for layer in layers:
        layer.unmerge()
    prefix = "model.diffusion_model." if family != "flux" else ""
    expected = single_file.tensors(family, merged, family_parts)
    got = _comfy_merge(single_file.tensors(family, bare, family_parts), file, prefix)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)

    # adapter.init_from's reader: the kohya file back to peft's tensors.
    from ds_trainer.train import families

    read = lora_file.read_for(path, module, families.component_of(module))
    own = get_peft_model_state_dict(module)
    assert read.keys() == own.keys()
    for key, value in own.items():
        torch.testing.assert_close(read[key], value, rtol=0, atol=1e-6, msg=key)
    assert kohya.is_kohya(file)


def families_parts(cfg: Any) -> tuple[str, dict[str, Any]]:
    from ds_trainer.train import families

    family = families.of(cfg)
    if family.name == "flux":
        return "flux", {}
    frozen = family.load_frozen(cfg)
    if family.name == "sd3":
        return "sd3", {"vae": frozen.vae}
    return "sdxl", {"vae": frozen.vae, "text_encoder": frozen.text_encoder, "text_encoder_2": frozen.text_encoder_2}


def test_diffusers_reads_a_flux1_width_kohya_lora_to_the_same_deltas(tmp_path: Path) -> None:
    """diffusers' own kohya converter (FluxPipeline.lora_state_dict) splits the kohya file's fused qkv and linear1
    back into per-module LoRA with the same weight deltas (it reads Flux.1's width, 3072, only: the adapters are built
    on a one-block Flux.1 on the meta device, the LoRA tensors alone real)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import save_file

    from ds_trainer.train import families
    from ds_trainer.train.layouts import kohya

    config = {**FluxTransformer2DModel.load_config(str(ASSETS / "flux_dev"), subfolder="transformer"),
              "num_layers": 1, "num_single_layers": 1}
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    adapters = {}
    for key, shape in shapes.items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.endswith(("to_q", "to_k", "to_v", "to_out.0")) and len(shape) == 2:
            adapters[module] = (torch.randn(4, shape[1], generator=gen), torch.randn(shape[0], 4, generator=gen), 2.0)
    parts = families.named("flux").kohya_parts(shapes, model.config)
    path = tmp_path / "flux_kohya.safetensors"
    save_file(kohya.write("transformer", parts, adapters, shapes), str(path))
    state = FluxPipeline.lora_state_dict(str(path))
    state = state[0] if isinstance(state, tuple) else state
    for module, (a, b, alpha) in adapters.items():
        key = f"transformer.{module}"
        delta = state[key + ".lora_B.weight"].float() @ state[key + ".lora_A.weight"].float()
        torch.testing.assert_close(delta, alpha / 4 * (b @ a), rtol=1e-4, atol=1e-4, msg=module)


def test_the_card_names_comfyui_for_the_diffusers_lora_only_when_its_scale_is_one(tmp_path: Path) -> None:
    """ComfyUI reads a LoRA's alpha from its `.alpha` tensors and applies 1 without them; the diffusers-layout file
    keeps alpha in its metadata alone, so the card sends ComfyUI users to kohya.safetensors when alpha != rank."""
    from ds_trainer.config import families
    from ds_trainer.train.export import card

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (tmp_path / "lora" / "kohya.safetensors").write_bytes(b"")
    for alpha, named in ((16, True), (32, False)):
        cfg = make_cfg("model=flux_tiny", "adapter=lora", "adapter.rank=16", f"adapter.alpha={alpha}")
        row = next(line for line in card._files(families.spec("flux"), tmp_path, "lora", card._scale(cfg))
                   if "pytorch_lora_weights" in line)
        assert (row.endswith(", ComfyUI |") is named) and ("alpha / rank of 2" in row) is not named, row
