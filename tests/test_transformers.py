"""The diffusion transformers: SD3 (`model=sd3_tiny`, the sd3 family), Flux.1 (`model=flux_tiny`) and Qwen-Image
(`model=qwen_image_tiny`). Flow matching checked against its formulas, then for each model one chain of runs that
shares the work. A full fine-tune on two ranks under ZeRO-3 (bf16, 60 steps on two images, samples and export at the
end, validation, a checkpoint at step 30) is the reference; DDP on one rank (SD3, Qwen-Image) and FSDP full shard on
two (Qwen-Image; Flux's and SD3's in `make test-long`, as Flux's DDP) resume its step 30 checkpoint (its portable
state) and train the same 30 steps; LoRA trains under ZeRO-2 and its file loads into the family's diffusers pipeline
(StableDiffusion3Pipeline, FluxPipeline, QwenImagePipeline), SD3's on a transformer read from a single file in
Stability's layout (`model.transformer`, whose wrong files are named). A kill -9 mid-save resumes to the
uninterrupted run's transformer and EMA bit for bit (Flux under ZeRO-3 with CPU offload; SD3 under ZeRO-2 mid-step
and Flux under FSDP in `make test-long`). SDXL's tests run through the same family layer (families/sdxl.py)
unchanged."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import numerics, pipelines
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.deps import require
from helpers.procs import kill_9_at
from helpers.ranks import train
from PIL import Image

from ds_trainer.config import nvme

torch = pytest.importorskip("torch")

PROMPT = "a red square on a blue background"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # exact pixel comparisons: the same kernels in the run and the reference
MODELS = ["sd3_tiny", "flux_tiny", "qwen_image_tiny", "flux_kontext_tiny", "qwen_image_edit_tiny"]
EDITING = ("flux_kontext_tiny", "qwen_image_edit_tiny")  # their samples and pipelines take a reference image
COMMON = ["logger=none", "data.num_samples=2", "scheduler=constant", "optimizer.lr=3e-3",
          "train.max_steps=60", "train.checkpoint_every=30", "validation=on", "validation.every=30"]
REFERENCE = ["zero=stage3", "train.micro_batch_size=1", "train.export=true", "samples=on", "samples.every=0",
             "samples.steps=2", f"samples.prompts=[{PROMPT}]"]


RESUMED = ("ddp", "fsdp_x2")


def _train(cwd: Path, ranks: int, *overrides: str) -> Path:
    return train(cwd, ranks, *COMMON, *overrides)


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path]) -> Callable[[str, str], Path]:
    """The chains' runs by model and name, each trained the first time a test asks for it."""
    root, done = module_tmp("transformers"), {}

    def get(model: str, name: str) -> Path:
        if (model, name) not in done:
            resume = f"resume={get(model, 'zero3_x2') / 'checkpoints' / 'step_00000030'}" if name in RESUMED else ""
            ranks, overrides = {
                "zero3_x2": (2, REFERENCE),
                # With the EMA sampled at the end: SD3's transformer holds a buffer the EMA does not (issue 44).
                "ddp": (1, ["zero=ddp", "train.micro_batch_size=2", "train.ema=true", *REFERENCE[3:], resume]),
                "fsdp_x2": (2, ["zero=fsdp_full_shard", "train.micro_batch_size=1", resume]),
                "lora": (1, ["zero=stage2", "adapter=lora", "train.micro_batch_size=2", "optimizer.lr=5e-3",
                             "train.max_steps=60", "train.export=true", "validation=none"]),
            }[name]
            if model in EDITING:  # an editing model: its samples' reference image
                overrides = [*overrides, f"samples.images=[{_reference_png(root)}]"]
            if (model, name) == ("sd3_tiny", "lora"):  # SD3's LoRA trains on a transformer read from a single file
                overrides = [*overrides, f"model.transformer={_single_file(root, SINGLE_FILE_SEED)}"]
            done[model, name] = _train(root / model / name, ranks, f"model={model}", *overrides)
        return done[model, name]
    return get


SINGLE_FILE_SEED = 7  # not the runs' seed: a run that ignored the file would train other weights


def _transformer(model: str, seed: int, **config: object) -> torch.nn.Module:
    """The tiny model's transformer as diffusers builds it from `seed` (with `config` changed)."""
    from ds_trainer.train import families

    if not config:
        cfg = make_cfg(f"model={model}", f"train.seed={seed}")
        return families.of(cfg).load_trained(cfg)
    module = families.of(make_cfg(f"model={model}")).meta_trained(make_cfg(f"model={model}"))
    torch.manual_seed(seed)
    return type(module).from_config({**module.config, **config})


def _single_file(root: Path, seed: int, model: str = "sd3_tiny", name: str = "", **config: object) -> Path:
    """`model`'s transformer (from `seed`, `config` changed) written in its makers' layout
    (the export's own code, train/export/single_file.py)."""
    from safetensors.torch import save_file

    from ds_trainer.train.export import single_file

    module = _transformer(model, seed, **config)
    state = single_file.denoiser_tensors(model.removesuffix("_tiny"), module)
    path = root / f"{name or model}_{seed}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "diffusion_pytorch_model.safetensors")


