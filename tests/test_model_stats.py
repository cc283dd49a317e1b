"""The UNet numbers in conf/model/*.yaml (used by torch-free validation) match the built models."""

from __future__ import annotations

import pytest
from conftest import group_options, make_cfg
from omegaconf import OmegaConf


@pytest.mark.parametrize("model", [o for g, o in group_options() if g == "model"])
def test_model_yaml_describes_its_unet(model: str) -> None:
    torch = pytest.importorskip("torch")
    from diffusers import AutoencoderKL, UNet2DConditionModel

    cfg = make_cfg(f"model={model}")
    arch = cfg.model.architecture
    with torch.device("meta"):  # no memory, no download: seconds even for the full SDXL
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(f"{arch}/unet"))
    sizes = [p.numel() for p in unet.parameters()]
    assert (cfg.model.param_count, cfg.model.max_param_numel) == (sum(sizes), max(sizes))
    vae = OmegaConf.create(AutoencoderKL.load_config(f"{arch}/vae"))
    factor = 2 ** (len(vae.block_out_channels) - 1) * 2 ** (len(unet.config.down_block_types) - 1)
    assert cfg.model.downsample_factor == factor
    assert unet.config.addition_embed_type == "text_time"  # SDXL conditioning
