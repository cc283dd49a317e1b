"""Video: the Wan families (`model=wan_tiny`: 2.1 text to video; `wan21_i2v_tiny`: 2.1 image to video with CLIP;
`wan22_ti2v_tiny`: 2.2 TI2V's 48-channel VAE and clean first frame; `wan22_a14b_tiny`: 2.2's two experts) trained
from a folder of real video files this module writes with PyAV (H.264 in mp4 and mkv, VP9 in webm, MPEG-4 in mov;
several sizes, frame rates and lengths, one cut short, one image), as a user's data is.

One chain of runs shares the work. Text to video trains under ZeRO-3 on two ranks (full, samples, validation,
export) and is the reference that DDP on one rank and FSDP2 on two resume from its portable state; image to video
trains a LoRA under ZeRO-3 and fully under FSDP2, TI2V fully under ZeRO-3 and a LoRA under FSDP2. The checks ask
what a user would notice: the damaged and short files skipped and named, the clips in their frame buckets, the
loss falling, the sample clip equal to what the exported pipeline makes with the same seed, the LoRA files loading
into diffusers' Wan pipelines and the musubi/ComfyUI layout's names, a resume continuing within noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import numerics, pipelines
from helpers.cfg import make_cfg
from helpers.ranks import train
from PIL import Image, ImageDraw

torch = pytest.importorskip("torch")

PROMPT = "a red square moving right"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # exact comparisons: the same kernels in the run and the reference
COMMON = ["logger=none", "scheduler=constant", "optimizer.lr=3e-3", "resolution.width=64", "resolution.height=64",
          "data=folder", "data.buckets=false", "data.bucket_remainder=repeat", "data.max_bad_fraction=0.5",
          "data.video.frames=[1,5]", "train.micro_batch_size=1"]
SAMPLES = ["samples=on", "samples.every=0", "samples.steps=2", f"samples.prompts=[{PROMPT}]", "samples.frames=5"]
# Every linear layer of the blocks: the modules musubi-tuner's LoRA holds (its file's names are the original ones)
EVERY_LINEAR = "adapter.targets=[to_q,to_k,to_v,to_out.0,ffn.net.0.proj,ffn.net.2]"
EVERY_LINEAR_I2V = "adapter.targets=[to_q,to_k,to_v,to_out.0,add_k_proj,add_v_proj,ffn.net.0.proj,ffn.net.2]"


def _clip(frames: int, size: tuple[int, int], color: tuple[int, int, int]) -> list[Image.Image]:
    """A square of `color` moving right over a dark background."""
    out = []
    for k in range(frames):
        image = Image.new("RGB", size, (20, 20, 60))
        ImageDraw.Draw(image).rectangle([2 * k, size[1] // 4, 2 * k + size[0] // 3, size[1] // 2], fill=color)
        out.append(image)
    return out


def write_clips(root: Path) -> Path:
    """The folder: four clips of other codecs, sizes, rates and lengths, a clip cut short, an image; captions."""
    from ds_trainer.train.data import video

    root.mkdir(parents=True, exist_ok=True)
    video.write(root / "walk.mp4", _clip(30, (96, 64), (220, 40, 40)), 24)  # 20 frames at the model's 16 fps
    video.write(root / "spin.webm", _clip(14, (64, 96), (40, 180, 60)), 12, codec="libvpx-vp9")
    video.write(root / "pan.mov", _clip(9, (80, 64), (40, 80, 220)), 16, codec="mpeg4")
    video.write(root / "blink.mkv", _clip(3, (64, 64), (230, 210, 40)), 16)  # too short for 5: one frame only
    (root / "torn.mp4").write_bytes((root / "walk.mp4").read_bytes()[:700])  # cut short: not a video any more
    Image.new("RGB", (64, 64), (200, 200, 200)).save(root / "still.png")
    for name in ("walk", "spin", "pan", "blink", "torn", "still"):
        (root / f"{name}.txt").write_text(f"a {name} clip")
    return root


def _train(cwd: Path, ranks: int, *overrides: str) -> Path:
    return train(cwd, ranks, *COMMON, *overrides)


@pytest.fixture(scope="module")
def runs(module_tmp: Callable[[str], Path]) -> Callable[[str], Path]:
    """The chain's runs by name, each trained the first time a test asks for it."""
    root, done = module_tmp("video"), {}
    clips = write_clips(root / "clips")
    first = root / "first.png"
    Image.new("RGB", (64, 64), (20, 20, 60)).save(first)
    image = [f"samples.images=[{first}]"]

    def get(name: str) -> Path:
        if name not in done:
            data = f"data.path={clips}"
            resume = f"resume={get('t2v_zero3') / 'checkpoints' / 'step_00000004'}" if name.endswith("resumed") else ""
            # The same data in every run of the chain: validation holds the same file out of each
            t2v = ["model=wan_tiny", "train.max_steps=8", "validation=on", "validation.every=4"]
            ranks, overrides = {
                "t2v_zero3": (2, [*t2v, "zero=stage3", "train.checkpoint_every=4", *SAMPLES]),
                "t2v_ddp_resumed": (1, [*t2v, "zero=ddp", "train.micro_batch_size=2", resume]),
                "t2v_fsdp_resumed": (2, [*t2v, "zero=fsdp_full_shard", resume]),
                "t2v_lora_fsdp": (2, [*t2v, "zero=fsdp_full_shard", "adapter=lora", EVERY_LINEAR]),
                "i2v_lora_zero3": (2, ["model=wan21_i2v_tiny", "train.max_steps=4", "zero=stage3", "adapter=lora",
                                       EVERY_LINEAR_I2V, *SAMPLES, *image]),
                "i2v_fsdp": (2, ["model=wan21_i2v_tiny", "train.max_steps=4", "zero=fsdp_full_shard"]),
                "ti2v_zero3": (2, ["model=wan22_ti2v_tiny", "train.max_steps=4", "zero=stage3", *SAMPLES, *image]),
                "ti2v_lora_fsdp": (2, ["model=wan22_ti2v_tiny", "train.max_steps=4", "zero=fsdp_full_shard",
                                       "adapter=lora"]),
            }[name]
            done[name] = _train(root / name, ranks, data, *overrides)
        return done[name]
    return get


