"""How the Z-Image folders of ds_trainer/assets were made: Z-Image's classes at a tiny size (random weights, no
download) and at their real size (the planner builds it on the meta device). `python make_assets.py` writes them
again.

Z-Image (Tongyi-MAI/Z-Image and Z-Image-Turbo: the same architecture) is a single-stream DiT: the image's 2 x 2
patches and the caption's tokens, each refined apart first, then one sequence through its layers. Its parts are
ZImagePipeline's: ZImageTransformer2DModel (diffusers' defaults are the released config: 3840 wide, 30 layers and 2
refiner layers of each kind, 30 heads, captions 2560 wide), Flux's 16-channel AutoencoderKL, Qwen3-4B's
(Qwen3Model) second-to-last hidden state of the caption in Qwen3's chat template, and FlowMatchEulerDiscreteScheduler
with a fixed shift of 3.0 and no dynamic shifting (the released scheduler config). The tiny one keeps every trait
(the refiners, the 32-token padding of each sequence, the pad tokens, 3-axis RoPE) and takes flux_tiny's VAE; its
tokenizer is qwen_image_tiny's small Qwen2-shaped one with a chat template that writes what Qwen3's writes for one
user message (the real template comes with the real tokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TINY = {"dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "in_channels": 4,
        "cap_feat_dim": 32, "axes_dims": [4, 6, 6], "axes_lens": [512, 64, 64]}
QWEN3_TINY = {"vocab_size": 832, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 2048,
              "rope_theta": 1000000.0, "tie_word_embeddings": True}
QWEN3_4B = {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
# Qwen3's chat template for one user message with the generation prompt, thinking on (ZImagePipeline's call)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")
# name: (transformer config, text encoder config, the Flux folder whose VAE it takes)
MODELS: dict[str, tuple[Any, ...]] = {"z_image_tiny": (TINY, QWEN3_TINY, "flux_tiny"),
                                      "z_image": ({}, QWEN3_4B, "flux_dev")}


def write(name: str) -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config

    transformer, text, flux = MODELS[name]
    folder = ROOT / name
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        shutil.rmtree(folder / part, ignore_errors=True)
    (folder / "transformer").mkdir(parents=True)
    with torch.device("meta"):
        ZImageTransformer2DModel.from_config(transformer).save_config(folder / "transformer")
    shutil.copytree(ROOT / flux / "vae", folder / "vae")
    config = Qwen3Config(**text)
    config.architectures = ["Qwen3Model"]
    config.save_pretrained(folder / "text_encoder")
    (folder / "tokenizer").mkdir()
    shutil.copy(ROOT / "qwen_image_tiny" / "tokenizer" / "tokenizer.json", folder / "tokenizer" / "tokenizer.json")
    tokenizer = json.loads((ROOT / "qwen_image_tiny" / "tokenizer" / "tokenizer_config.json").read_text())
    tokenizer.update(model_max_length=40960, chat_template=CHAT_TEMPLATE)
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0,
                                    use_dynamic_shifting=False).save_config(folder / "scheduler")  # type: ignore[attr-defined]


if __name__ == "__main__":
    for model in MODELS:
        write(model)
