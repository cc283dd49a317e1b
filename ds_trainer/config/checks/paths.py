"""The files and folders a run reads: the images, the model's weights, the checkpoint to resume. Torch-free,
read-only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import (
    families,
    inputs,
    phases,
    schema,
    source_kinds,
    source_repeats,
    weights_file,
)
from ds_trainer.config.checks import reference
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
    out += _sources(cfg) + _captions(cfg)
    if not 0.0 <= float(cfg.data.max_bad_fraction) <= 1.0:
        out.append(Problem("data.max_bad_fraction", cfg.data.max_bad_fraction, "is the share of a "
                           "source's files that may be skipped as damaged",
                           "data.max_bad_fraction=0.05"))
    if int(cfg.data.max_image_pixels) <= 0:
        out.append(Problem("data.max_image_pixels", cfg.data.max_image_pixels, "is the pixel count "
                           "above which an image is skipped as too large",
                           f"data.max_image_pixels={inputs.PILLOW_PIXELS} (Pillow's own limit)"))
    pretrained = cfg.model.pretrained
    if weights_file.is_single_file(pretrained) and not Path(pretrained).exists():
        out.append(Problem("model.pretrained", pretrained, "no such checkpoint file",
                           "model.pretrained=/path/to/sd_xl_base_1.0.safetensors"))
    elif pretrained and not Path(pretrained).exists() and not re.fullmatch(r"[\w.-]+/[\w.-]+", pretrained):
        out.append(Problem("model.pretrained", pretrained, "is neither a local folder nor a hub id (org/name)",
                           "model.pretrained=/path/to/diffusers/folder (or stabilityai/stable-diffusion-xl-base-1.0)"))
    out += weights_file.problems(cfg) + _init_from(cfg) + _cache_dir(cfg)
    resume = cfg.resume
    if resume not in (None, "latest") and not Path(resume).is_dir():
        out.append(Problem("resume", resume, "is neither `latest` nor a checkpoint folder",
                           "resume=latest (or resume=<run dir>/checkpoints/step_N)"))
    elif resume not in (None, "latest") and (phased := phases.of(cfg)):
        if phases.located(phased, Path(resume)) is None:
            folders = ", ".join(p.folder for p in phased)
            out.append(Problem("resume", resume, f"model={cfg.model.name} trains in phases, "
                               f"each in a folder of its run's ({folders}): this checkpoint "
                               "is in none", f"resume=<run>/{phased[-1].folder}/checkpoints/"
                               "step_N (the phase it continues; those before it carry on from "
                               "that run's), or resume=latest"))
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
                for shard in source_kinds.paths_of(str(source.path), str(getattr(source.kind, "value", source.kind)))
                if not Path(shard).exists()]
        if float(source.repeats) <= 0:
            out.append(Problem(f"{key}.repeats", source.repeats, "must be above 0 (the times an epoch each of its "
                               "images is seen; 0.5: every other epoch)", f"{key}.repeats=1, or remove the source"))
        if float(source.loss_weight) < 0:
            out.append(Problem(f"{key}.loss_weight", source.loss_weight, "weighs its samples' loss: 0 or more",
                               f"{key}.loss_weight=1.0"))
        for name in ("caption_dropout", "tag_dropout"):
            value = source[name]
            if value is not None and not 0.0 <= float(value) <= 1.0:
                out.append(Problem(f"{key}.{name}", value, "is a probability", f"{key}.{name}=0.1"))
        if source.keep_tokens is not None and int(source.keep_tokens) < 0:
            out.append(Problem(f"{key}.keep_tokens", source.keep_tokens, "is a count of leading tags kept in place",
                               f"{key}.keep_tokens=1"))
    for index, source in enumerate(cfg.data.sources):
        value = float(source.repeats)
        near = source_repeats.fraction(value)
        if value > 0 and abs(float(near) - value) > 0.002 * value:  # 0.333 is 1/3; 0.37 is no fraction
            most = source_repeats.MAX_PASSES
            out.append(Problem(f"data.sources[{index}].repeats", source.repeats, "a fraction of repeats is seen over "
                               f"an epoch of whole passes, at most {most}: a fraction of denominator up to {most}",
                               f"data.sources[{index}].repeats={float(near):.3g}"))
    repeats = [float(s.repeats) for s in cfg.data.sources if float(s.repeats) > 0]
    if repeats and (passes := source_repeats.epoch_passes(repeats)) > source_repeats.MAX_PASSES:
        out.append(Problem("data.sources", ", ".join(f"repeats {r:g}" for r in repeats), f"take {passes} passes to see "
                           f"every source a whole number of times (an epoch); at most {source_repeats.MAX_PASSES}",
                           "fractions with one denominator (0.5 and 0.25, or 1/3 as 0.333 and 2/3 as 0.667)"))
    names = [str(s.name) for s in cfg.data.sources if s.name is not None]
    if len(set(names)) != len(names):
        out.append(Problem("data.sources", ", ".join(names), "two sources have the same name: the log, summary.json "
                           "and the cache tell sources apart by it", "give each source a name of its own"))
    return out


def _captions(cfg: DictConfig) -> list[Problem]:
    """The tag policy's values, and data.text_encoder_dropout's names: the model's text encoders, all frozen."""
    data, out = cfg.data, []
    if not 0.0 <= float(data.tag_dropout) <= 1.0:
        out.append(Problem("data.tag_dropout", data.tag_dropout, "is a probability (of each tag's dropping)",
                           "data.tag_dropout=0.1"))
    if int(data.keep_tokens) < 0:
        out.append(Problem("data.keep_tokens", data.keep_tokens, "is a count of leading tags kept in place",
                           "data.keep_tokens=1"))
    if not str(data.tag_separator):
        out.append(Problem("data.tag_separator", "''", "splits a caption into tags", "data.tag_separator=','"))
    if source_repeats.tags_vary(cfg) and data.source.value == "synthetic":
        out.append(Problem("data.tag_shuffle" if data.tag_shuffle else "data.tag_dropout",
                           data.tag_shuffle or data.tag_dropout, "synthetic captions are sentences, not tags",
                           "data=folder or data=sources with tag captions"))
    spec = families.of(cfg)
    family, names = spec.name, spec.text_encoders
    asked = {name: value for name, value in data.text_encoder_dropout.items() if float(value) != 0.0}
    for name, value in asked.items():
        key = f"data.text_encoder_dropout.{name}"
        if names == (name,):
            out.append(Problem(key, value, f"drops one text encoder's output while the others still carry the "
                               f"caption; {family} has this one encoder alone",
                               f"{key}=0" + ("" if reference.captions_fixed(cfg) else
                                             f" data.caption_dropout={value} (the caption dropped: the empty "
                                             "prompt's encoding, as the sampler's unconditional)")))
        elif name not in names:
            out.append(Problem(key, value, f"{cfg.model.name} has no {name} text encoder ({family}'s: "
                               f"{', '.join(names)})", f"{key}=0, or data.text_encoder_dropout.{names[-1]}={value}"))
        elif not 0.0 <= float(value) <= 1.0:
            out.append(Problem(key, value, "is a probability", f"{key}=0.1"))
    if asked and schema.trains_text_encoders(cfg):
        out.append(Problem(f"data.text_encoder_dropout.{next(iter(asked))}", next(iter(asked.values())),
                           "zeroes a frozen encoder's cached output; with text_encoders trained a batch carries token "
                           "ids instead", "text_encoders=frozen, or data.caption_dropout (drops whole captions)"))
    return out


