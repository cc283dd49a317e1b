"""Every place a user's file enters a run, its reader and what happens to a damaged one (issue 62).

Two policies. A *sample* (an image, a caption, a mask, a reference image, a table row, a shard
member) is skipped, counted per source in the log and `summary.json` and named there; the run
stops with one screen when nothing usable is left. A *whole* file the run cannot do without
(weights, a LoRA to start from, a checkpoint, a table, a shard) is refused with its path, what
is wrong and the fix, before the first step: torch-free at the configuration's checks where
its header tells (seconds), else when the data or the model is built, before Accelerate's
set-up where it can be read then. tests/test_damaged_inputs.py runs a corpus of damaged files
(tests/helpers/damaged.py) over each entry here; a surface added later is covered by adding it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Surface:
    name: str  # the key a user sets, or the kind of file
    what: str
    policy: str  # "whole" or "sample"
    reader: str  # the module that reads it first
    when: str  # "checks": before anything starts; "data": building the dataset; "resume"


SURFACES = (
    Surface("model.pretrained (file)", "a single-file SDXL checkpoint (.safetensors)", "whole",
            "config/weights_file.py", "checks"),
    Surface("model.pretrained (folder)", "a diffusers folder (model_index.json and its parts)",
            "whole", "config/weights_file.py", "checks"),
    Surface("model.vae", "a VAE: one weights file or a diffusers folder", "whole",
            "config/weights_file.py", "checks"),
    Surface("model.transformer", "a transformer in its makers' layout (.safetensors)", "whole",
            "config/weights_file.py", "checks"),
    Surface("adapter.init_from", "a LoRA or LyCORIS file to start from (.safetensors)", "whole",
            "config/checks/paths.py", "checks"),
    Surface("resume", "a checkpoint folder (its COMPLETE marker, every file's hash)", "whole",
            "train/state/checkpoint.py", "checks"),
    Surface("resume (portable state)", "meta.json, the safetensors shards, scheduler.pt, ema.pt",
            "whole", "train/state/portable.py", "resume"),
    Surface("data.cache_dir", "the folder the latent cache is written to", "whole",
            "config/checks/paths.py", "checks"),
    Surface("table", "a .jsonl, .csv or .parquet of file names and captions", "whole",
            "train/data/sources.py", "data"),
    Surface("table row", "one row of a table", "sample", "train/data/sources.py", "data"),
    Surface("saved dataset", "a Hugging Face dataset saved with save_to_disk (its JSON and .arrow "
            "files)", "whole", "train/data/archives.py", "data"),
    Surface("tar shard", "a webdataset .tar shard", "whole", "train/data/sources.py", "data"),
    Surface("image", "an image file of a folder, a table or a shard", "sample",
            "train/data/images.py", "data"),
    Surface("video", "a video model's clip: a video file (mp4, webm, mov, mkv) of a folder, a "
            "table, a shard or a saved dataset", "sample", "train/data/video.py", "data"),
    Surface("caption", "a caption file (.txt) in any of the encodings people write", "sample",
            "train/data/text.py", "data"),
    Surface("mask", "an image's <name>.mask.png (data.masked_loss)", "sample",
            "train/data/scan.py", "data"),
    Surface("reference image", "an editing model's reference image, paired by name "
            "(data.control_path)", "sample", "train/data/scan.py", "data"),
    Surface("cache pack", "a pack of cached latents in data.cache_dir (a shared cache: another "
            "run's, or a copy)", "sample", "train/data/cache.py", "data"),
    Surface("preset", "a config group's option file (+experiment=<name>: the tuner's winner, one "
            "of your own)", "whole", "config/presets.py", "checks"),
)

NAMES = frozenset(s.name for s in SURFACES)