def _falls(losses: dict[int, float]) -> tuple[float, float]:
    values = [losses[s] for s in sorted(losses)]
    return sum(values[:10]) / 10, sum(values[-10:]) / 10


# --- flow matching, against the formulas (SD3 paper; diffusers' training_utils and FlowMatchEulerDiscreteScheduler)

def test_the_noise_levels_are_sd3s_shifted_table_and_the_samplers() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ds_trainer.train.families import flow

    schedule = flow.Schedule.of(make_cfg("model=sd3_tiny"))
    for i in (0, 1, 250, 500, 999):
        s = (1000 - i) / 1000
        assert schedule.sigmas[i].item() == pytest.approx(3 * s / (1 + 2 * s), abs=1e-7)  # shift 3
    # The scheduler the exported pipeline samples with holds the same table (its timesteps are sigma * 1000, what
    # the transformer is given in training).
    sampler = FlowMatchEulerDiscreteScheduler.from_pretrained(make_cfg("model=sd3_tiny").model.architecture,
                                                              subfolder="scheduler")
    assert torch.allclose(schedule.sigmas, sampler.sigmas[:1000].float(), atol=1e-6)
    assert torch.allclose(schedule.sigmas * 1000, sampler.timesteps[:1000].float(), atol=1e-3)
    x0, noise = torch.full((1, 2, 2, 2), 2.0), torch.full((1, 2, 2, 2), -1.0)
    assert torch.equal(flow.noisy(x0, noise, torch.tensor([0.25])), torch.full((1, 2, 2, 2), 0.75 * 2 - 0.25))
    assert torch.equal(flow.target(x0, noise), torch.full((1, 2, 2, 2), -3.0))  # noise - x0
    sigma = torch.tensor([0.5, 0.25])
    assert torch.allclose(flow.loss_weights("sigma_sqrt", sigma), torch.tensor([4.0, 16.0]))
    assert torch.allclose(flow.loss_weights("cosmap", sigma), 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2)))
    assert torch.equal(flow.loss_weights("none", sigma), torch.ones(2))


@pytest.mark.parametrize("density", ["logit_normal", "mode", "uniform"])
def test_timestep_densities_follow_their_formulas(density: str) -> None:
    from ds_trainer.train.families import flow

    cfg = make_cfg("model=sd3_tiny", f"model.flow.density={density}", "model.flow.shift=1.0")
    schedule = flow.Schedule.of(cfg)
    n = 4000
    index = schedule.draw([torch.Generator().manual_seed(k) for k in range(n)])
    u = index.double() / 1000  # the table's place: u in [0, 1), 1/1000 resolution
    # The probability that u < q, from the density's formula alone (for mode: the share of a fine uniform grid of v
    # that the map sends below q; for logit_normal: Phi(logit q)).
    for q in (0.1, 0.3, 0.5, 0.8):
        if density == "logit_normal":
            expected = 0.5 * (1 + math.erf(math.log(q / (1 - q)) / math.sqrt(2)))
        elif density == "mode":
            v = torch.linspace(0, 1, 200_001, dtype=torch.float64)
            mapped = 1 - v - 1.29 * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
            expected = float((mapped < q).double().mean())
        else:
            expected = q
        got = float((u < q).double().mean())
        assert abs(got - expected) < 4 * math.sqrt(expected * (1 - expected) / n) + 1e-3, (q, got, expected)
    # Each sample's level comes from its own generator: the same sample draws the same level in any batch.
    again = schedule.draw([torch.Generator().manual_seed(k) for k in (7, 3)])
    assert again.tolist() == [index[7].item(), index[3].item()]


def test_fluxs_shift_follows_the_image_and_packing_is_the_pipelines() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from ds_trainer.train.families import flow, flux

    assert flow.mu(256) == pytest.approx(0.5) and flow.mu(4096) == pytest.approx(1.15)  # Flux's two anchors
    schedule = flow.Schedule.of(make_cfg("model=flux_tiny"))
    index = torch.tensor([0, 300, 500, 900, 999])
    s = (1000 - index.double()) / 1000  # unshifted (model.flow.shift=1.0)
    for tokens in (64, 1024, 4096):
        m = 0.5 + (tokens - 256) * 0.65 / 3840
        expected = math.exp(m) / (math.exp(m) + 1 / s - 1)
        assert torch.allclose(schedule.sigma(index, tokens).double(), expected, atol=1e-6)
        # What the exported scheduler does to the same levels when the pipeline samples an image of `tokens` tokens.
        sampler = FlowMatchEulerDiscreteScheduler.from_pretrained(make_cfg("model=flux_tiny").model.architecture,
                                                                  subfolder="scheduler")
        assert torch.allclose(schedule.sigma(index, tokens).double(), sampler.time_shift(m, 1.0, s), atol=1e-6)
    latents = torch.randn(2, 4, 8, 6)
    assert torch.equal(flux.pack(latents), FluxPipeline._pack_latents(latents, 2, 4, 8, 6))
    assert torch.equal(flux.image_ids(8, 6), FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32))


