"""The numbers in conf/model/*.yaml (used by torch-free validation) match the built trained module (SDXL's UNet,
SD3's and Flux's transformers), and the blocks it names (FSDP's units) are its own."""

from __future__ import annotations

import pytest
from helpers.cfg import group_options, make_cfg
from omegaconf import OmegaConf


@pytest.mark.parametrize("model", [o for g, o in group_options() if g == "model"])
def test_model_yaml_describes_its_trained_module(model: str) -> None:
    pytest.importorskip("torch")
    from diffusers import AutoencoderKL

    from ds_trainer.train import families

    cfg = make_cfg(f"model={model}")
    module = families.of(cfg).meta_trained(cfg)  # on the meta device: no memory, no download, seconds for full sizes
    sizes = [p.numel() for p in module.parameters()]
    assert (cfg.model.param_count, cfg.model.max_param_numel) == (sum(sizes), max(sizes))
    vae = OmegaConf.create(AutoencoderKL.load_config(f"{cfg.model.architecture}/vae"))
    if cfg.model.family.value == "wan":  # a 3D VAE's spatial factor (the 2.2 VAE's patchify in it), 1 x 2 x 2 patches
        assert cfg.model.downsample_factor == vae.scale_factor_spatial * module.config.patch_size[1]
        assert module.config.in_channels in (vae.z_dim, 2 * vae.z_dim + 4)  # + a mask and the first frame's latents
        assert {type(m).__name__ for m in module.modules()} >= set(cfg.model.blocks)
        return
    if cfg.model.family.value == "qwen_image":  # a video VAE: its spatial downsamplings are temperal_downsample's
        vae_factor, channels = 2 ** len(vae.temperal_downsample), vae.z_dim
    else:
        vae_factor, channels = 2 ** (len(vae.block_out_channels) - 1), vae.get("latent_channels")
    if cfg.model.family.value == "sdxl":
        assert module.config.addition_embed_type == "text_time"  # SDXL conditioning
        assert cfg.model.downsample_factor == vae_factor * 2 ** (len(module.config.down_block_types) - 1)
    elif cfg.model.family.value == "sd3":  # a transformer: latents cut into patch x patch tokens
        assert cfg.model.downsample_factor == vae_factor * module.config.patch_size
        assert channels == module.config.in_channels
    elif cfg.model.family.value == "z_image":  # the transformer cuts the latents into its one patch size
        assert cfg.model.downsample_factor == vae_factor * module.config.all_patch_size[0]
        assert channels == module.config.in_channels
    else:  # Flux, Qwen-Image: latents packed 2 x 2 into tokens
        assert cfg.model.downsample_factor == vae_factor * 2
        assert 4 * channels == module.config.in_channels
    classes = {type(m).__name__ for m in module.modules()}
    assert set(cfg.model.blocks) <= classes, (list(cfg.model.blocks), sorted(classes))
