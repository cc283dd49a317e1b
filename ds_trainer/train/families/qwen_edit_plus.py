"""Qwen-Image-Edit-2509/2511's captions (model.references > 1: QwenImageEditPlusPipeline's): each
reference named in the caption's turn as `Picture N: <|vision_start|><|image_pad|><|vision_end|>`
before the caption, in QwenImageEditPipeline's chat template (its 64-token system prefix dropped),
and each reference given to Qwen2.5-VL's vision tower at about 384 x 384 pixels of its shape
(`CONDITION_IMAGE_SIZE`, rounded to 32) rather than at the image's size. A test holds these to the
pipeline's own `_get_qwen_prompt_embeds`."""

from __future__ import annotations

import math
from typing import Any

import torch

# QwenImageEditPlusPipeline's: the template (QwenImageEditPipeline's without its one picture),
# the prefix it drops, each reference's part of the caption's turn and the pixels it encodes it at
TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, "
            "size, texture, objects, background), then explain how the user's text instruction "
            "should alter or modify the image. Generate a new image that meets the user's "
            "requirements while maintaining consistency with the original input where "
            "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
DROP = 64
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
CONDITION_AREA = 384 * 384


def condition_size(width: int, height: int) -> tuple[int, int]:
    """The pipeline's `calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)`: about 384 x 384 pixels of
    the reference's shape, each side rounded to 32."""
    w = math.sqrt(CONDITION_AREA * width / height)
    return round(w / 32) * 32, round(w * height / width / 32) * 32


def pictures(references: torch.Tensor) -> list[Any]:
    """References in [-1, 1] ((B, R, 3, H, W), or (B, 3, H, W) for one each) as the PIL pictures the
    processor is given, each at its condition size (LANCZOS, as the pipeline's image processor
    resizes), sample by sample."""
    from PIL import Image

    if references.ndim == 4:
        references = references[:, None]
    b, r = references.shape[:2]
    values = ((references.float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    flat = [Image.fromarray(v.permute(1, 2, 0).numpy())
            for v in values.reshape(b * r, *values.shape[2:])]
    return [p.resize(condition_size(*p.size), Image.Resampling.LANCZOS) for p in flat]


def texts(prompts: list[str], count: int) -> list[str]:
    """Each caption in the template after its `count` pictures."""
    named = "".join(PICTURE.format(n + 1) for n in range(count))
    return [TEMPLATE.format(named + p) for p in prompts]


def inputs(processor: Any, prompts: list[str], references: torch.Tensor, text_length: int,
           device: torch.device) -> tuple[Any, int]:
    """The encoder's inputs of a batch (each sample with as many references) and the tokens each
    caption's states are kept to: the pictures' parts (their vision tokens) and `text_length`."""
    count = 1 if references.ndim == 4 else int(references.shape[1])
    found = processor(text=texts(prompts, count), images=pictures(references), padding=True,
                      return_tensors="pt").to(device)
    merge = int(processor.image_processor.merge_size) ** 2
    vision = [int(grid.prod()) // merge for grid in found.image_grid_thw[:count]]
    # the template's tokens before the caption with one <|image_pad|> a picture, less the prefix
    named = "".join(PICTURE.format(n + 1) for n in range(count))
    before = len(processor.tokenizer(TEMPLATE.split("{}")[0] + named).input_ids) - DROP
    return found, before + sum(v - 1 for v in vision) + text_length