def test_qwen_images_captions_shift_and_latents_are_its_pipelines() -> None:
    """Qwen-Image's encoding, against QwenImagePipeline's own on the tiny model: the chat template and the tokens it
    drops (the tiny tokenizer makes the system prefix 34 tokens, as Qwen's does), each caption's hidden states and
    mask (the pipeline's trimmed to the longest caption, the cache's padded to text_max_length), the shift line of
    its scheduler (not Flux's), and latents normalised as the pipeline decodes them."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from ds_trainer.train.families import of, qwen_image

    cfg = make_cfg("model=qwen_image_tiny")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    pipe = QwenImagePipeline(scheduler=None, vae=frozen.vae, text_encoder=frozen.text_encoder,
                             tokenizer=frozen.tokenizer, transformer=None)
    assert (qwen_image.TEMPLATE, qwen_image.DROP) == (pipe.prompt_template_encode,
                                                     pipe.prompt_template_encode_start_idx)
    prefix = qwen_image.TEMPLATE.split("{}")[0]
    assert len(frozen.tokenizer(prefix).input_ids) == qwen_image.DROP
    prompts = ["a red cube", "a small green circle on a dark background at night"]
    ours = family.text_inputs(frozen, prompts, torch.device("cpu"))
    theirs, mask = pipe.encode_prompt(prompts, device=torch.device("cpu"), max_sequence_length=32)
    length = theirs.shape[1]
    assert ours["prompt_embeds"].shape == (2, 32, 32) and 8 <= length < 32
    assert torch.equal(ours["prompt_mask"][:, :length], mask) and not ours["prompt_mask"][:, length:].any()
    assert torch.allclose(ours["prompt_embeds"][:, :length], theirs, atol=1e-6)
    assert not ours["prompt_embeds"][:, length:].any()
    # The noise levels shift on the scheduler's line: mu 0.5 at 256 tokens to 0.9 at 8192
    schedule = family.schedule(cfg)
    sampler = FlowMatchEulerDiscreteScheduler.from_pretrained(cfg.model.architecture, subfolder="scheduler")
    index = torch.tensor([0, 300, 500, 900, 999])
    s = (1000 - index.double()) / 1000
    for tokens in (64, 1024, 4096):
        m = 0.5 + (tokens - 256) * 0.4 / (8192 - 256)
        assert torch.allclose(schedule.sigma(index, tokens).double(), sampler.time_shift(m, 1.0, s), atol=1e-6)
    # Latents: the pipeline decodes latents * std + mean
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    latents = family.encode_images(frozen, pixels)
    raw = frozen.vae.encode(pixels[:, :, None]).latent_dist.mean[:, :, 0]
    std = torch.tensor(frozen.vae.config.latents_std).view(1, -1, 1, 1)
    mean = torch.tensor(frozen.vae.config.latents_mean).view(1, -1, 1, 1)
    assert latents.shape == (1, 4, 4, 4) and torch.allclose(latents * std + mean, raw, atol=1e-5)


def test_qwen_image_edits_captions_are_its_pipelines_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen-Image-Edit's encoding, against QwenImageEditPipeline's own with transformers' Qwen2VLProcessor (built
    here beside no video processor: transformers' check of that part needs torchvision): its template and dropped
    prefix, the processor's inputs (the reference's `<|image_pad|>` once per merged patch), each caption's hidden
    states with the reference's vision tokens and the mask, padded to those tokens, 2 and text_max_length. The
    transformer sees the image's tokens, then the reference's (a second entry of img_shapes), and predicts the
    image's alone."""
    from diffusers import QwenImageEditPipeline
    from transformers import ProcessorMixin, Qwen2VLProcessor

    from ds_trainer.tools.plan import unet as plan_unet
    from ds_trainer.train.families import of, qwen_image

    cfg = make_cfg("model=qwen_image_edit_tiny")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda _self, _name, arg: type(arg))
    real = Qwen2VLProcessor(image_processor=frozen.processor.image_processor, tokenizer=frozen.tokenizer,
                            video_processor=None)
    pipe = QwenImageEditPipeline(scheduler=None, vae=frozen.vae, text_encoder=frozen.text_encoder,
                                 tokenizer=frozen.tokenizer, processor=real, transformer=None)
    assert (qwen_image.EDIT_TEMPLATE, qwen_image.EDIT_DROP) == (pipe.prompt_template_encode,
                                                               pipe.prompt_template_encode_start_idx)
    # the tiny tokenizer makes the system prefix 64 tokens, as Qwen's does: the caption's states are what is kept
    assert len(frozen.tokenizer(qwen_image.EDIT_TEMPLATE.split("<|vision_start|>")[0]).input_ids) == 64
    prompts = ["make the square red", "turn the small blue circle into a green cube at night"]
    references = torch.rand(2, 3, 64, 96) * 2 - 1
    pictures = qwen_image._pictures(references)
    texts = [qwen_image.EDIT_TEMPLATE.format(p) for p in prompts]
    ours_in, theirs_in = (p(text=texts, images=pictures, padding=True, return_tensors="pt")
                          for p in (frozen.processor, real))
    assert all(torch.equal(ours_in[k], theirs_in[k]) for k in ("input_ids", "attention_mask", "pixel_values",
                                                                "image_grid_thw"))
    ours = family.text_inputs(frozen, prompts, torch.device("cpu"), references)
    theirs, mask = pipe._get_qwen_prompt_embeds(prompts, pictures, torch.device("cpu"))
    seen = plan_unet.vision_tokens(str(cfg.model.architecture), 64, 96)  # the planner's count: 2 x 3 merged patches
    length = theirs.shape[1]
    assert seen == 6 and ours["prompt_embeds"].shape == (2, seen + 2 + 32, 32) and seen + 2 < length < seen + 34
    assert torch.equal(ours["prompt_mask"][:, :length], mask) and not ours["prompt_mask"][:, length:].any()
    assert torch.allclose(ours["prompt_embeds"][:, :length], theirs, atol=1e-6)
    # The transformer's call: the image's tokens and the reference's, its prediction the image's alone
    latents, reference = torch.randn(2, 4, 4, 6), torch.randn(2, 4, 6, 4)
    assert qwen_image.image_shapes(latents, reference) == [[(1, 2, 3), (1, 3, 2)]] * 2
    seen_by: dict[str, Any] = {}
    model = family.load_trained(cfg)
    model.register_forward_hook(lambda _m, _args, kwargs, out: seen_by.update(kwargs, out=out), with_kwargs=True)
    batch = {"latents": latents, "control_latents": reference, **ours}
    losses = family.losses(model, family.schedule(cfg), batch, torch.randn_like(latents), torch.tensor([10, 900]),
                           torch.device("cpu"), torch.float32)
    assert losses.shape == (2,) and seen_by["hidden_states"].shape == (2, 6 + 6, 16)
    assert seen_by["out"].sample.shape == (2, 12, 16) and seen_by["img_shapes"] == [[(1, 2, 3), (1, 3, 2)]] * 2


