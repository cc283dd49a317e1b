"""The `validation` group before a run: which images are held out, which timesteps score them, when, and its
rules. Torch-free.

The held-out images are a function of the file names and `validation.split` alone (never of the ranks, the
batch size or the seed), so every layout of a sweep scores the same images and trains on the same others; the
schedule is a function of the step, so every rank validates at the same steps (under ZeRO-3 and FSDP the
forwards are collective).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import DictConfig

from ds_trainer.config.problems import Problem


def count(split: float, n: int) -> int:
    """How many of `n` images `validation.split` holds out: a fraction (< 1, at least one image) or a count."""
    return max(1, round(split * n)) if split < 1 else int(split)


def split_files(relative: list[str], split: float) -> tuple[list[str], list[str]]:
    """(trained, held out) of the relative image paths: the held-out ones are those whose path hashes lowest.
    A hash, not the sorted order, so that they spread over the folder's subfolders; the path alone, so that the
    same images are held out on every rank, in every run, and mostly the same after images are added."""
    held = set(sorted(relative, key=lambda rel: hashlib.sha256(rel.encode()).hexdigest())[:count(split, len(relative))])
    return [rel for rel in relative if rel not in held], [rel for rel in relative if rel in held]


def timesteps(cfg: DictConfig, num_train_timesteps: int) -> list[int]:
    """`validation.timesteps` evenly spaced timesteps, each in the middle of its share of [0, T)."""
    k = int(cfg.validation.timesteps)
    return [int((j + 0.5) * num_train_timesteps / k) for j in range(k)]


def due(cfg: DictConfig, step: int) -> bool:
    """Whether to validate after optimizer step `step` (step 0: before the first, with `at_start`)."""
    v = cfg.validation
    if not v.enabled:
        return False
    if step == 0:
        return bool(v.at_start)
    every = int(v.every)
    return (every > 0 and step % every == 0) or step == int(cfg.train.max_steps)


def problems(cfg: DictConfig) -> list[Problem]:
    """Everything wrong with `validation` that the configuration alone shows (nothing when it is off); a split
    that leaves no image to train on is found when the folder is read. `config.checks` asks it."""
    v = cfg.validation
    if not v.enabled:
        return []
    out: list[Problem] = []
    if v.every < 0:
        out.append(Problem("validation.every", v.every, "must be >= 0 (0 validates only at the end)",
                           "validation.every=100"))
    if v.timesteps < 1:
        out.append(Problem("validation.timesteps", v.timesteps, "needs at least one timestep to score the images at",
                           "validation.timesteps=4"))
    elif v.timesteps > 1000:
        out.append(Problem("validation.timesteps", v.timesteps,
                           "is more than the 1000 diffusion timesteps of the model", "validation.timesteps=4"))
    if v.batch_size < 0:
        out.append(Problem("validation.batch_size", v.batch_size, "must be >= 0 (0: train.micro_batch_size)",
                           "validation.batch_size=0"))
    if v.path is not None:
        if not Path(v.path).is_dir():
            out.append(Problem("validation.path", v.path, "is not a folder (validation scores the images in it)",
                               "validation.path=/path/to/validation/images, or leave it unset to hold out part of "
                               "data.path (validation.split)"))
        elif cfg.data.source.value == "folder" and cfg.data.path and Path(v.path).resolve() == Path(
                cfg.data.path).resolve():
            out.append(Problem("validation.path", v.path, "is the training folder: its images would be trained on "
                               "and scored, which measures memorising, not quality", "leave validation.path unset to "
                               "hold out validation.split of data.path, or name a folder of other images"))
        return out
    split = float(v.split)
    if not split > 0 or (split >= 1 and split != int(split)):
        out.append(Problem("validation.split", v.split, "must be a fraction of the images (0 < split < 1) or a whole "
                           "count of them (>= 1)", "validation.split=0.05, or validation.split=8"))
    elif cfg.data.source.value == "synthetic" and count(split, int(cfg.data.num_samples)) > 4096:
        out.append(Problem("validation.split", v.split, f"asks for {count(split, int(cfg.data.num_samples))} synthetic "
                           "validation images", "validation.split=8"))
    return out
