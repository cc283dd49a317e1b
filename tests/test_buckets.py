"""Aspect-ratio buckets: where images land, one shape per global batch on every rank, SDXL's time ids,
the per-bucket latent cache, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import numerics, wandb_log
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun

from ds_trainer.config import buckets as geometry
from ds_trainer.errors import DataError
from ds_trainer.train.data import buckets
from ds_trainer.train.data import cache as latent_cache

torch = pytest.importorskip("torch")

# name: (width, height) and the bucket at 128 px (about 128x128 pixels, sides 64..256 in steps of 64)
IMAGES = {"portrait": ((300, 900), "64x192"), "tall": ((200, 800), "64x256"), "landscape": ((900, 300), "192x64"),
          "wide": ((1000, 250), "256x64"), "square": ((256, 256), "128x128"), "photo": ((400, 300), "128x128"),
          "tiny": ((20, 30), "128x128"), "huge": ((3000, 2000), "128x128")}


def make_folder(root: Path, images: dict[str, tuple[tuple[int, int], str]] = IMAGES) -> Path:
    """PNGs whose red channel grows with x and green with y (to find the crop in the pixels), with captions."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    for name, ((w, h), _) in images.items():
        ramp = Image.linear_gradient("L").rotate(90).resize((w, h))  # 0 at the left edge, 255 at the right
        down = Image.linear_gradient("L").resize((w, h))  # 0 at the top, 255 at the bottom
        Image.merge("RGB", (ramp, down, Image.new("L", (w, h), 200))).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"a {name} picture")
    return root


def folder_data(path: Path, *overrides: str):  # noqa: ANN201 - SourceImages
    from ds_trainer.config import checks
    from ds_trainer.train import data

    cfg = checks.check(make_cfg("data=folder", f"data.path={path}", f"paths.outputs={path.parent / 'out'}",
                                    *overrides)).cfg
    return data.SourceImages(cfg)


def test_bucket_sizes_follow_the_area_the_step_and_the_limits() -> None:
    found = geometry.generate(geometry.spec(make_cfg("data=folder", "data.path=x", "resolution=px1024")))
    names = {geometry.name(b) for b in found}
    assert {"1024x1024", "1216x832", "832x1216", "1344x768", "1536x640", "512x2048", "2048x512"} <= names
    assert all(w % 64 == 0 and h % 64 == 0 and w * h <= 1024 * 1024 and max(w / h, h / w) <= 4 for w, h in found)
    # Memory is planned at the largest bucket: the full area, and of those the longest side.
    assert geometry.largest(make_cfg("data=folder", "data.path=x", "resolution=px1024")) == (512, 2048)
    assert geometry.largest(make_cfg("resolution=px1024")) == (1024, 1024)  # synthetic data: no buckets


def test_the_planner_uses_the_largest_bucket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_trainer.tools import plan

    plan.main(["data=folder", f"data.path={tmp_path}", "plan.vram_gib=24"])
    assert "sdxl_tiny 64x256 (largest bucket)" in capsys.readouterr().out


def test_mixed_sizes_land_in_their_buckets_and_every_global_batch_is_one_bucket(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "images")
    data = folder_data(folder)
    landed = {Path(key).stem: geometry.name(data.layout.bucket(i)) for i, key in enumerate(data.names())}
    assert landed == {name: bucket for name, (_, bucket) in IMAGES.items()}
    assert data.layout.counts() == {"64x256": 1, "64x192": 1, "128x128": 4, "192x64": 1, "256x64": 1}
    # Global batch 4 (micro 1 x accumulation 2 x 2 ranks): only 128x128 fills one; the rest is dropped, and said.
    drop = buckets.Plan(data.layout, 4, 0, repeat=False)
    assert drop.per_epoch == 1 and "64x192: 1 image(s), 0 batch(es) per epoch, 1 dropped" in drop.report()
    repeat = buckets.Plan(data.layout, 4, 0, repeat=True)
    assert repeat.per_epoch == 5  # every bucket trains, small ones filled up by repeating their images
    for b in range(2 * 5 * 3):  # micro-batches of three epochs
        parts = [repeat.indices(b, rank, 2, 1) for rank in (0, 1)]
        shapes = {data.layout.of[i] for part in parts for i in part}
        assert len(shapes) == 1 and all(len(p) == 1 for p in parts)  # one bucket on both ranks, full batches
    assert repeat.samples(4 * 7 + 1, 3) == repeat.batch(7)[1:]  # addressable by a position counted in samples
    step = [repeat.batch(s) for s in range(5)]
    assert sorted(i for batch in step for i in set(batch)) == list(range(8))  # an epoch sees every image
    # A new order per epoch, the same for the same (seed, epoch): a resume continues the plan.
    assert repeat.epoch(1) != repeat.epoch(0) and repeat.epoch(1) == buckets.Plan(data.layout, 4, 0, True).epoch(1)


