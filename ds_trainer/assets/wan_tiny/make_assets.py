"""How the Wan folders of ds_trainer/assets were made: the configs of Wan 2.1 and 2.2 at tiny sizes (random
weights, no download) and at their real sizes (the planner builds those on the meta device), as diffusers'
and transformers' classes write them. `python make_assets.py` writes them all again.

The real configs are those of Wan-AI's diffusers repositories (diffusers' scripts/convert_wan_to_diffusers.py and
Wan2.2's wan/configs): the transformers' widths, depths and input channels, the 2.1 VAE (16 channels, 8x) and the
2.2 VAE (48 channels, 16x) with their per-channel latent means and deviations, UMT5-XXL, CLIP ViT-H/14's vision
tower (2.1 I2V), and the schedulers' flow shifts. The tiny ones keep every structural trait (3-axis RoPE, the
causal 3D VAE and its 4x time compression, I2V's image keys and 36 input channels, TI2V's 48 channels, A14B's two
experts) at a few tens of thousands of parameters. The tokenizer is sd3_tiny's small T5-style one (UMT5's own
comes with the real weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Wan 2.2's VAE: the per-channel statistics its latents are normalised by (Wan-AI/Wan2.2-TI2V-5B-Diffusers).
MEAN_22 = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
           0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
           -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
           -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
STD_22 = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
          0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
          0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
          0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]

REAL = {"patch_size": [1, 2, 2], "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-6, "freq_dim": 256,
        "qk_norm": "rms_norm_across_heads", "text_dim": 4096, "rope_max_seq_len": 1024}
T2V_14B = {**REAL, "num_attention_heads": 40, "num_layers": 40, "ffn_dim": 13824, "in_channels": 16,
           "out_channels": 16}
TINY = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
        "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 48, "num_layers": 2, "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 64}
VAE_TINY = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True]}
VAE_22 = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True, "in_channels": 12,
          "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
          "temperal_downsample": [False, True, True], "latents_mean": MEAN_22, "latents_std": STD_22}
VAE_22_TINY = {**VAE_TINY, "decoder_base_dim": 8, "z_dim": 48, "is_residual": True, "in_channels": 12,
               "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "latents_mean": [0.0] * 48,
               "latents_std": [1.0] * 48}
UMT5_XXL = {"vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "dropout_rate": 0.0}
UMT5_TINY = {"vocab_size": 320, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
             "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
             "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0, "pad_token_id": 0, "eos_token_id": 1}
CLIP_H = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
          "patch_size": 14, "image_size": 224, "hidden_act": "gelu", "projection_dim": 1024}
CLIP_TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "patch_size": 14, "image_size": 28, "hidden_act": "gelu", "projection_dim": 16}

# name: (transformer, transformer_2 or None, VAE, text encoder, image encoder or None, image size, flow shift)
MODELS: dict[str, tuple[Any, ...]] = {
    "wan_tiny": (TINY, None, VAE_TINY, UMT5_TINY, None, None, 3.0),
    "wan21_i2v_tiny": ({**TINY, "in_channels": 36, "image_dim": 16, "added_kv_proj_dim": 24}, None, VAE_TINY,
                       UMT5_TINY, CLIP_TINY, 28, 3.0),
    "wan22_ti2v_tiny": ({**TINY, "in_channels": 48, "out_channels": 48}, None, VAE_22_TINY, UMT5_TINY, None, None,
                        5.0),
    "wan22_a14b_tiny": (TINY, TINY, VAE_TINY, UMT5_TINY, None, None, 3.0),
    "wan21_t2v_1_3b": ({**REAL, "num_attention_heads": 12, "num_layers": 30, "ffn_dim": 8960, "in_channels": 16,
                        "out_channels": 16}, None, {}, UMT5_XXL, None, None, 3.0),
    "wan21_t2v_14b": (T2V_14B, None, {}, UMT5_XXL, None, None, 5.0),
    "wan21_i2v_14b": ({**T2V_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}, None, {},
                      UMT5_XXL, CLIP_H, 224, 5.0),
    "wan22_ti2v_5b": ({**REAL, "num_attention_heads": 24, "num_layers": 30, "ffn_dim": 14336, "in_channels": 48,
                       "out_channels": 48}, None, VAE_22, UMT5_XXL, None, None, 5.0),
    "wan22_t2v_a14b": (T2V_14B, T2V_14B, {}, UMT5_XXL, None, None, 12.0),
    "wan22_i2v_a14b": ({**T2V_14B, "in_channels": 36}, {**T2V_14B, "in_channels": 36}, {}, UMT5_XXL, None, None,
                       5.0),
}


def write(name: str) -> None:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, UMT5Config

    transformer, second, vae, text, image, image_size, shift = MODELS[name]
    folder = ROOT / name
    for part in ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler", "image_encoder",
                 "image_processor"):
        shutil.rmtree(folder / part, ignore_errors=True)
    _config(folder / "transformer", WanTransformer3DModel, transformer)
    if second is not None:
        _config(folder / "transformer_2", WanTransformer3DModel, second)
    _config(folder / "vae", AutoencoderKLWan, vae)
    (folder / "text_encoder").mkdir(parents=True)
    config = UMT5Config(**text)
    config.architectures = ["UMT5EncoderModel"]
    config.save_pretrained(folder / "text_encoder")
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(ROOT / "sd3_tiny" / "tokenizer_3" / "tokenizer.json", tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "pad_token": "<pad>", "eos_token": "</s>",
         "unk_token": "<unk>", "extra_ids": 0, "additional_special_tokens": []}, indent=2) + "\n")
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=shift)
    scheduler.save_config(folder / "scheduler")  # type: ignore[attr-defined]
    if image is not None:
        vision = CLIPVisionConfig(**image)
        vision.architectures = ["CLIPVisionModel"]
        vision.save_pretrained(folder / "image_encoder")
        CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                           image_mean=[0.48145466, 0.4578275, 0.40821073],
                           image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(folder / "image_processor")


def _config(folder: Path, cls: type, values: dict) -> None:
    """A diffusers class's config.json as its save_config writes it (the class's defaults filled in)."""
    folder.mkdir(parents=True)
    with _meta():
        cls.from_config(values).save_config(folder)  # type: ignore[attr-defined]


def _meta():  # noqa: ANN202 - a context manager
    import torch

    return torch.device("meta")


if __name__ == "__main__":
    for model in MODELS:
        write(model)
