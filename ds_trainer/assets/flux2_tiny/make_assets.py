"""How the FLUX.2 folders of ds_trainer/assets were made: FLUX.2's classes at tiny sizes (random weights, no
download) and at the real sizes of FLUX.2 [dev] and [klein] 4B and 9B (the planner builds them on the meta device).
`python make_assets.py` writes them again.

FLUX.2 [dev] (black-forest-labs/FLUX.2-dev): Flux2Transformer2DModel (8 double- and 48 single-stream blocks, 6144
wide, a distilled guidance input; diffusers' defaults), AutoencoderKLFlux2 (32 latent channels, patchified 2 x 2 and
normalised by its batch-norm statistics), Mistral Small 3.1 (Mistral3ForConditionalGeneration: its hidden states
10, 20 and 30 stacked, 3 x 5120 wide). [klein] 4B and 9B: 5 + 20 blocks 3072 wide and 8 + 24 blocks 4096 wide, no
guidance input, Qwen3-4B's and Qwen3-8B's hidden states 9, 18 and 27. The scheduler: Flux's resolution-dependent
shift. The tiny ones keep every trait (the layers the pipelines stack: the tiny encoders are 31 and 28 layers deep,
of a 32-wide hidden state), a tiny Mistral-style tokenizer with its chat template ([SYSTEM_PROMPT], [INST]) and
z_image_tiny's Qwen3 one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TRANSFORMER_TINY = {"in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                    "num_attention_heads": 2, "joint_attention_dim": 96, "timestep_guidance_channels": 32,
                    "axes_dims_rope": [4, 4, 4, 4]}
VAE_TINY = {"block_out_channels": [16, 32, 32, 32], "latent_channels": 4, "norm_num_groups": 16,
            "layers_per_block": 1}
MISTRAL_TINY = {"vocab_size": 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 31,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 2048}
PIXTRAL_TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": 56, "patch_size": 14, "head_dim": 8}
MISTRAL_SMALL = {"vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 131072, "rope_theta": 1000000000.0, "rms_norm_eps": 1e-5}
PIXTRAL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
           "image_size": 1540, "patch_size": 14, "head_dim": 64, "rope_theta": 10000.0}
QWEN3_TINY = {"vocab_size": 832, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 28,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 2048,
              "rope_theta": 1000000.0, "tie_word_embeddings": True}
QWEN3 = {"vocab_size": 151936, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0}
QWEN3_4B = {**QWEN3, "hidden_size": 2560, "tie_word_embeddings": True}
QWEN3_8B = {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
KLEIN_4B = {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "joint_attention_dim": 7680,
            "guidance_embeds": False}
KLEIN_9B = {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "joint_attention_dim": 12288,
            "guidance_embeds": False}
# name: (transformer, VAE, text encoder: ("mistral", text, vision) or ("qwen3", config))
MODELS: dict[str, tuple[Any, ...]] = {
    "flux2_tiny": (TRANSFORMER_TINY, VAE_TINY, ("mistral", MISTRAL_TINY, PIXTRAL_TINY)),
    "flux2_klein_tiny": ({**TRANSFORMER_TINY, "guidance_embeds": False}, VAE_TINY, ("qwen3", QWEN3_TINY)),
    "flux2_dev": ({}, {}, ("mistral", MISTRAL_SMALL, PIXTRAL)),
    "flux2_klein_4b": (KLEIN_4B, {}, ("qwen3", QWEN3_4B)),
    "flux2_klein_9b": (KLEIN_9B, {}, ("qwen3", QWEN3_8B)),
}
# Mistral Small 3.1's chat template for a system message and user turns of text parts (Flux2Pipeline's call)
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
                    "[SYSTEM_PROMPT]{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
                    "[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}[INST]{% for part in message['content'] %}"
                    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}[/INST]{% endif %}"
                    "{% endfor %}")
MISTRAL_SPECIAL = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                   "[IMG]")


def _mistral_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer with Mistral's special tokens, whole-word tokens for FLUX.2's system message
    and common caption words, and the chat template."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    words = (SYSTEM_MESSAGE + " a an the of on in with and red green blue square circle cube background small "
             "large dark light night make turn into").split()
    trainer = trainers.BpeTrainer(vocab_size=1024, min_frequency=1, show_progress=False,
                                  initial_alphabet=ByteLevel.alphabet(), special_tokens=list(MISTRAL_SPECIAL))
    tokenizer.train_from_iterator([" ".join(words), *words, *(" " + w for w in words)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=131072,
                                   chat_template=MISTRAL_TEMPLATE)
    fast.save_pretrained(folder)


def write(name: str) -> None:
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig, Qwen3Config

    transformer, vae, text = MODELS[name]
    folder = ROOT / name
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        shutil.rmtree(folder / part, ignore_errors=True)
    with torch.device("meta"):
        Flux2Transformer2DModel.from_config(transformer).save_config(folder / "transformer")
        AutoencoderKLFlux2.from_config(vae).save_config(folder / "vae")
    config: Any
    if text[0] == "mistral":
        config = Mistral3Config(text_config=MistralConfig(**text[1]).to_dict(),
                                vision_config=PixtralVisionConfig(**text[2]).to_dict(), image_token_index=10)
        config.architectures = ["Mistral3ForConditionalGeneration"]
        _mistral_tokenizer(folder / "tokenizer")
    else:
        config = Qwen3Config(**text[1])
        config.architectures = ["Qwen3ForCausalLM"]
        shutil.copytree(ROOT / "z_image_tiny" / "tokenizer", folder / "tokenizer")
    config.save_pretrained(folder / "text_encoder")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                    base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                    max_image_seq_len=4096).save_config(folder / "scheduler")  # type: ignore[attr-defined]
    json.loads((folder / "transformer" / "config.json").read_text())  # written


if __name__ == "__main__":
    for model in MODELS:
        write(model)
