"""The chain of runs a model family's test module shares (tests/test_chroma.py, test_z_image.py, ...), as
test_transformers' and test_video's chains: a full fine-tune under ZeRO-3 on two ranks (samples, export,
validation, a checkpoint half way) is the reference that DDP on one rank (with EMA and samples) and FSDP2 on two
resume from its portable state; a LoRA trains under FSDP2 on two ranks. Tiny sizes: 64 px, 8 steps, two images.

What the checks compare: the sample with the exported pipeline's image for the same seed (computed in a fresh
process, tests/scripts/sample_reference.py), a resume's losses and weights with the reference's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from helpers import numerics
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun

PROMPT = "a red square on a blue background"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # exact pixel comparisons: the same kernels in the run and the reference
COMMON = ["logger=none", "data.num_samples=2", "scheduler=constant", "optimizer.lr=3e-3", "resolution.width=64",
          "resolution.height=64", "train.max_steps=8", "train.checkpoint_every=4", "validation=on",
          "validation.every=4"]
SAMPLES = ["samples=on", "samples.every=0", "samples.steps=2", f"samples.prompts=[{PROMPT}]"]
RESUMED = ("ddp_resumed", "fsdp_resumed")
RUNS = {
    "zero3_x2": (2, ["zero=stage3", "train.micro_batch_size=1", "train.export=true", *SAMPLES]),
    # With the EMA sampled at the end: the exported pipeline on transformer_ema gives the same image
    "ddp_resumed": (1, ["zero=ddp", "train.micro_batch_size=2", "train.ema=true", "train.export=true", *SAMPLES]),
    "fsdp_resumed": (2, ["zero=fsdp_full_shard", "train.micro_batch_size=1"]),
    "lora_fsdp_x2": (2, ["zero=fsdp_full_shard", "adapter=lora", "train.micro_batch_size=1", "optimizer.lr=5e-3",
                         "train.export=true", "validation=none"]),
}


def train(cwd: Path, ranks: int, *overrides: str) -> Path:
    """One run of `ds_trainer` on `ranks` ranks from `cwd` (one thread each), its run folder."""
    cwd.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        result = run_cli(*COMMON, *overrides, cwd=cwd, env=ONE_THREAD, timeout=900)
    else:
        result = subprocess.run([*torchrun(ranks), "-m", "ds_trainer", *COMMON, *overrides], cwd=cwd,
                                env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir


def runs(root: Path, model: str, *extra: str, per_run: dict[str, list[str]] | None = None) -> Callable[[str], Path]:
    """The chain's runs of `model` by name (RUNS), each trained the first time a test asks for it; `extra`
    overrides go to every run (an editing model's samples.images), `per_run`'s to the run it names (last)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            ranks, overrides = RUNS[name]
            if name in RESUMED:
                overrides = [*overrides, f"resume={get('zero3_x2') / 'checkpoints' / 'step_00000004'}"]
            more = (per_run or {}).get(name, [])
            done[name] = train(root / name, ranks, f"model={model}", *extra, *overrides, *more)
        return done[name]
    return get


def losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def validation(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}


def weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(folder / "diffusion_pytorch_model.safetensors")


def reference_image(run_dir: Path, bf16: bool, max_sequence_length: int, reference: Path | None = None) -> Any:
    """The exported pipeline's 64 x 64 image of PROMPT, seed 0 (its transformer in bf16 as DeepSpeed trained it,
    or as saved), one thread, the sampler's call; an editing model's from `reference`."""
    out = run_dir / "reference.npy"
    script = Path(__file__).parents[1] / "scripts" / "sample_reference.py"
    cmd = [sys.executable, str(script), str(run_dir / "pipeline"), PROMPT, "0", str(out), "--size", "64x64",
           *(["--bf16-unet"] if bf16 else []), "--max-sequence-length", str(max_sequence_length),
           *(["--reference", str(reference)] if reference else [])]
    result = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


def assert_sample_is_the_pipelines(run_dir: Path, bf16: bool, max_sequence_length: int,
                                   reference: Path | None = None) -> None:
    """The run's last sample is the exported pipeline's image for the same seed."""
    steps = json.loads((run_dir / "summary.json").read_text())["steps"]
    got = np.asarray(Image.open(run_dir / "samples" / f"step_{steps:08d}" / "0_0.png").convert("RGB"))
    expected = reference_image(run_dir, bf16, max_sequence_length, reference)
    assert got.shape == (64, 64, 3) and got.std() > 1
    numerics.assert_same_image(got, expected, f"{run_dir.parent.parent.name}'s sample against the exported pipeline's")


def assert_resumed_within_noise(reference: Path, run_dir: Path, rel: float = 2e-2) -> None:
    """A resume from the reference's step 4 trains steps 5-8 to its losses within bf16 compute noise, and its
    weights end nearer the reference's than either is to where step 4 left them."""
    from safetensors.torch import load_file

    got, expected = losses(run_dir), losses(reference)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=rel), step
    start = {}  # the fp32 masters at step 4, where the resumed runs started
    for shard in sorted((reference / "checkpoints" / "step_00000004" / "portable").glob("state-*.safetensors")):
        start.update({k.removeprefix("fp32/"): v for k, v in load_file(shard).items() if k.startswith("fp32/")})
    final, trained = ({k: w[k] for k in start} for w in (weights(run_dir / "transformer"),
                                                         weights(reference / "transformer")))
    moved = numerics.mean_abs_difference(trained, start)
    assert numerics.mean_abs_difference(final, trained) < 0.25 * moved