@pytest.mark.slow
def test_flux_schnell_trains_on_its_unshifted_levels_without_guidance(tmp_path: Path) -> None:
    """FLUX.1-schnell (flux_schnell_tiny: flux_tiny without the guidance input): its noise levels are the table's,
    whatever the image's size (its scheduler does not shift); a LoRA trains, samples without a guidance input and
    loads into FluxPipeline; the full model is dev's states without the guidance embedder."""
    from diffusers import FluxPipeline

    from ds_trainer.train.families import flow, of

    cfg = make_cfg("model=flux_schnell_tiny")
    schedule = of(cfg).schedule(cfg)
    index = torch.tensor([0, 300, 999])
    for tokens in (64, 4096):
        assert torch.equal(schedule.sigma(index, tokens), flow.table(1000, 1.0)[index])
    result = run_cli("model=flux_schnell_tiny", "adapter=lora", "logger=none", "data.num_samples=2",
                     "train.max_steps=4", "samples=on", "samples.every=0", "samples.steps=2",
                     f"samples.prompts=[{PROMPT}]", cwd=tmp_path, env=ONE_THREAD, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert list((run_dir / "samples").glob("step_*/*.png"))
    pipe = FluxPipeline.from_pretrained(run_dir / "pipeline")
    assert not pipe.transformer.config.guidance_embeds
    pipe.load_lora_weights(run_dir / "lora")
    dev, schnell = (make_cfg(f"model={m}").model.param_count for m in ("flux_dev", "flux_schnell"))
    assert 0 < dev - schnell < 0.002 * dev  # the guidance embedder alone


@pytest.mark.parametrize(("change", "says", "fix"), [
    (["data.text_encoder_dropout.qwen_vl=0.2"], "qwen_image has this one encoder alone", "data.caption_dropout=0.2"),
    (["model.flow.text_max_length=2048"], "at most 1024 tokens", "model.flow.text_max_length=512"),
    (["model.flow.guidance=3.5"], "has no guidance input", "model.flow.guidance=null"),
])
def test_what_qwen_image_cannot_take_is_refused_with_the_fix(change: list[str], says: str, fix: str) -> None:
    from ds_trainer.config import checks

    report = checks.check(make_cfg("model=qwen_image_tiny", *change))
    shown = report.render()
    assert not report.ok and says in shown and fix in shown, shown


# --- the chain


# What each model's cache holds per sample: T5's sequence (after CLIP's 77 states for SD3) in bf16 at T5's width,
# the pooled text (SD3: CLIP-L and CLIP-G joined; Flux: CLIP-L's), the latents (SD3: 16 channels; Flux: 4, packed
# into 16 per token in the step).
CACHED = {"sd3_tiny": {"prompt_embeds": (77 + 32, 64), "pooled": (64,), "latents": (16, 16, 16)},
          "flux_kontext_tiny": {"prompt_embeds": (32, 64), "pooled": (32,), "latents": (4, 16, 16),
                                "control_latents": (4, 16, 16)},
          "flux_tiny": {"prompt_embeds": (32, 64), "pooled": (32,), "latents": (4, 16, 16)},
          "qwen_image_tiny": {"prompt_embeds": (32, 32), "prompt_mask": (32,), "latents": (4, 16, 16)},
          # the reference's 5 x 5 merged patches of Qwen2.5-VL's vision tower (128 pixels: 140 in its 28-pixel ones),
          # their start and end, then the caption's 32
          "qwen_image_edit_tiny": {"prompt_embeds": (25 + 2 + 32, 32), "prompt_mask": (59,), "latents": (4, 16, 16),
                                   "control_latents": (4, 16, 16)}}
PIPELINES = {"sd3_tiny": "StableDiffusion3Pipeline", "flux_tiny": "FluxPipeline",
             "qwen_image_tiny": "QwenImagePipeline", "flux_kontext_tiny": "FluxKontextPipeline",
             "qwen_image_edit_tiny": "QwenImageEditPipeline"}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model", MODELS)
def test_trains_under_zero3_on_two_ranks_and_exports_a_pipeline_diffusers_loads(runs: Callable[[str, str], Path],
                                                                                 model: str) -> None:
    run_dir = runs(model, "zero3_x2")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    first, last = _falls(_losses(run_dir))
    assert last < 0.8 * first, (first, last)
    vals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [v["step"] for v in vals] == [30, 60] and vals[1]["val_loss"] < vals[0]["val_loss"]
    assert f"family: {model.split('_')[0]}" in (run_dir / "config.yaml").read_text()
    from ds_trainer.train.data import cache as latent_cache

    cached = [latent_cache.read(folder) for folder in (run_dir.parents[2] / "cache").glob(f"{model}-*")]
    assert len(cached) == 2  # training's and validation's
    for item in (samples["00000000"] for samples in cached):
        assert {key: tuple(item[key].shape) for key in CACHED[model]} == CACHED[model]
        assert item["prompt_embeds"].dtype == torch.bfloat16
    # The run says what the cache takes on disk (T5's long sequence makes it large at full size)
    said = re.search(r"cached latents and embeddings of 2 samples \(2 images\) in [\d.]+s: ([\d.]+) MiB on disk "
                     r"\((\d+) KiB an image; (?:T5|Qwen2\.5-VL)'s sequence in bf16\), (\S+)",
                     (run_dir / "ds_trainer.log").read_text())
    assert said, (run_dir / "ds_trainer.log").read_text()[-2000:]
    on_disk = sum(f.stat().st_size for f in Path(said.group(3)).glob("pack-*"))  # not the empty prompt's
    assert int(said.group(2)) == round(on_disk / 2 / 1024) and float(said.group(1)) == round(on_disk / 2**20, 1)
    # The planner sizes the attention by the text tokens the cache holds (SD3: CLIP's and T5's; Flux: T5's alone)
    from ds_trainer.tools.plan import unet as plan_unet

    assert plan_unet.text_tokens(make_cfg(f"model={model}")) == CACHED[model]["prompt_embeds"][0]
    # The last sample is the exported pipeline's image (bf16 weights, one thread, the same CPU generator): the
    # export is what trained, and the family's diffusers pipeline loads and generates it.
    expected = _reference_image(run_dir, bf16=True)
    got = np.asarray(Image.open(run_dir / "samples" / "step_00000060" / "0_0.png").convert("RGB"))
    assert got.shape == (128, 128, 3) and got.std() > 1 and (got == expected).all()
    model_index = json.loads((run_dir / "pipeline" / "model_index.json").read_text())
    assert model_index["_class_name"] == PIPELINES[model]
    assert numerics.mean_abs_difference(_weights(run_dir / "transformer"),
                                        _weights(run_dir / "pipeline" / "transformer")) == 0


def _reference_png(root: Path) -> Path:
    """An editing model's sample reference: a 96 x 128 picture (another shape than the samples', which the pipeline
    fits to the sample's size)."""
    path = root / "reference.png"
    if not path.exists():
        image = Image.new("RGB", (96, 128), (40, 80, 220))
        image.paste((220, 40, 40), (20, 30, 70, 90))
        image.save(path)
    return path


def _reference_image(run_dir: Path, bf16: bool) -> Any:
    """The exported pipeline's image of PROMPT, seed 0 (its transformer in bf16 as DeepSpeed trained it, or as saved),
    one thread, the sampler's CPU generator; an editing model's from the run's reference image."""
    out = run_dir / "reference.npy"
    script = Path(__file__).parent / "scripts" / "sample_reference.py"
    images = re.search(r"\n  images:\n  - (\S+)", (run_dir / "config.yaml").read_text())
    cmd = [sys.executable, str(script), str(run_dir / "pipeline"), PROMPT, "0", str(out),
           *(["--bf16-unet"] if bf16 else []), "--max-sequence-length", "32",
           *(["--reference", images.group(1)] if images else [])]
    result = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("model", "layout"), [
    ("sd3_tiny", "ddp"),
    ("qwen_image_tiny", "ddp"),
    ("qwen_image_tiny", "fsdp_x2"),
    ("flux_kontext_tiny", "ddp"),
    ("flux_kontext_tiny", "fsdp_x2"),
    ("qwen_image_edit_tiny", "ddp"),
    ("qwen_image_edit_tiny", "fsdp_x2"),
    # The other three pairs in `make test-long` (the CI budget; their figures are in the docstring).
    pytest.param("flux_tiny", "fsdp_x2", marks=pytest.mark.long),
    pytest.param("sd3_tiny", "fsdp_x2", marks=pytest.mark.long),
    pytest.param("flux_tiny", "ddp", marks=pytest.mark.long)])
