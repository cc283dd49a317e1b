"""How the Qwen-Image-Edit-2511 folders of ds_trainer/assets were made: Qwen-Image's parts (qwen_image_tiny's at a
tiny size, qwen_image's at the real size) with the transformer of 2511, which modulates the reference images' tokens
as at timestep 0 (diffusers' QwenImageTransformer2DModel `zero_cond_t`). `python make_assets.py` writes them again.
Qwen-Image-Edit-2509 is Qwen-Image's transformer itself (model=qwen_image_edit_2509 builds ds_trainer/assets/
qwen_image)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"qwen_image_edit_plus_tiny": "qwen_image_tiny", "qwen_image_edit_2511": "qwen_image"}


def write(name: str) -> None:
    folder, base = ROOT / name, ROOT / MODELS[name]
    for part in ("processor", "scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        shutil.rmtree(folder / part, ignore_errors=True)
        shutil.copytree(base / part, folder / part, ignore=shutil.ignore_patterns("*.py"))
    config = json.loads((base / "transformer" / "config.json").read_text())
    config["zero_cond_t"] = True
    (folder / "transformer" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    for model in MODELS:
        write(model)