def assert_resumed(runs: Callable[[str], Path], layout: str, max_sequence_length: int) -> None:
    """A chain's `layout` run (chain.RESUMED) resumed from the ZeRO-3 run within noise; the DDP one sampled
    with the EMA, and the exported pipeline (on transformer_ema) makes that sample."""
    run_dir = runs(layout)
    assert_resumed_within_noise(runs("zero3_x2"), run_dir)
    if layout == "ddp_resumed":
        assert_sample_is_the_pipelines(run_dir, bf16=False, max_sequence_length=max_sequence_length)


def assert_zero3_run(run_dir: Path, model: str, pipeline: str, cached: dict[str, tuple[int, ...]]) -> Any:
    """The chain's two-rank ZeRO-3 run: it ended ok, validated at steps 4 and 8 (lower at 8), cached bf16
    captions and the latents of the shapes `cached` (its first item, returned), and exported a `pipeline`
    holding the exported transformer."""
    import torch

    from ds_trainer.train.data import cache as latent_cache

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    vals = validation(run_dir)
    assert sorted(vals) == [4, 8] and vals[8] < vals[4]
    folders = sorted((run_dir.parents[2] / "cache").glob(f"{model}-*"))
    assert len(folders) == 2  # training's and validation's
    item = latent_cache.read(folders[0])["00000000"]
    assert {k: tuple(item[k].shape) for k in cached} == cached
    assert item["prompt_embeds"].dtype == torch.bfloat16
    index = json.loads((run_dir / "pipeline" / "model_index.json").read_text())
    assert index["_class_name"] == pipeline
    exported = weights(run_dir / "transformer")
    assert numerics.mean_abs_difference(exported, weights(run_dir / "pipeline" / "transformer")) == 0
    return item


def comfy_merge(weights: dict[str, Any], kohya: dict[str, Any]) -> dict[str, Any]:
    """ComfyUI's reading of a LoRA on a model file in its makers' layout (comfy/lora.py `model_lora_keys_unet`:
    `lora_unet_<the file's key with _ for .>`; comfy/weight_adapter/lora.py: W + alpha / rank * up @ down)."""
    out = {k: v.clone() for k, v in weights.items()}
    names = {"lora_unet_" + k[:-len(".weight")].replace(".", "_"): k for k in weights if k.endswith(".weight")}
    heads = {k.removesuffix(".lora_down.weight") for k in kohya if k.endswith(".lora_down.weight")}
    assert heads and heads <= set(names), sorted(heads - set(names))[:3]
    for head in heads:
        down, up = kohya[head + ".lora_down.weight"].float(), kohya[head + ".lora_up.weight"].float()
        key = names[head]
        delta = float(kohya[head + ".alpha"]) / down.shape[0] * (up.flatten(1) @ down.flatten(1))
        out[key] = out[key] + delta.reshape(out[key].shape)
    return out