def test_zero3_checkpoint_resumes_under_ddp_and_fsdp_within_noise(runs: Callable[[str, str], Path], model: str,
                                                                   layout: str) -> None:
    """ZeRO-3 on two ranks -> DDP on one (micro batch 2) or FSDP full shard on two: the same 30 steps from the
    portable state give the reference's losses and weights to bf16 compute noise. Measured for SD3: losses within
    0.02% (DDP) and 0.1% (FSDP) at every step, weights apart by 0.7% (DDP) and 6% (FSDP) of what the 30 steps moved
    them; a resume that lost the Adam state (resume_optimizer=reset) is 1.5% off in loss and 81% in weights. Flux:
    losses within 0.26% (DDP) and 0.33% (FSDP), weights apart by 1.3% and 1.4%; with the Adam state lost, 117% off
    in loss."""
    from safetensors.torch import load_file

    reference, run_dir = runs(model, "zero3_x2"), runs(model, layout)
    got, expected = _losses(run_dir), _losses(reference)
    assert sorted(got) == list(range(31, 61))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=7e-3), step
    start = {}  # the fp32 masters at step 30, where the resumed runs started
    for shard in sorted((reference / "checkpoints" / "step_00000030" / "portable").glob("state-*.safetensors")):
        start.update({k.removeprefix("fp32/"): v for k, v in load_file(shard).items() if k.startswith("fp32/")})
    # The trained parameters (SD3's export also holds its position embedding, a buffer)
    final, trained = ({k: w[k] for k in start} for w in (_weights(run_dir / "transformer"),
                                                         _weights(reference / "transformer")))
    moved = numerics.mean_abs_difference(trained, start)
    apart = numerics.mean_abs_difference(final, trained)
    assert apart < 0.25 * moved, (apart, moved)
    if layout == "ddp":  # it sampled with the EMA: the exported pipeline (on transformer_ema) gives the same image
        expected = _reference_image(run_dir, bf16=False)
        got = np.asarray(Image.open(run_dir / "samples" / "step_00000060" / "0_0.png").convert("RGB"))
        assert got.std() > 1
        numerics.assert_same_image(got, expected, f"{model}'s EMA sample against the exported pipeline's")