def _losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "diffusion_pytorch_model.safetensors")


def _frames(path: Path) -> np.ndarray:
    """A video file's frames (F, H, W, 3) as PyAV decodes them."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def _reference(run_dir: Path, image: Path | None = None) -> np.ndarray:
    """The exported pipeline's clip of PROMPT, seed 0, 5 frames at 64 x 64 (its transformer in bf16 as ZeRO-3 trained
    it), one thread, the sampler's call: computed in a fresh process (tests/scripts/sample_reference.py)."""
    out = run_dir / "reference.npy"
    script = Path(__file__).parent / "scripts" / "sample_reference.py"
    cmd = [sys.executable, str(script), str(run_dir / "pipeline"), PROMPT, "0", str(out), "--bf16-unet",
           "--max-sequence-length", str(make_cfg(f"model={_model(run_dir)}").model.flow.text_max_length),
           "--frames", "5", "--size", "64x64", *(["--reference", str(image)] if image else [])]
    result = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


def _model(run_dir: Path) -> str:
    import yaml

    return str(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["name"])


def _sample_is_the_pipelines(run_dir: Path, image: Path | None = None) -> None:
    """The sample clip (its frames in the grid, lossless) is the exported pipeline's for the same seed; its mp4 (H.264,
    lossy) holds those frames at the model's rate."""
    import av

    expected = _reference(run_dir, image)
    folder = run_dir / "samples" / f"step_{json.loads((run_dir / 'summary.json').read_text())['steps']:08d}"
    assert expected.shape == (5, 64, 64, 3) and expected.std() > 1
    grid = np.asarray(Image.open(folder / "grid.png").convert("RGB"))  # one row: the clip's five frames
    got = np.stack([grid[:, 64 * k:64 * (k + 1)] for k in range(5)])
    numerics.assert_same_image(got, expected, "the sample clip against the exported pipeline's")
    with av.open(str(folder / "0_0.mp4")) as container:
        rate = container.streams.video[0].average_rate
    encoded = _frames(folder / "0_0.mp4")
    assert encoded.shape == expected.shape
    assert float(rate) == make_cfg(f"model={_model(run_dir)}").model.video.fps  # Wan 2.1's 16 fps, TI2V's 24
    # H.264 at its default quality loses much of a tiny random model's noise, but the frames are these, in order
    off = [np.abs(encoded.astype(int) - frames.astype(int)).mean() for frames in (expected, expected[::-1])]
    assert off[0] < 0.8 * off[1], off


