"""SDXL training end to end on the CPU: `python -m ds_trainer` (and torchrun, accelerate launch) as users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli, run_dirs
from helpers.deps import require
from helpers.ranks import free_port, torchrun

from ds_trainer.config import nvme

torch = pytest.importorskip("torch")

FAST = ["logger=none", "train.max_steps=4", "data.num_samples=8"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def unet_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "diffusion_pytorch_model.safetensors")


# The default suite trains the cells that exercise distinct code (DDP, ZeRO-0, CPU offload per stage, NVMe
# swap at stage 3); the rest are `long` (test_deepspeed_engines builds every zero x offload engine anyway).
# (ZeRO-1's CPU offload is ZeRO-2's code, stage_1_and_2.py: it went to `long` for the CI budget; ZeRO-1 trains by
# default in test_portable's chain, CPU offload under ZeRO-2 in test_lora.)
_DEFAULT = {("ddp", "none"), ("stage0", "none"), ("stage2", "none"), ("stage3", "cpu"), ("stage3", "nvme")}
CELLS = [pytest.param(z, o, marks=() if (z, o) in _DEFAULT else pytest.mark.long)
         for z, o in [("ddp", "none"), ("stage0", "none")] + [(f"stage{s}", o) for s in (1, 2, 3)
                                                              for o in ("none", "cpu", "nvme")]]


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload"), CELLS)
def test_a_few_steps_per_zero_and_offload(workdir: Path, zero: str, offload: str) -> None:
    if offload == "nvme" and zero == "stage3":
        require(nvme.aio_prerequisites() is None, "libaio-dev is not installed")
    result = run_cli(f"zero={zero}", f"offload={offload}", *FAST, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    s = summary(run_dir)
    assert s["status"] == "ok" and s["steps"] == 4 and s["zero"] == zero and s["offload"] == offload
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and "gpu_mem_peak_allocated_mib" not in r for r in metrics(run_dir))
    assert (run_dir / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    assert len(unet_weights(run_dir / "unet")) > 100
    if zero == "stage3" and offload == "nvme":
        assert list((workdir / "outputs" / "nvme_swap").rglob("*.swp")), "no swap files written to NVMe"
    assert "ds_trainer: ok after 4 steps" in result.stderr


@pytest.mark.slow
@pytest.mark.multiproc
# ZeRO-3's two ranks in make test-long (CI budget): test_lora's and test_transformers' two-rank ZeRO-3 runs by default.
@pytest.mark.parametrize("zero", ["stage2", pytest.param("stage3", marks=pytest.mark.long)])
def test_two_ranks_share_one_run(workdir: Path, zero: str) -> None:
    cmd = [*torchrun(2), "-m", "ds_trainer", f"zero={zero}",
           *FAST]
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    s = summary(run_dir)
    assert s["status"] == "ok" and s["world_size"] == 2
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]  # rank 0 alone writes metrics
    assert result.stderr.count("ds_trainer: ok after 4 steps") == 1
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2
    assert len(unet_weights(run_dir / "unet")) > 100


@pytest.mark.slow
@pytest.mark.multiproc
def test_accelerate_launch_runs_the_trainer(workdir: Path) -> None:
    dry = run_cli("zero=stage2", "world_size=2", "dry_run=true", cwd=workdir)
    assert dry.returncode == 0, dry.stderr
    (dry_dir,) = run_dirs(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(dry_dir / "accelerate_config.yaml"),
           "--main_process_port", str(free_port()), "-m", "ds_trainer", "zero=stage2", *FAST]
    result = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = next(d for d in run_dirs(workdir) if d != dry_dir)
    assert summary(run_dir)["world_size"] == 2


@pytest.mark.slow
@pytest.mark.long  # CI budget: the families sweep's loss falls over 40 steps by default
def test_loss_falls_when_overfitting_one_batch(workdir: Path) -> None:
    result = run_cli("logger=none", "data.num_samples=2", "train.micro_batch_size=2", "train.max_steps=60",
                     "scheduler=constant", "optimizer.lr=1e-3", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in metrics(run_dirs(workdir)[0])]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)


@pytest.mark.slow
def test_export_matches_the_zero_checkpoint_and_generates(workdir: Path) -> None:
    result = run_cli("zero=stage3", *FAST, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints" / "step_00000004"))
    exported = unet_weights(run_dir / "unet")
    assert exported.keys() == fp32.keys()
    # The export is the fp32 masters (bf16 training: the module holds rounded copies), bit for bit.
    for key, value in exported.items():
        torch.testing.assert_close(value, fp32[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in exported.values())
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(run_dir / "pipeline")
    image = pipe("a red square on a blue background", num_inference_steps=2, height=128, width=128,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (128, 128)
    assert len(image.getcolors(maxcolors=1 << 16) or []) > 10  # a picture, not a blank


@pytest.mark.slow
def test_folder_data_with_captions_and_cache_reuse(workdir: Path) -> None:
    from PIL import Image

    images = workdir / "images"
    images.mkdir()
    for i, (size, ext) in enumerate([((200, 150), "png"), ((96, 160), "jpg"), ((128, 128), "webp")]):
        Image.new("RGB", size, (40 * i, 100, 200)).save(images / f"img{i}.{ext}")
        if i < 2:
            (images / f"img{i}.txt").write_text(f"picture number {i}")
    (images / "metadata.jsonl").write_text(json.dumps({"file_name": "img2.webp", "text": "from metadata"}) + "\n")
    args = ("data=folder", f"data.path={images}", "logger=none", "train.max_steps=3")
    first = run_cli(*args, cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "cached latents and embeddings of 3 samples" in first.stderr
    second = run_cli(*args, cwd=workdir)
    assert second.returncode == 0 and "cached latents" not in second.stderr
    caches = list((workdir / "outputs" / "cache").glob("sdxl_tiny-*"))  # latent caches (beside scan records)
    assert len(caches) == 1
    from ds_trainer.train.data import cache as latent_cache

    (name, item), *_ = latent_cache.read(caches[0]).items()
    assert name.startswith("128x128/")  # by bucket, then a hash of the image, caption and crop
    assert item["latents"].shape == (4, 16, 16)  # 128 px through the VAE's factor 8
    assert item["time_ids"].tolist()[-2:] == [128, 128]
    # Weights and cache packs follow the umask like the config beside them (safetensors writes 0600): a teammate
    # on a shared disk reads the UNet, the checkpoint and the cache as well as config.yaml.
    (run_dir, *_) = run_dirs(workdir)
    shared = (run_dir / "config.yaml").stat().st_mode & 0o777
    written = [p for p in (workdir / "outputs").rglob("*.safetensors")]
    assert any("checkpoints" in p.parts for p in written) and any("cache" in p.parts for p in written), written
    assert {p: p.stat().st_mode & 0o777 for p in written} == dict.fromkeys(written, shared)



@pytest.mark.slow
def test_pretrained_folder_with_v_prediction_min_snr_and_checkpointing(workdir: Path) -> None:
    # A diffusers folder made by a first run stands in for a downloaded SDXL checkpoint.
    first = run_cli("logger=none", "train.max_steps=1", "data.num_samples=2", cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    pipeline = run_dirs(workdir)[0] / "pipeline"
    scheduler = pipeline / "scheduler" / "scheduler_config.json"
    scheduler.write_text(scheduler.read_text().replace('"epsilon"', '"v_prediction"'))
    result = run_cli("logger=none", f"model.pretrained={pipeline}", "train.max_steps=3", "data.num_samples=4",
                     "train.min_snr_gamma=5", "train.gradient_checkpointing=true", "zero=stage3",
                     "train.checkpoint_every=1", "train.checkpoints_to_keep=2", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = run_dirs(workdir)[1]
    assert summary(run_dir)["status"] == "ok"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    started = unet_weights(pipeline / "unet")
    trained = unet_weights(run_dir / "unet")
    assert any(not torch.equal(started[k], trained[k]) for k in started)  # it trained from those weights
    assert max((started[k] - trained[k]).abs().max().item() for k in started) < 0.05  # ...and not from scratch


def test_a_partial_checkpoint_is_never_resumed(tmp_path: Path) -> None:
    from helpers.cfg import make_cfg

    from ds_trainer.train.state import checkpoint

    run_dir = tmp_path / "outputs" / "runs" / "2026-01-01" / "00-00-00-aaaaaa"
    done = run_dir / "checkpoints" / "step_00000004"
    done.mkdir(parents=True)
    cfg = make_cfg(f"paths.outputs={tmp_path / 'outputs'}", "resume=latest")
    (done / checkpoint.MARKER).write_text(json.dumps({"step": 4, "fingerprint": checkpoint.fingerprint(cfg)}))
    (run_dir / "checkpoints" / ".step_00000008.partial").mkdir()  # a save that crashed
    (run_dir / "checkpoints" / "step_00000012").mkdir()  # renamed but without its marker: not complete
    assert checkpoint.find_resume(cfg, tmp_path / "new_run") == done
    other = make_cfg(f"paths.outputs={tmp_path / 'outputs'}", "resume=latest", "train.seed=1")
    assert checkpoint.find_resume(other, tmp_path / "new_run") is None  # another experiment's checkpoint