def _init_from(cfg: DictConfig) -> list[Problem]:
    """`adapter.init_from`: a LoRA file ds_trainer or kohya's scripts wrote (safetensors, its header
    whole), or a run's lora/ folder holding one; whether it fits the adapter needs the model
    (`train.adapter.inspect`)."""
    given = cfg.adapter.get("init_from")
    if given is None or cfg.adapter.method.value == "none" or not Path(given).exists():
        return []  # a missing one: checks/adapter.py
    path = Path(given)
    fix = "adapter.init_from=<run>/lora/pytorch_lora_weights.safetensors (or null)"
    if path.is_dir():
        files = [path / name for name in ("pytorch_lora_weights.safetensors", "kohya.safetensors")]
        path = next((f for f in files if f.is_file()), path)
        if path.is_dir():
            return [Problem("adapter.init_from", given, "is a folder without a LoRA file "
                            "(pytorch_lora_weights.safetensors or kohya.safetensors)", fix)]
    if path.suffix.lower() != ".safetensors":
        return [Problem("adapter.init_from", given, "is read as a .safetensors file (a .bin, "
                        ".pt or .ckpt is a pickle, which can run code when it is read)", fix)]
    why = weights_file.unreadable(path)
    return [Problem("adapter.init_from", str(path), f"cannot be read: {why}", fix)] if why else []


def _cache_dir(cfg: DictConfig) -> list[Problem]:
    """The latent cache is written into `data.cache_dir`: it, or the folder it would be made in,
    must be writable (a read-only disk failed the run after a minute of start-up)."""
    if not cfg.data.cache or cfg.get("dry_run"):
        return []
    where = Path(str(cfg.data.cache_dir)).absolute()
    existing = next((p for p in (where, *where.parents) if p.exists()), None)
    if existing is None or (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
        return []
    why = "is a file, not a folder" if not existing.is_dir() else "cannot be written here"
    return [Problem("data.cache_dir", str(cfg.data.cache_dir), f"{existing} {why} (the latent "
                    "cache is written there)", "data.cache_dir=<a writable folder>, or "
                    "data.cache=false")]