@pytest.mark.slow
@pytest.mark.multiproc
def test_text_to_video_trains_from_video_files_under_zero3_and_its_sample_is_the_exported_pipelines(
        runs: Callable[[str], Path]) -> None:
    run_dir = runs("t2v_zero3")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    (source,) = summary["sources"]
    assert source["skipped"] == {"not a video (unrecognized format)": 1}  # the file cut short, named
    assert source["skipped_files"]["not a video (unrecognized format)"] == ["torn.mp4"]
    log = (run_dir / "ds_trainer.log").read_text()
    # Of the five usable files validation holds one out (a one-frame one): four one-frame samples (the clips' and the
    # image's heads), three of five frames (blink.mkv is three frames long: it gives none)
    assert "bucket 64x64x1: 4 sample(s)" in log and "bucket 64x64x5: 3 sample(s)" in log
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 9)) and all(np.isfinite(list(losses.values())))
    vals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert [v["step"] for v in vals] == [4, 8] and vals[1]["val_loss"] < vals[0]["val_loss"]
    from ds_trainer.train.data import cache as latent_cache

    cached = [latent_cache.read(folder) for folder in (run_dir.parents[2] / "cache").glob("wan_tiny-*")]
    shapes = {tuple(item["latents"].shape) for packs in cached for item in packs.values()}
    assert shapes == {(16, 1, 8, 8), (16, 2, 8, 8)}  # 1 and 5 frames: 1 and 2 latent frames of 8 x 8
    assert (run_dir / "single_file" / "model.safetensors").is_file()
    model_index = json.loads((run_dir / "pipeline" / "model_index.json").read_text())
    assert model_index["_class_name"] == "WanPipeline"
    assert numerics.mean_abs_difference(_weights(run_dir / "transformer"),
                                        _weights(run_dir / "pipeline" / "transformer")) == 0
    _sample_is_the_pipelines(run_dir)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["t2v_ddp_resumed", "t2v_fsdp_resumed"])