def test_time_ids_are_source_size_crop_offset_and_bucket(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "images")
    for flip in (False, True):
        data = folder_data(folder, "data.center_crop=false", f"data.random_flip={str(flip).lower()}")
        offsets, mirrored = set(), 0
        for i, key in enumerate(data.names()):
            example = data[i]
            (w, h), _ = IMAGES[Path(key).stem]
            bw, bh = data.layout.bucket(i)
            orig_h, orig_w, top, left, target_h, target_w = example.time_ids.tolist()
            assert (orig_w, orig_h, target_w, target_h) == (w, h, bw, bh)
            assert tuple(example.pixels.shape) == (3, bh, bw)
            scale = max(bw / w, bh / h)
            new_w, new_h = max(bw, round(w * scale)), max(bh, round(h * scale))
            # Find the crop in the pixels (2 px in: clear of edge ringing): red is x / (width - 1) of the
            # resized image, green y / (height - 1); a mirrored crop's `left` counts in the mirrored image.
            if new_h - bh >= 16:
                offsets.add(("top", top))
                green = (example.pixels[1, 2, bw // 2].item() + 1) / 2
                assert abs(green - (top + 2) / (new_h - 1)) < 0.03, (key, top, green)
            if new_w - bw >= 16:
                offsets.add(("left", left))
                red = (example.pixels[0, bh // 2, 2].item() + 1) / 2
                plain, flipped = (left + 2) / (new_w - 1), 1 - (left + 2) / (new_w - 1)
                assert abs(red - plain) < 0.03 or flip and abs(red - flipped) < 0.03, (key, left, red, plain)
                mirrored += abs(red - plain) >= 0.03
        assert len(offsets) == 3 and all(offset > 0 for _, offset in offsets)  # random crops, not the edge
        assert (mirrored > 0) == flip


def test_bad_bucket_input_is_reported(tmp_path: Path) -> None:
    bad = run_cli("data=folder", f"data.path={tmp_path}", "data.bucket_max_aspect_ratio=0.5",
                  "data.bucket_min_side=512", "dry_run=true", cwd=tmp_path)
    assert bad.returncode == 2 and "data.bucket_max_aspect_ratio=0.5" in bad.stderr and "Traceback" not in bad.stderr
    empty = run_cli("data=folder", f"data.path={tmp_path}", "data.bucket_min_side=512", "dry_run=true", cwd=tmp_path)
    assert empty.returncode == 2 and "no bucket of about 16384 pixels" in empty.stderr
    strips = make_folder(tmp_path / "strips", {"strip": ((2000, 100), ""), "pole": ((50, 900), "")})
    with pytest.raises(DataError, match=r"pole.png \(50x900\), strip.png \(2000x100\).*bucket_max_aspect_ratio=4"):
        folder_data(strips)
    few = make_folder(tmp_path / "few", {k: IMAGES[k] for k in ("portrait", "landscape")})
    with pytest.raises(DataError, match="fewer images than one global batch of 2.*bucket_remainder=repeat"):
        folder_data(few, "train.micro_batch_size=2")


# CI budget: two ranks train over these buckets by default in test_a_resume_continues_the_bucket_plan, and a second
# run reuses a cache in test_train's folder test.
@pytest.mark.long
@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_train_over_uneven_buckets_then_a_second_run_reuses_the_cache(tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "images")
    args = ["data=folder", f"data.path={folder}", "logger=none", "train.max_steps=4", "data.bucket_remainder=repeat",
            "train.export=false"]
    cmd = [*torchrun(2), "-m", "ds_trainer", "zero=stage3",
           *args]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = run_dirs(tmp_path)[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 4 and summary["world_size"] == 2
    assert summary["buckets"] == {"64x256": 1, "64x192": 1, "128x128": 4, "192x64": 1, "256x64": 1}
    assert "bucket 256x64: 1 image(s), 1 batch(es) per epoch, 1 repeated" in first.stderr
    (cache,) = (tmp_path / "outputs" / "cache").glob("sdxl_tiny-buckets-*")
    files = {p: p.stat().st_mtime_ns for p in cache.glob("pack-*.safetensors")}
    assert len(files) == 2  # a pack of each rank's share
    items = latent_cache.read(cache)  # by <bucket>/<hash of the image, caption and crop>
    assert len(items) == 8 and {name.split("/")[0] for name in items} == {"64x256", "64x192", "128x128", "192x64",
                                                                          "256x64"}
    item = next(value for name, value in items.items() if name.startswith("64x192/"))
    assert item["latents"].shape == (4, 24, 8)  # 192 px tall, 64 wide, through the VAE's factor 8
    second = run_cli(*[a for a in args if a != "logger=none"], cwd=tmp_path)  # one rank, W&B offline
    assert second.returncode == 0, second.stderr[-3000:]
    assert "cached latents" not in second.stderr  # same images: nothing encoded again
    assert {p: p.stat().st_mtime_ns for p in cache.glob("pack-*.safetensors")} == files
    (wandb_file,) = run_dirs(tmp_path)[1].glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_log.config(wandb_file)["buckets"] == summary["buckets"]


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_resume_continues_the_bucket_plan(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = make_folder(tmp_path / "images")
    # Micro batch 2 with repeats: 6 global batches an epoch, so 8 steps cross into a second epoch.
    # fp32: the two-rank run below is compared with the one-rank run by weights, where fp32's summation-order
    # noise (1e-9) is orders of magnitude below a wrong batch or a lost moment (1e-5 and more); bf16's rounding
    # drift (measured 2.7e-6 on the mean after 4 steps) is not.
    # Validation holds out 2 of the 8 images (scored at their buckets' sizes): the same two on one rank and two.
    common = ["data=folder", f"data.path={folder}", "logger=none", "train.max_steps=8", "train.checkpoint_every=4",
              "train.micro_batch_size=2", "data.bucket_remainder=repeat", "data.center_crop=false", "precision=fp32",
              "validation=on", "validation.split=2"]
    straight = run_cli(*common, cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    (reference,) = run_dirs(tmp_path)
    expected = load_file(reference / "unet" / "diffusion_pytorch_model.safetensors")
    # (A resume in the same layout is DeepSpeed's native load, bit for bit: test_reliability's kill -9 resumes.)
    # Two ranks of micro batch 1 (the same global batch of 2) continue the same plan from the same checkpoint:
    # the portable state carries over, each rank takes its half of every global batch.
    cmd = [*torchrun(2), "-m", "ds_trainer",
           *[a for a in common if not a.startswith("train.micro_batch_size")], "train.micro_batch_size=1",
           f"resume={reference / 'checkpoints' / 'step_00000004'}"]
    two = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=900)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world_size: 1 -> 2; micro_batch_size: 2 -> 1" in two.stderr, two.stderr[-3000:]
    third = run_dirs(tmp_path)[1]
    rows = [json.loads(line) for line in (third / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [5, 6, 7, 8]
    assert [r["loss"] for r in rows if "loss" in r] == pytest.approx(
        [r["loss"] for r in rows_of(reference)[4:] if "loss" in r], rel=1e-4)
    got = load_file(third / "unet" / "diffusion_pytorch_model.safetensors")
    numerics.assert_same_weights(got, expected, "two ranks of micro batch 1 against one of 2")
    # The same held-out images on one rank and two (test_validation_loss: never trained); the same validation
    # loss at step 8 up to summation order (the weights differ by the noise checked above; a lost or doubled pair
    # moves it by percents).
    held = [json.loads((d / "validation_set.json").read_text()) for d in (reference, third)]
    assert held[0]["names"] == held[1]["names"] and len(held[0]["names"]) == 2 and held[0]["pairs"] == 8
    losses = [json.loads((d / "summary.json").read_text())["val_loss"] for d in (reference, third)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
def test_the_transformers_train_over_buckets_of_their_own_size_rule(tmp_path: Path) -> None:
    """SD3 and Flux, whose sides need multiples of 16 (the VAE's 8 times the patch or packing of 2), not SDXL's 32:
    with data.bucket_step=16 their buckets take sides like 80 and 208 (no SDXL bucket has them), and both
    transformers train over every bucket (non-square latents: SD3's cropped position embedding, Flux's packed tokens
    and their ids), one sweep of two cells under ZeRO-1."""
    folder = make_folder(tmp_path / "images")
    result = run_cli("-m", "model=sd3_tiny,flux_tiny", "zero=stage1", "data=folder", f"data.path={folder}",
                     "data.bucket_step=16", "data.bucket_remainder=repeat", "logger=none", "train.max_steps=8",
                     "train.export=false", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    sdxl = {geometry.name(b) for b in geometry.generate(geometry.spec(make_cfg("data=folder", "data.path=x",
                                                                               "data.bucket_step=16")))}
    for model, channels in (("sd3_tiny", 16), ("flux_tiny", 4)):
        (cell,) = [c for c in (tmp_path / "outputs" / "sweeps").glob("*/*/[0-9]")
                   if f"name: {model}" in (c / "config.yaml").read_text()]
        summary = json.loads((cell / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["steps"] == 8, summary
        assert sum(summary["buckets"].values()) == len(IMAGES) and len(summary["buckets"]) >= 4
        assert set(summary["buckets"]) - sdxl, summary["buckets"]  # sizes SDXL's factor 32 does not allow
        (cache,) = (tmp_path / "outputs" / "cache").glob(f"{model}-buckets-*")
        for name, item in latent_cache.read(cache).items():
            width, height = map(int, name.split("/")[0].split("x"))
            assert width % 16 == 0 and height % 16 == 0
            assert item["latents"].shape == (channels, height // 8, width // 8)
