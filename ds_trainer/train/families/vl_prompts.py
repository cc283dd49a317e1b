"""What QwenImageEditPipeline asks of its `processor` (transformers' Qwen2VLProcessor), built from the parts that
need no torchvision: Qwen2-VL's image processor (its PIL backend) and the tokenizer. Transformers builds a
Qwen2VLProcessor only beside a video processor, which needs torchvision; this one does what its `__call__` does for
images and text (each image's `<|image_pad|>` repeated once per merged patch of it, then the tokenizer), so training
encodes a prompt as the pipeline does, with torchvision or without. A test holds it to Qwen2VLProcessor's own
output.

Saved (in an exported pipeline's `processor` folder) as Qwen2VLProcessor's files: the image processor's config under
transformers' class name and the tokenizer's files, which Qwen2VLProcessor.from_pretrained reads where torchvision
is installed; the pipeline's model_index names Qwen2VLProcessor.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import BatchFeature, ProcessorMixin

log = logging.getLogger(__name__)

IMAGE_PAD = "<|image_pad|>"


class VLPrompts(ProcessorMixin):  # type: ignore[misc]
    """Images and text to Qwen2.5-VL's inputs: `input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw`.
    A ProcessorMixin so that a diffusers pipeline saves it as one (`save_pretrained`); ProcessorMixin's own
    construction, which asks for the video processor, is not run."""

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:  # noqa: D107 - the class says it
        self.image_processor, self.tokenizer = image_processor, tokenizer

    @classmethod
    def from_folder(cls, path: str | Path, subfolder: str = "", **kwargs: Any) -> VLPrompts:
        """From a processor's folder (Qwen-Image-Edit's `processor`): its image processor's config and tokenizer."""
        from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil

        return cls(Qwen2VLImageProcessorPil.from_pretrained(path, subfolder=subfolder, **kwargs),
                   Qwen2Tokenizer.from_pretrained(path, subfolder=subfolder, **kwargs))

    def __call__(self, text: list[str], images: Any = None, padding: bool = True,  # type: ignore[override]
                 return_tensors: str = "pt", **_: Any) -> BatchFeature:
        features: dict[str, torch.Tensor] = {}
        if images is not None:
            features = dict(self.image_processor(images=images, return_tensors=return_tensors))
            merge = int(self.image_processor.merge_size) ** 2
            counts = iter((features["image_grid_thw"].prod(-1) // merge).tolist())
            text = [parts[0] + "".join(IMAGE_PAD * next(counts) + rest for rest in parts[1:])
                    for parts in (t.split(IMAGE_PAD) for t in text)]
        tokens = self.tokenizer(text, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**tokens, **features})

    def save_pretrained(self, save_directory: str | Path, **_: Any) -> None:  # type: ignore[override]
        """Qwen2VLProcessor's files: `preprocessor_config.json` (under transformers' class names) and the
        tokenizer's."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        size = self.image_processor.size  # also as min_pixels and max_pixels, the keys transformers 4 reads
        config = {**self.image_processor.to_dict(), "image_processor_type": "Qwen2VLImageProcessor",
                  "processor_class": "Qwen2VLProcessor", "min_pixels": size.shortest_edge,
                  "max_pixels": size.longest_edge}
        (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        self.tokenizer.save_pretrained(folder)
        self._read_back(folder)

    def _read_back(self, folder: Path) -> None:
        """Where torchvision is installed, the saved folder through transformers' own Qwen2VLProcessor: the same
        tokens and image grid as this one for a test picture, or the export fails here rather than in a user's
        pipeline."""
        if importlib.util.find_spec("torchvision") is None:
            log.info("export: %s is Qwen2VLProcessor's files, not read back by it here (it needs torchvision)",
                     folder)
            return
        from PIL import Image
        from transformers import Qwen2VLProcessor

        real = Qwen2VLProcessor.from_pretrained(folder)
        text, pictures = [f"<|vision_start|>{IMAGE_PAD}<|vision_end|>a red square"], [Image.new("RGB", (96, 64), "red")]
        ours = self(text=text, images=pictures)
        theirs = real(text=text, images=pictures, padding=True, return_tensors="pt")
        if not all(torch.equal(ours[k], theirs[k]) for k in ("input_ids", "image_grid_thw")):
            raise RuntimeError(f"{folder}: transformers' Qwen2VLProcessor reads the exported processor into other "
                               f"inputs than training's ({ours['input_ids'].tolist()} against "
                               f"{theirs['input_ids'].tolist()}); a ds_trainer bug: please report it")
        gap = float((ours["pixel_values"] - theirs["pixel_values"]).abs().max())
        log.info("export: %s reads back through transformers' Qwen2VLProcessor (%s): the same tokens and image grid, "
                 "pixel values within %.3g", folder, type(real.image_processor).__name__, gap)

    def __repr__(self) -> str:
        return f"VLPrompts({type(self.image_processor).__name__}, {type(self.tokenizer).__name__})"