@pytest.mark.slow
@pytest.mark.multiproc
def test_qwen_images_single_file_is_its_transformer_and_its_frozen_tail_never_moves(
        runs: Callable[[str, str], Path]) -> None:
    """The exported single file (diffusers' names, as ComfyUI's Qwen-Image file) reads back through diffusers'
    from_single_file to the exported transformer; the last block's text-stream layers, which feed nothing, are the
    initial weights (in bf16, as ZeRO-3 held them) after 60 steps while the rest moved."""
    from diffusers import QwenImageTransformer2DModel

    run_dir = runs("qwen_image_tiny", "zero3_x2")
    exported = _weights(run_dir / "transformer")
    cfg = make_cfg("model=qwen_image_tiny")
    read = QwenImageTransformer2DModel.from_single_file(
        str(run_dir / "single_file" / "model.safetensors"), config=str(cfg.model.architecture),
        subfolder="transformer", local_files_only=True, torch_dtype=torch.float32).state_dict()
    assert set(read) == set(exported)
    assert max((read[k] - exported[k]).abs().max().item() for k in read) <= 1e-2  # the file is bf16 (export.dtype)
    initial = _transformer("qwen_image_tiny", int(cfg.train.seed)).state_dict()
    last = ("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.txt_mlp.")
    tail = [k for k in exported if k.startswith(last)]
    # ZeRO-3 holds a frozen parameter in bf16 alone (no fp32 master): the initial weights rounded once
    assert len(tail) == 6 and all(torch.equal(exported[k], initial[k].bfloat16().float()) for k in tail)
    moved = "transformer_blocks.1.attn.to_q.weight"
    assert not torch.equal(exported[moved], initial[moved])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_lora_trains_and_loads_with_load_lora_weights(runs: Callable[[str, str], Path], model: str) -> None:
    import diffusers
    from safetensors.torch import load_file

    run_dir = runs(model, "lora")
    first, last = _falls(_losses(run_dir))
    assert last < 0.9 * first, (first, last)
    lora = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    assert lora and all(k.startswith("transformer.") for k in lora)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())  # B starts at zero
    pipe = pipelines.load(run_dir / "pipeline")  # the untrained base
    assert type(pipe) is getattr(diffusers, PIPELINES[model])
    pipe.set_progress_bar_config(disable=True)
    if model == "sd3_tiny":  # its base is the single file's transformer: what was written, not the seed's own
        written = _transformer(model, SINGLE_FILE_SEED).state_dict()
        assert f"/sd3_tiny_{SINGLE_FILE_SEED}.safetensors" in (run_dir / "config.yaml").read_text()
        assert numerics.mean_abs_difference(pipe.transformer.state_dict(), written) == 0
    call = {"prompt": PROMPT, "num_inference_steps": 2, "height": 64, "width": 64, "max_sequence_length": 32,
            "output_type": "np", **({"image": Image.new("RGB", (64, 48), (40, 80, 220))}
                                    if model == "qwen_image_edit_tiny" else {})}
    base = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    pipe.load_lora_weights(run_dir / "lora")
    adapted = pipe(**call, generator=torch.Generator().manual_seed(0)).images[0]
    assert abs(adapted - base).max() > 1e-3  # every adapted module found its tensors, and they change the image


