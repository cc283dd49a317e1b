"""An exported pipeline read back as a user reads it (`DiffusionPipeline.from_pretrained`). Qwen-Image-Edit's
processor folder (Qwen2VLProcessor's files) is read by ds_trainer's VLPrompts: transformers builds a Qwen2VLProcessor
only beside a video processor, which needs torchvision, which this machine lacks (the GPU check reads it with
Qwen2VLProcessor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(folder: Path, **kwargs: Any) -> Any:
    from diffusers import DiffusionPipeline

    from ds_trainer.train.families.vl_prompts import VLPrompts

    index = json.loads((folder / "model_index.json").read_text())
    if index.get("processor") == ["transformers", "Qwen2VLProcessor"]:
        kwargs["processor"] = VLPrompts.from_folder(folder / "processor")
    return DiffusionPipeline.from_pretrained(folder, **kwargs)
