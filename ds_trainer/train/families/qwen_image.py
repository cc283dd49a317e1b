"""Qwen-Image: QwenImageTransformer2DModel (a dual-stream MMDiT) trained by flow matching (train/flow.py) with the
resolution-dependent shift its sampler uses (the line of its scheduler config: mu 0.5 at 256 image tokens to 0.9 at
8192), on the VAE's latents (AutoencoderKLQwenImage, a video VAE given one frame) normalised by its per-channel mean
and std, then packed 2 x 2 into tokens as Flux's; the transformer is given sigma as its timestep and each image's
(frames, rows, columns) of tokens for its 3-axis RoPE.

Captions: Qwen2.5-VL's last hidden state over QwenImagePipeline's chat template, the template's system prefix (its
first 34 tokens) dropped, as the pipeline encodes them; cached padded to `model.flow.text_max_length` tokens in bf16
with the mask of the caption's own tokens (`prompt_mask`), which the transformer's joint attention applies.
QwenImagePipeline samples and is exported.

Qwen-Image-Edit (`model.reference_images`): the reference image's packed latents follow the image's tokens (a second
entry of `img_shapes`), the loss is on the image's own tokens; the caption is encoded with the reference through
QwenImageEditPipeline's template, whose system prefix is 64 tokens, so its sequence holds the reference's vision
tokens before the caption's: cached padded to those tokens, 2 (the vision start and end) and `text_max_length`. The
reference is the one the latents see, at the bucket's size (the pipeline fits it to about a megapixel).
QwenImageEditPipeline samples (on `samples.images`) and is exported, its processor saved as Qwen2VLProcessor's files
(vl_prompts.py).

The text encoder stays frozen (a 7 B vision-language model; peers train the transformer alone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.qwen_image import SPEC
from ds_trainer.train.families import common, flow, qwen_edit_plus
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.families.flux import pack
from ds_trainer.train.families.vl_prompts import VLPrompts
from ds_trainer.train.layouts import kohya
from ds_trainer.train.layouts.table import Part

# QwenImagePipeline's prompt template and the tokens of its system prefix it drops (pipeline_qwenimage.py; a test
# checks both against the pipeline's).
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
DROP = 34
# QwenImageEditPipeline's (pipeline_qwenimage_edit.py; the same test checks them): the reference before the caption
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>"
                 "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_DROP = 64


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder",)
    vae: Any  # AutoencoderKLQwenImage
    text_encoder: Any  # Qwen2_5_VLForConditionalGeneration: its language model's last hidden state
    tokenizer: Any
    processor: Any = None  # Qwen-Image-Edit's: the reference and the caption to the encoder's inputs (VLPrompts)


def image_shapes(*latents: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Each sample's (frames, rows, columns) of packed tokens, as QwenImagePipeline passes `img_shapes`: the image's,
    then an editing model's reference's."""
    return [[(1, x.shape[-2] // 2, x.shape[-1] // 2) for x in latents]] * latents[0].shape[0]


def _pictures(pixels: torch.Tensor) -> list[Any]:
    """Images in [-1, 1] as the PIL pictures a pipeline is given."""
    from PIL import Image

    values = ((pixels.float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    return [Image.fromarray(v.numpy()) for v in values]


class QwenImage(FlowFamily):
    spec = SPEC
    name = SPEC.name
    sequence_encoder = "Qwen2.5-VL"

    def __init__(self, cfg: DictConfig | None = None) -> None:
        f = cfg.model.flow if cfg is not None else None
        self._text_length = int(f.text_max_length) if f is not None else 512
        # Qwen-Image-Edit: the reference's latents after the image's, its picture in the caption's encoding
        self.reference = bool(cfg.model.get("reference_images")) if cfg is not None else False
        self.text_sees_reference = self.reference
        # Qwen-Image-Edit-2509/2511 (model.references > 1): QwenImageEditPlusPipeline's references
        references = int(cfg.model.get("references") or 1) if cfg is not None else 1
        self.plus = self.reference and references > 1

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        from diffusers import AutoencoderKLQwenImage
        from transformers import (
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2Tokenizer,
            Qwen2VLImageProcessorPil,
        )

        console.adopt()
        path, kwargs = common.source(cfg)
        with whole():
            tokenizer = Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs)
            if cfg.model.pretrained:
                vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", **kwargs)
                encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", **kwargs)
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(path, subfolder="vae"))
                encoder = Qwen2_5_VLForConditionalGeneration(
                    Qwen2_5_VLConfig.from_pretrained(path, subfolder="text_encoder"))
            revision = {k: v for k, v in kwargs.items() if k == "revision"}  # a weights' variant is not the config's
            processor = VLPrompts(Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor", **revision),
                                  tokenizer) if self.reference else None
        for module in (vae, encoder):
            module.requires_grad_(False)
            module.eval()
        return Frozen(vae, encoder, tokenizer, processor)

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import QwenImageTransformer2DModel

        return common.trained_module(  # type: ignore[no-any-return]
            cfg, QwenImageTransformer2DModel, "transformer", cfg.model.get("transformer"))

    def unused(self, model: torch.nn.Module) -> list[str]:
        """The last block's text-stream output (its attention's `to_add_out`, its `txt_mlp`): the transformer returns
        the image tokens alone, so the text stream's last update feeds nothing."""
        last = f"transformer_blocks.{len(model.transformer_blocks) - 1}"  # type: ignore[arg-type]
        return [f"{last}.attn.to_add_out", f"{last}.txt_mlp"]

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import QwenImageTransformer2DModel

        return common.meta_module(cfg, QwenImageTransformer2DModel, "transformer")

    @torch.no_grad()
    def encode_images(self, frozen: Frozen, pixels: torch.Tensor) -> torch.Tensor:
        """One frame through the video VAE; the latents normalised by its per-channel mean and std (the pipeline
        decodes latents * std + mean)."""
        vae = frozen.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)[:, :, None]).latent_dist.mean[:, :, 0]
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, -1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, -1, 1, 1)
        return ((latents.float() - mean) / std).to(latents.dtype)

    def storage_dtype(self, key: str) -> torch.dtype | None:
        return torch.bfloat16 if key == "prompt_embeds" else None

    @torch.no_grad()
    def text_inputs(self, frozen: Frozen, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`prompt_embeds`: each caption's hidden states after the template's system prefix, padded with zeros to
        `text_max_length` tokens (an editing model's: its reference's vision tokens and 2 more); `prompt_mask`: 1 on
        the caption's own tokens."""
        if self.reference:
            if references is None:
                raise ValueError("Qwen-Image-Edit encodes each caption with its references; none given")
            inputs, length, drop = self._edit_inputs(frozen, prompts, references, device)
        else:
            inputs = frozen.tokenizer([TEMPLATE.format(p) for p in prompts], max_length=self._text_length + DROP,
                                      padding=True, truncation=True, return_tensors="pt").to(device)
            length, drop = self._text_length, DROP
        # The model under the LM head, without a KV cache: its last hidden state is the full model's
        # hidden_states[-1] (after the final norm), without the 152k-wide logits of every token
        # (review 3's P7: 1.3 GB a cache batch of 8) or every layer's states kept.
        hidden = frozen.text_encoder.model(**inputs, use_cache=False).last_hidden_state
        embeds = hidden.new_zeros(len(prompts), length, hidden.shape[-1])
        mask = torch.zeros(len(prompts), length, dtype=torch.long, device=device)
        for i, (states, keep) in enumerate(zip(hidden, inputs.attention_mask.bool(), strict=True)):
            own = states[keep][drop:drop + length]
            embeds[i, :len(own)], mask[i, :len(own)] = own, 1
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    def _edit_inputs(self, frozen: Frozen, prompts: list[str], references: torch.Tensor,
                     device: torch.device) -> tuple[Any, int, int]:
        """An editing model's encoder inputs, the tokens each caption's states are kept to and the
        prefix dropped: Qwen-Image-Edit's one reference, or 2509/2511's several."""
        if self.plus:
            inputs, length = qwen_edit_plus.inputs(frozen.processor, prompts, references,
                                                   self._text_length, device)
            return inputs, length, qwen_edit_plus.DROP
        inputs = frozen.processor(text=[EDIT_TEMPLATE.format(p) for p in prompts], images=_pictures(references),
                                  padding=True, return_tensors="pt").to(device)
        length = int(inputs.image_grid_thw[0].prod()) // int(frozen.processor.image_processor.merge_size) ** 2
        return inputs, length + 2 + self._text_length, EDIT_DROP

    def text_parts(self, frozen: Frozen) -> TextParts:  # noqa: ARG002 - the Family protocol's signature
        """Qwen2.5-VL makes the whole sequence (its mask says which tokens are the caption's)."""
        return {"qwen_vl": [("prompt_embeds", (slice(None), slice(None)))]}

    def schedule(self, cfg: DictConfig) -> flow.Schedule:
        """The flow schedule with the sampler's shift line (its scheduler config: Qwen-Image's is not Flux's)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        path, kwargs = common.source(cfg)
        c = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", **kwargs)
        line = (int(c["base_image_seq_len"]), int(c["max_image_seq_len"]), float(c["base_shift"]),
                float(c["max_shift"]))
        return flow.Schedule.of(cfg, line=line)

    def image_tokens(self, latents: torch.Tensor) -> int:
        """The packed tokens of the latents (2 x 2 patches): what the noise levels shift with."""
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        sigma = schedule.sigma(t, self.image_tokens(latents))  # the edit pipeline's shift: the image's tokens alone
        noisy = pack(flow.noisy(latents, noise, sigma))
        # Qwen-Image-Edit: the references' tokens after the image's, in order
        shown = [latents, *(batch[key] for key in common.reference_keys(8) if key in batch)]
        noisy = torch.cat([noisy, *(pack(r.to(noisy.dtype)) for r in shown[1:])], dim=1)
        pred = model(hidden_states=noisy.to(device, dtype), timestep=sigma.to(device),  # sigma, as sampled
                     encoder_hidden_states=batch["prompt_embeds"].to(device, dtype),
                     encoder_hidden_states_mask=batch["prompt_mask"].to(device),
                     img_shapes=image_shapes(*shown)).sample[:, :self.image_tokens(latents)]
        weight = batch.get("weight_map")  # the mask packed as the latents are: one weight per packed value
        return per_sample_mse(pred, pack(flow.target(latents, noise)),
                              None if weight is None else pack(weight.expand_as(latents)))

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        path, kwargs = common.source(cfg)
        pipe = self.lora_pipeline()(
            transformer=trained["transformer"] if "transformer" in trained else self.load_trained(cfg).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kwargs),
            vae=frozen.vae, text_encoder=frozen.text_encoder, tokenizer=frozen.tokenizer,
            **({"processor": frozen.processor} if self.reference else {}))
        if self.reference:  # saved as Qwen2VLProcessor's files: the model index names that class
            pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
        return pipe

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:  # noqa: ARG002 - the Family protocol's signature
        return {"max_sequence_length": self._text_length}

    def guidance_kwargs(self, scale: float, negative: str) -> dict[str, Any]:
        """QwenImagePipeline guides by `true_cfg_scale` and only with a negative prompt (one space when empty); its
        `guidance_scale` is a distilled model's input, which Qwen-Image has not."""
        return {"true_cfg_scale": scale, "negative_prompt": negative or " ", "guidance_scale": None}

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        """ComfyUI's file (Comfy-Org's qwen_image_bf16) keeps diffusers' names."""
        return dict(denoiser.state_dict())

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> list[Part]:  # noqa: ARG002
        """musubi-tuner's names, which ComfyUI reads: diffusers' modules."""
        return kohya.same_names(shapes)

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """2 x 2 patches of latents as tokens, their (frames, rows, columns)."""
        c, b, rows, columns = model.config, shape.batch, shape.height // 16, shape.width // 16
        tokens, on = shape.tokens, shape.tensors
        inputs = {"hidden_states": torch.randn(b, rows * columns, int(c.in_channels), **on),
                  "encoder_hidden_states": torch.randn(b, tokens, int(c.joint_attention_dim), **on),
                  "encoder_hidden_states_mask": torch.ones(b, tokens, dtype=torch.long,
                                                           device=shape.device),
                  "timestep": torch.rand(b, device=shape.device),
                  "img_shapes": [[(1, rows, columns)]] * b}
        return lambda: model(**inputs)

    def planner_blocks(self) -> tuple[type, ...]:
        """Dual-stream blocks."""
        from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

        return (QwenImageTransformerBlock,)

    def lora_pipeline(self) -> Any:
        """QwenImagePipeline, or QwenImageEditPipeline for a model that edits a reference image (the same LoRA
        keys)."""
        from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline

        if self.plus:
            return QwenImageEditPlusPipeline
        return QwenImageEditPipeline if self.reference else QwenImagePipeline