def test_a_transformer_reads_from_its_makers_single_file_and_other_files_are_named(tmp_path: Path) -> None:
    """`model.transformer=<file>`: SD3.5's transformer in Stability's layout loads to the weights it was written from
    (diffusers' single-file loader, configs from the repo, offline); a file of another family, depth, variant or
    format, or one diffusers cannot read for this model, is named before a run, with the fix."""
    from ds_trainer.config import checks
    from ds_trainer.train import families

    path = _single_file(tmp_path, 5)
    cfg = make_cfg("model=sd3_tiny", f"model.transformer={path}")
    assert not checks.check(cfg).problems
    loaded = families.of(cfg).load_trained(cfg)
    assert loaded.training and next(loaded.parameters()).dtype == torch.float32
    assert numerics.mean_abs_difference(loaded.state_dict(), _transformer("sd3_tiny", 5).state_dict()) == 0

    from safetensors.torch import save_file

    diffusers_format = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(_transformer("sd3_tiny", 5).state_dict(), diffusers_format)
    cases = {
        _single_file(tmp_path, 5, "flux_tiny"): "a Flux.1 transformer (Black Forest Labs' layout), not sd3's",
        _single_file(tmp_path, 5, name="deeper", num_layers=3): "3 joint_blocks, the architecture 2",
        _single_file(tmp_path, 5, name="sd3_medium", dual_attention_layers=[], qk_norm=None):
            "blocks none with a second attention",
        _single_file(tmp_path, 5, name="wider", num_attention_heads=8): "a transformer 64 wide, the architecture 32",
        diffusers_format: "a diffusers-format transformer",
        tmp_path / "missing.safetensors": "no such file",
        tmp_path / "sd3.ckpt": "one .safetensors file"}
    for file, why in cases.items():
        problems = checks.check(make_cfg("model=sd3_tiny", f"model.transformer={file}")).problems
        assert [p.key for p in problems] == ["model.transformer"] and why in problems[0].why, (file, problems)
        assert problems[0].fix.startswith("model.transformer=/path/to/sd3.5_medium.safetensors")
    (flux,) = checks.check(make_cfg("model=flux_tiny", f"model.transformer={path}")).problems
    assert "reads Flux.1's width (3072) only" in flux.why and flux.fix.startswith("model=flux_dev")
    (sdxl,) = checks.check(make_cfg(f"model.transformer={path}")).problems
    assert "model.pretrained=" in sdxl.fix
    # Qwen-Image's file (ComfyUI's, diffusers' names) reads back; one under a checkpoint's prefix, or Flux's, is named
    qwen = _single_file(tmp_path, 5, "qwen_image_tiny")
    cfg = make_cfg("model=qwen_image_tiny", f"model.transformer={qwen}")
    assert not checks.check(cfg).problems
    loaded = families.of(cfg).load_trained(cfg)
    assert numerics.mean_abs_difference(loaded.state_dict(), _transformer("qwen_image_tiny", 5).state_dict()) == 0
    prefixed = tmp_path / "qwen_checkpoint.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in
               _transformer("qwen_image_tiny", 5).state_dict().items()}, prefixed)
    for file, why in {prefixed: "a whole checkpoint's model.diffusion_model.* names",
                      _single_file(tmp_path, 5, "flux_tiny"): "a Flux.1 transformer (Black Forest Labs' layout)",
                      path: "an SD3/SD3.5 transformer (Stability's MMDiT layout), not qwen_image's"}.items():
        problems = checks.check(make_cfg("model=qwen_image_tiny", f"model.transformer={file}")).problems
        assert [p.key for p in problems] == ["model.transformer"] and why in problems[0].why, (file, problems)
        assert problems[0].fix.startswith("model.transformer=/path/to/qwen_image_bf16.safetensors")