def test_a_zero3_checkpoint_resumes_under_ddp_and_fsdp_within_noise(runs: Callable[[str], Path], layout: str) -> None:
    """ZeRO-3 on two ranks -> DDP on one (micro batch 2) or FSDP2 on two: the same steps 5-8 from the portable state
    give the reference's losses within bf16 compute noise, and weights nearer each other than to where they started."""
    from safetensors.torch import load_file

    reference, run_dir = runs("t2v_zero3"), runs(layout)
    got, expected = _losses(run_dir), _losses(reference)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=2e-2), step
    start = {}
    for shard in sorted((reference / "checkpoints" / "step_00000004" / "portable").glob("state-*.safetensors")):
        start.update({k.removeprefix("fp32/"): v for k, v in load_file(shard).items() if k.startswith("fp32/")})
    final, trained = ({k: w[k] for k in start} for w in (_weights(run_dir / "transformer"),
                                                         _weights(reference / "transformer")))
    moved = numerics.mean_abs_difference(trained, start)
    assert numerics.mean_abs_difference(final, trained) < 0.25 * moved


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_lora_on_every_linear_layer_loads_into_diffusers_and_its_musubi_file_has_the_original_names(
        runs: Callable[[str], Path]) -> None:
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from ds_trainer.train.layouts import wan as wan_layout

    run_dir = runs("t2v_lora_fsdp")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    diffusers_file = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")
    musubi = load_file(run_dir / "lora" / "kohya.safetensors")
    # musubi-tuner's names: lora_unet_<the original module, "." as "_">, a down, an up and an alpha each
    modules = sorted({k.removeprefix("transformer.").removesuffix(".lora_A.weight")
                      for k in diffusers_file if k.endswith(".lora_A.weight")})
    names = {"lora_unet_" + wan_layout.original_name(m + ".weight").removesuffix(".weight").replace(".", "_")
             for m in modules}
    assert set(musubi) == {name + suffix for name in names for suffix in (".lora_down.weight", ".lora_up.weight",
                                                                          ".alpha")}
    assert "lora_unet_blocks_0_self_attn_q" in names and "lora_unet_blocks_1_ffn_2" in names
    # diffusers reads musubi's file into the same tensors as its own (alpha folded into the weights)
    converted = WanPipeline.lora_state_dict(run_dir / "lora" / "kohya.safetensors")
    converted = converted[0] if isinstance(converted, tuple) else converted
    assert set(converted) == set(diffusers_file)
    for key, value in diffusers_file.items():
        torch.testing.assert_close(converted[key].float(), value.float(), rtol=1e-5, atol=1e-6)
    pipe = pipelines.load(run_dir / "pipeline")
    assert type(pipe) is WanPipeline
    pipe.set_progress_bar_config(disable=True)
    call = {"prompt": PROMPT, "num_inference_steps": 2, "height": 64, "width": 64, "num_frames": 5,
            "max_sequence_length": 32, "output_type": "np"}
    base = pipe(**call, generator=torch.Generator().manual_seed(0)).frames[0]
    pipe.load_lora_weights(run_dir / "lora")
    adapted = pipe(**call, generator=torch.Generator().manual_seed(0)).frames[0]
    assert abs(adapted - base).max() > 1e-3  # every adapted module found its tensors, and they change the clip


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["i2v_lora_zero3", "i2v_fsdp", "ti2v_zero3", "ti2v_lora_fsdp"])
def test_image_to_video_trains_lora_and_full_under_zero3_and_fsdp(runs: Callable[[str], Path], name: str) -> None:
    run_dir = runs(name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["steps"] == 4
    from ds_trainer.train.data import cache as latent_cache

    model = _model(run_dir)
    items = [item for folder in (run_dir.parents[2] / "cache").glob(f"{model}-*")
             for item in latent_cache.read(folder).values()]
    if model == "wan21_i2v_tiny":  # the first frame's latents after empty frames, CLIP's penultimate tokens
        assert all(item["condition_latents"].shape == item["latents"].shape for item in items)
        assert {tuple(item["image_embeds"].shape) for item in items} == {(5, 16)}  # 28 px: 4 patches and CLS
    else:  # TI2V: the 2.2 VAE's 48 channels at 16x, nothing beside the latents
        assert {tuple(item["latents"].shape) for item in items} == {(48, 1, 4, 4), (48, 2, 4, 4)}
        assert not any("condition_latents" in item for item in items)
    if name == "ti2v_zero3":  # from the sample's first frame (samples.images)
        import yaml

        _sample_is_the_pipelines(run_dir, Path(yaml.safe_load((run_dir / "config.yaml").read_text())["samples"]
                                               ["images"][0]))
    if name == "i2v_lora_zero3":
        from diffusers import WanImageToVideoPipeline

        pipe = pipelines.load(run_dir / "pipeline")
        assert type(pipe) is WanImageToVideoPipeline
        pipe.load_lora_weights(run_dir / "lora")
        assert (run_dir / "samples" / "step_00000004" / "0_0.mp4").is_file()


def test_the_two_experts_each_train_their_own_timesteps_and_join_in_the_pipeline(tmp_path: Path) -> None:
    """Wan 2.2 A14B: the low-noise expert trains on sigmas below the boundary, the high-noise one at or above it;
    the run says which, and the exported pipeline holds the trained expert in its slot beside the source's other."""
    from ds_trainer.train import families

    for expert in ("high", "low"):
        cfg = make_cfg("model=wan22_a14b_tiny", f"model.video.expert={expert}")
        sigmas = families.of(cfg).schedule(cfg).sigmas
        assert len(sigmas) > 10 and (bool((sigmas >= 0.875).all()) if expert == "high" else
                                     bool((sigmas < 0.875).all()))
    run_dir = _train(tmp_path, 1, f"data.path={write_clips(tmp_path / 'clips')}", "model=wan22_a14b_tiny",
                     "model.video.expert=low", "train.max_steps=2")
    assert "expert: low" in (run_dir / "config.yaml").read_text()
    trained = _weights(run_dir / "transformer")
    exported = {part: _weights(run_dir / "pipeline" / part) for part in ("transformer", "transformer_2")}
    assert numerics.mean_abs_difference(exported["transformer_2"], trained) == 0
    cfg = make_cfg("model=wan22_a14b_tiny", "model.video.expert=low")
    other = families.of(cfg).other_expert(cfg, "transformer").state_dict()  # the source's expert
    assert numerics.mean_abs_difference(exported["transformer"], dict(other)) == 0
