"""Sample images during training (`samples=on`): ZeRO-3 on two ranks with a prompt count the ranks do not
divide, reproducible from the exported pipeline, with EMA, and without any effect on training. The same two-rank
run is the reference for FSDP's bf16 (same weights as ZeRO-3's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import numerics
from helpers.cli import run_cli, run_dirs
from helpers.deps import require
from helpers.ranks import torchrun

torch = pytest.importorskip("torch")

PROMPTS = ["a red cube", "a blue ball", "a green pyramid"]
# The pixel comparisons below are exact: the run and the reference call use the same weights, the same CPU
# generator and the same kernels with one thread each (CPU kernels may sum in another order with more
# threads, and how many a process gets depends on the machine and on the launcher).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# 128 px, 2 denoising steps, 4 training steps: the least that shows every sample step.
COMMON = ["zero=stage3", "train.max_steps=4", "data.num_samples=8", "samples.steps=2"]
SAMPLES = ["samples=on", "samples.every=2", f"samples.prompts=[{','.join(PROMPTS)}]"]


def _torchrun(cwd: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc_per_node 2 -m ds_trainer` with COMMON and `overrides`, one thread per rank."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [*torchrun(2), "-m", "ds_trainer", *COMMON,
           *overrides]
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True,
                          timeout=timeout)


def _two_ranks(cwd: Path, *overrides: str) -> Path:
    result = _torchrun(cwd, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir


@pytest.fixture(scope="module")
def zero3_run(module_tmp: Callable[[str], Path]) -> Path:
    """Two ranks, ZeRO-3, sampling 3 prompts at steps 2 and 4, W&B offline."""
    return _two_ranks(module_tmp("zero3"), *SAMPLES, "logger=wandb")


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "diffusion_pytorch_model.safetensors")


def _image(path: Path) -> object:
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def _from_export(run_dir: Path, prompt: str, seed: int, bf16_unet: bool = False, lora: Path | None = None) -> object:
    """The image the exported pipeline (with `lora` loaded) makes with the sampler's settings, in a fresh
    process (`sample_reference.py` says why)."""
    import numpy as np

    out = run_dir / f"reference_{seed}_{'lora' if lora else 'base'}.npy"
    script = Path(__file__).parent / "scripts" / "sample_reference.py"
    cmd = [sys.executable, str(script), str(run_dir / "pipeline"), prompt,
           str(seed), str(out), *(["--bf16-unet"] if bf16_unet else []), *(["--lora", str(lora)] if lora else [])]
    result = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero3_two_ranks_sample_every_prompt_at_every_sample_step(zero3_run: Path) -> None:
    from helpers.wandb_log import history

    samples = zero3_run / "samples"
    assert sorted(p.name for p in samples.glob("step_*")) == ["step_00000002", "step_00000004"]
    for step_dir in samples.glob("step_*"):
        assert sorted(p.name for p in step_dir.iterdir()) == ["0_0.png", "1_0.png", "2_0.png", "grid.png"]
        assert _image(step_dir / "grid.png").shape == (3 * 128, 128, 3)  # a row per prompt
        assert _image(step_dir / "1_0.png").std() > 1  # a picture, not a blank
    # The prompts differ, so do the images (each rank generated its share, not copies of one).
    first = samples / "step_00000004"
    assert (_image(first / "0_0.png") != _image(first / "1_0.png")).any()
    (wandb_file,) = (zero3_run / "wandb").glob("offline-run-*/run-*.wandb")
    logged = {row["_step"]: row for row in history(wandb_file) if "samples.count" in row}
    assert sorted(logged) == [2, 4]  # at the training step
    for row in logged.values():
        assert row["samples.count"] == 3 and row["sample_s"] > 0 and "loss" in row
        assert [c.split(": ", 1)[1] for c in row["samples.captions"]] == PROMPTS
        assert all((wandb_file.parent / "files" / name).is_file() for name in row["samples.filenames"])


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero3_last_sample_equals_the_exported_pipelines_image(zero3_run: Path) -> None:
    # Exact: the same bf16 weights (ZeRO-3 gathers them for each forward, the export writes them), the
    # same CPU kernels with one thread, the same CPU generator.
    expected = _from_export(zero3_run, PROMPTS[2], 0, bf16_unet=True)
    got = _image(zero3_run / "samples" / "step_00000004" / "2_0.png")
    assert (got == expected).all()


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget (67 s, a two-rank run of its own; stop 54's measured run was 56.4 min)
def test_sampling_does_not_change_training(zero3_run: Path, tmp_path: Path) -> None:
    plain = _two_ranks(tmp_path, "logger=none")
    assert not (plain / "samples").exists()
    with_samples, without = _weights(zero3_run / "unet"), _weights(plain / "unet")
    assert with_samples.keys() == without.keys()
    for key in without:
        assert torch.equal(with_samples[key], without[key]), key


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long  # CI budget (121 s): FSDP2 in bf16 trains, samples and exports in test_matrix's default cells
def test_bf16_under_fsdp_trains_the_weights_zero3_trains(zero3_run: Path, tmp_path: Path) -> None:
    """`precision=bf16` means one thing under both backends (fp32 masters and Adam state, bf16 compute): FSDP full
    shard on the same two ranks, data and steps gives ZeRO-3's weights to its summation-order noise. It samples as
    ZeRO-3 does (FSDP2 gathers the root unit's weights in bf16: the sampler's cast must not undo its input cast)."""
    fsdp = _two_ranks(tmp_path, "logger=none", "zero=fsdp_full_shard", *SAMPLES)
    got, expected = _weights(fsdp / "unet"), _weights(zero3_run / "unet")
    difference = numerics.mean_abs_difference(got, expected)
    # What a bf16 rounding of the weights moves them by: the gap a run would show that started from the weights
    # rounded to bf16 (DeepSpeed builds its fp32 masters from the module it cast to bf16; ds_trainer writes the
    # loaded fp32 weights into them) or exported the bf16 module instead of the masters. Measured here: FSDP against
    # ZeRO-3 1.1e-6 (ZeRO-3's forward sums in another order), against ZeRO-2 7.5e-8; either rounding 4.4e-5.
    rounding = numerics.mean_abs_difference({k: v.bfloat16().float() for k, v in expected.items()}, expected)
    assert difference < rounding / 8, (difference, rounding)
    losses = [[row["loss"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "loss" in row] for run in (fsdp, zero3_run)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-3)
    assert sorted(p.name for p in (fsdp / "samples").glob("step_*")) == ["step_00000002", "step_00000004"]
    got, reference = _image(fsdp / "samples" / "step_00000004" / "2_0.png"), _from_export(fsdp, PROMPTS[2], 0, True)
    # Close to the exported pipeline's image, not equal: FSDP2 casts the timestep to bf16 with the other inputs, the
    # pipeline keeps it in fp32 (measured: 1.3/255 mean, 15 at most; a sample from wrong weights is tens off).
    assert got.std() > 1 and abs(got.astype(float) - reference.astype(float)).mean() < 3


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["zero=ddp"], ["zero=stage0", "precision=bf16"], ["zero=stage3", "offload=nvme"]],
                         ids=["ddp", "stage0", "stage3-nvme"])
def test_every_zero_stage_and_offload_samples(workdir: Path, layout: list[str]) -> None:
    # The other ways the UNet is held while it samples: DDP's wrapper, ZeRO-0's flat bf16 buffers, ZeRO-3 with
    # the parameters swapped to disk (gathered for every forward). ZeRO-1/2 hold whole 16-bit weights on every
    # rank, as in the EMA and LoRA tests below.
    if "offload=nvme" in layout:
        from ds_trainer.config import nvme

        require(nvme.aio_load_error() is None, f"DeepSpeed's async_io op: {nvme.aio_load_error()}")
        layout = [*layout, f"offload.nvme_path={workdir / 'swap'}"]
    result = run_cli(*layout, "train.max_steps=2", "data.num_samples=4", "samples.steps=2", "logger=none",
                     "samples=on", "samples.every=0", "samples.prompts=[a red cube,a blue ball]", "train.export=false",
                     cwd=workdir, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    step = run_dir / "samples" / "step_00000002"
    assert sorted(p.name for p in step.iterdir()) == ["0_0.png", "1_0.png", "grid.png"]
    first, second = _image(step / "0_0.png"), _image(step / "1_0.png")
    assert first.std() > 1 and (first != second).any()  # pictures, one per prompt


@pytest.mark.slow
def test_ema_sample_equals_the_exported_ema_pipelines_image(workdir: Path) -> None:
    # One rank, ZeRO-2: the EMA shadow is fp32 and whole on every rank whatever the stage.
    result = run_cli("zero=stage2", "train.max_steps=3", "data.num_samples=4", "samples.steps=2", "logger=none",
                     "train.ema=true", "train.ema_decay=0.5", "samples=on", "samples.every=0", "samples.seeds=[7]",
                     "samples.prompts=[a small house]", cwd=workdir, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    got = _image(run_dir / "samples" / "step_00000003" / "0_7.png")
    # The exported pipeline holds the EMA UNet in fp32: a plain pipeline call reproduces the image exactly.
    assert (got == _from_export(run_dir, "a small house", 7, bf16_unet=False)).all()
    trained = _weights(run_dir / "unet")
    ema = _weights(run_dir / "unet_ema")
    assert any(not torch.equal(trained[k].float(), ema[k]) for k in ema)  # it did sample the EMA, not the UNet


def test_bad_samples_settings_get_the_one_screen_message(workdir: Path) -> None:
    result = run_cli("samples=on", "samples.prompts=[]", "samples.steps=0", "samples.width=100",
                     "samples.guidance_scale=-1", "dry_run=true", "logger=none", cwd=workdir)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for key in ("samples.prompts=[]", "samples.steps=0", "samples.width=100", "samples.guidance_scale=-1.0"):
        assert f"  - {key}\n" in result.stderr, key
    assert "fix: samples.width=96" in result.stderr
    missing = run_cli("samples=on", f"samples.prompts={workdir / 'nope.txt'}", "dry_run=true", "logger=none",
                      cwd=workdir)
    assert missing.returncode == 2 and "is not a file" in missing.stderr and "Traceback" not in missing.stderr


def test_prompts_from_a_file_and_the_schedule(tmp_path: Path) -> None:
    from helpers.cfg import make_cfg

    from ds_trainer.config import samples

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n\n  a blue ball  \n")
    cfg = make_cfg("samples=on", f"samples.prompts={prompts}", "samples.every=3", "train.max_steps=10")
    assert samples.prompts(cfg) == ["a red cube", "a blue ball"]
    assert [s for s in range(1, 11) if samples.due(cfg, s)] == [3, 6, 9, 10]
    assert samples.size(cfg) == (128, 128)  # the training resolution
    default = make_cfg()
    assert not any(samples.due(default, s) for s in range(1, 300))  # samples=none is the default


def test_the_planner_counts_the_sampling_peak(capsys: pytest.CaptureFixture[str]) -> None:
    from helpers.cfg import make_cfg

    from ds_trainer.tools import plan

    def cell(*overrides: str) -> plan.Estimate:
        return plan.estimate(make_cfg("zero=stage3", "offload=cpu", *overrides), "stage3", "cpu", 1)

    assert cell().sampling is None  # samples=none
    base = cell("samples=on")
    assert base.sampling is not None and base.sampling > base.params + base.buffers
    assert (cell("samples=on", "samples.width=256", "samples.height=256").sampling or 0) > base.sampling
    ema = cell("samples=on", "train.ema=true")
    params = plan.unet_stats(str(make_cfg().model.architecture)).params
    assert (ema.sampling or 0) - base.sampling >= 4 * params  # a float32 UNet on the EMA shadow
    # A budget between training's peak and sampling's: the plan says sampling does not fit there.
    budget = (ema.gpu + (ema.sampling or 0)) / 2 / plan.GIB
    assert ema.gpu < budget * plan.GIB < (ema.sampling or 0)
    plan.main(["zero=stage3", "offload=cpu", "samples=on", "train.ema=true", f"plan.vram_gib={budget}"])
    out = capsys.readouterr().out
    assert "stage3/cpu" in out and "(does not fit)" in out.split("stage3/cpu", 1)[1].split(",")[0]


@pytest.mark.slow
def test_lora_sample_equals_the_base_pipeline_with_the_exported_lora(workdir: Path) -> None:
    # fp32: the sampled UNet is the training UNet with its peft layers; the export is the untrained base
    # pipeline plus <run>/lora, loaded the way users load a LoRA. Same weights, same kernels: same pixels.
    result = run_cli("zero=stage2", "adapter=lora", "precision=fp32", "train.max_steps=2", "data.num_samples=4",
                     "scheduler=constant",
                     "optimizer.lr=0.05", "samples.steps=2", "logger=none", "samples=on", "samples.every=0",
                     "samples.seeds=[3]", "samples.prompts=[a small house]", cwd=workdir, env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    got = _image(run_dir / "samples" / "step_00000002" / "0_3.png")
    base = _from_export(run_dir, "a small house", 3)
    with_lora = _from_export(run_dir, "a small house", 3, lora=run_dir / "lora")
    assert (got == with_lora).all()
    assert (got != base).any()  # the sample did use the trained adapters


@pytest.mark.slow
@pytest.mark.multiproc
def test_ranks_that_would_sample_differently_stop_with_a_message_not_a_hang(tmp_path: Path) -> None:
    # Each rank resolves its own configuration; one that would run other forwards under ZeRO-3 would hang
    # both in the first gather. Here the guidance scale comes from each rank's RANK variable.
    result = _torchrun(tmp_path, "logger=none", "samples=on", "samples.prompts=[a red cube]",
                       "samples.guidance_scale=${oc.env:RANK}", timeout=600)
    assert result.returncode != 0
    assert "samples: the ranks disagree on what to sample" in result.stderr
    assert '"guidance_scale": 0.0' in result.stderr and '"guidance_scale": 1.0' in result.stderr
    assert "launch every rank with the same overrides" in result.stderr
    # The ranks print no traceback; torchrun prints its own when a rank exits non-zero.
    assert result.stderr.count("Traceback") == result.stderr.count("ChildFailedError:") == 1
    (run_dir,) = run_dirs(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "error"
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("step_*"))
