"""The files and folders a run reads: the images, the model's weights, the checkpoint to resume. Torch-free,
read-only.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import weights_file
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig) -> list[Problem]:
    """data.path, model.pretrained (and what its file holds, model.vae), then resume."""
    out = []
    if cfg.data.source.value == "folder":
        if OmegaConf.is_missing(cfg.data, "path") or not cfg.data.path:
            out.append(Problem("data.path", "???", "data=folder reads images from a folder",
                               "data.path=/path/to/images"))
        elif not Path(cfg.data.path).is_dir():
            out.append(Problem("data.path", cfg.data.path, "is not a folder", "data.path=/path/to/images"))
    out += _sources(cfg)
    pretrained = cfg.model.pretrained
    if weights_file.is_single_file(pretrained) and not Path(pretrained).exists():
        out.append(Problem("model.pretrained", pretrained, "no such checkpoint file",
                           "model.pretrained=/path/to/sd_xl_base_1.0.safetensors"))
    elif pretrained and not Path(pretrained).exists() and not re.fullmatch(r"[\w.-]+/[\w.-]+", pretrained):
        out.append(Problem("model.pretrained", pretrained, "is neither a local folder nor a hub id (org/name)",
                           "model.pretrained=/path/to/diffusers/folder (or stabilityai/stable-diffusion-xl-base-1.0)"))
    out += weights_file.problems(cfg)
    resume = cfg.resume
    if resume not in (None, "latest") and not Path(resume).is_dir():
        out.append(Problem("resume", resume, "is neither `latest` nor a checkpoint folder",
                           "resume=latest (or resume=<run dir>/checkpoints/step_N)"))
    return out


def _sources(cfg: DictConfig) -> list[Problem]:
    """data.sources (data=sources): each path there (every shard of a brace pattern), repeats and caption dropout in
    range; a list given to another data option is not read, which is said rather than ignored."""
    out = []
    if not 0.0 <= float(cfg.data.caption_dropout) <= 1.0:
        out.append(Problem("data.caption_dropout", cfg.data.caption_dropout, "is a probability (of an empty caption)",
                           "data.caption_dropout=0.1"))
    if not 0.0 <= float(cfg.data.unmasked_weight) <= 1.0:
        out.append(Problem("data.unmasked_weight", cfg.data.unmasked_weight, "is the loss's weight outside the mask, "
                           "between 0 (not trained) and 1 (as inside)", "data.unmasked_weight=0.1"))
    if cfg.data.masked_loss and cfg.data.source.value == "synthetic":
        out.append(Problem("data.masked_loss", True, "synthetic images have no masks (masks come from an image's alpha "
                           "channel or a <name>.mask.png beside it)", "data=folder or data=sources with masked images"))
    if cfg.data.source.value != "sources":
        if not OmegaConf.is_missing(cfg.data, "sources") and len(cfg.data.sources):
            return [Problem("data.sources", f"[{len(cfg.data.sources)} source(s)]",
                            f"is read with data=sources only, not data={cfg.data.source.value}",
                            "data=sources data.sources=[...] (or drop data.sources)"), *out]
        return out
    if OmegaConf.is_missing(cfg.data, "sources") or not len(cfg.data.sources):
        return [Problem("data.sources", "[]", "data=sources reads images from a list of sources",
                        "data.sources='[{path: /data/subject, repeats: 3}, {path: /data/style.parquet}]'"), *out]
    for index, source in enumerate(cfg.data.sources):
        key = f"data.sources[{index}]"
        out += [Problem(f"{key}.path", shard, "does not exist",
                        f"{key}.path=<a folder, a .jsonl/.csv/.parquet file, tar shards or a saved dataset's folder>")
                for shard in _shards(str(source.path)) if not Path(shard).exists()]
        if int(source.repeats) < 1:
            out.append(Problem(f"{key}.repeats", source.repeats, "must be at least 1 (the times an epoch each of its "
                               "images is seen)", f"{key}.repeats=1, or remove the source"))
        if float(source.loss_weight) < 0:
            out.append(Problem(f"{key}.loss_weight", source.loss_weight, "weighs its samples' loss: 0 or more",
                               f"{key}.loss_weight=1.0"))
        dropout = source.caption_dropout
        if dropout is not None and not 0.0 <= float(dropout) <= 1.0:
            out.append(Problem(f"{key}.caption_dropout", dropout, "is a probability", f"{key}.caption_dropout=0.1"))
    names = [str(s.name) for s in cfg.data.sources if s.name is not None]
    if len(set(names)) != len(names):
        out.append(Problem("data.sources", ", ".join(names), "two sources have the same name: the log, summary.json "
                           "and the cache tell sources apart by it", "give each source a name of its own"))
    return out


def _shards(path: str) -> list[str]:
    """A brace pattern's paths (`shards/{000..009}.tar`), as webdataset expands them; another path as it is."""
    if "{" not in path:
        return [path]
    import braceexpand

    return list(braceexpand.braceexpand(path))