@pytest.mark.long
def test_a_flux_transformer_at_flux1s_width_reads_from_black_forest_labs_layout(tmp_path: Path) -> None:
    """Flux.1's width (3072; one block of each kind, 530 M parameters in bf16): diffusers' loader, which splits the
    single-stream blocks at that width, gives the weights the file was written from, through model.transformer."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from ds_trainer.config import checks
    from ds_trainer.train import families
    from ds_trainer.train.export import single_file

    config = {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
              "num_attention_heads": 24, "joint_attention_dim": 64, "pooled_projection_dim": 32,
              "axes_dims_rope": [16, 56, 56], "guidance_embeds": True}
    torch.manual_seed(0)
    module = FluxTransformer2DModel(**config).to(torch.bfloat16)
    arch = tmp_path / "arch"
    shutil.copytree(make_cfg("model=flux_tiny").model.architecture, arch)
    module.save_config(arch / "transformer")
    path = tmp_path / "flux1.safetensors"
    save_file(single_file.denoiser_tensors("flux", module), path)
    cfg = make_cfg("model=flux_tiny", f"model.architecture={arch}", f"model.transformer={path}")
    assert not checks.check(cfg).problems
    loaded = families.of(cfg).load_trained(cfg)
    expected = {k: v.float() for k, v in module.state_dict().items()}
    assert numerics.mean_abs_difference(loaded.state_dict(), expected) == 0


def _kill_args(model: str, zero: str, offload: str) -> list[str]:
    return [f"model={model}", f"zero={zero}", f"offload={offload}", "logger=none", "train.max_steps=8",
            "train.checkpoint_every=1", "train.checkpoints_to_keep=2", "data.num_samples=8", "train.export=true",
            "train.ema=true"]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "zero", "offload", "moment"), [
    pytest.param("sd3_tiny", "stage3", "nvme", "save", marks=pytest.mark.nvme),
    pytest.param("flux_tiny", "stage3", "cpu", "save", marks=pytest.mark.long),
    pytest.param("sd3_tiny", "stage2", "none", "step", marks=pytest.mark.long),
    pytest.param("flux_tiny", "fsdp_full_shard", "cpu", "step", marks=pytest.mark.long)])
def test_kill_9_then_resume_gives_the_uninterrupted_transformer_and_ema_bit_for_bit(
        tmp_path: Path, model: str, zero: str, offload: str, moment: str) -> None:
    """As SDXL's (test_reliability): killed while step k trains or while its checkpoint is written, resumed from the
    newest complete checkpoint, the exported transformer and its EMA equal an uninterrupted run's, bit for bit. Under
    ZeRO-3 with NVMe offload DeepSpeed's own load lost Adam's moments (weights up to 1e-3 off after three steps);
    that resume loads the portable state (carry.py)."""
    if offload == "nvme":
        require(nvme.aio_load_error() is None, f"DeepSpeed's async_io op: {nvme.aio_load_error()}")
    args = _kill_args(model, zero, offload)
    reference = tmp_path / "reference"
    reference.mkdir()
    done = run_cli(*args, cwd=reference)
    assert done.returncode == 0, done.stderr[-3000:]
    work = tmp_path / "killed"
    work.mkdir()
    rng = random.Random(f"{model}{zero}{offload}{moment}")
    target = rng.randint(2, 6)
    proc = subprocess.Popen([sys.executable, "-m", "ds_trainer", *args], cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_9_at(proc, work, moment, target, rng, jitter=0.1)
    resumed = run_cli(*args, "resume=latest", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = run_dirs(work)
    complete = sorted(int(p.name[5:]) for p in (first / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    assert min(_losses(second)) == complete[-1] + 1  # from the newest complete checkpoint, never a partial one
    (expected_dir,) = run_dirs(reference)
    for folder in ("transformer", "transformer_ema"):
        got, expected = _weights(second / folder), _weights(expected_dir / folder)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{folder}/{key}"


@pytest.mark.parametrize("model", ["qwen_image_tiny", "qwen_image_edit_tiny"])
def test_qwen_vl_captions_are_encoded_without_the_lm_head(model: str) -> None:
    """Review 3's P7: a caption's states come from Qwen2.5-VL's model under its LM head, without a KV
    cache: identical to the full model's last hidden state, and no logits (152k wide on the real
    model, for every token) are computed."""
    from ds_trainer.train.families import of, qwen_image

    cfg = make_cfg(f"model={model}")
    family = of(cfg)
    frozen = family.load_frozen(cfg)
    prompts = ["a red cube", "a small green circle on a dark background at night"]
    references = torch.rand(2, 3, 64, 96) * 2 - 1 if family.reference else None
    heads: list[int] = []
    frozen.text_encoder.lm_head.register_forward_hook(lambda *_: heads.append(1))
    ours = family.text_inputs(frozen, prompts, torch.device("cpu"), references)
    assert heads == []
    if references is None:
        inputs = frozen.tokenizer([qwen_image.TEMPLATE.format(p) for p in prompts],
                                  max_length=32 + qwen_image.DROP, padding=True, truncation=True,
                                  return_tensors="pt")
    else:
        inputs = frozen.processor(text=[qwen_image.EDIT_TEMPLATE.format(p) for p in prompts],
                                  images=qwen_image._pictures(references), padding=True,
                                  return_tensors="pt")
    with torch.no_grad():
        full = frozen.text_encoder(**inputs, output_hidden_states=True).hidden_states[-1]
    assert heads == [1]  # the full model's call: its head ran
    kept = ours["prompt_mask"].bool()
    drop = qwen_image.EDIT_DROP if references is not None else qwen_image.DROP
    for i, keep in enumerate(inputs.attention_mask.bool()):
        theirs = full[i][keep][drop:drop + int(kept[i].sum())]
        assert torch.equal(ours["prompt_embeds"][i][kept[i]], theirs), i
