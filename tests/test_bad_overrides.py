"""Bad overrides, run as a user runs them: exit non-zero, one screen naming the key, no traceback."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli
from helpers.ranks import torchrun

from ds_trainer.config import checks, hardware, nvme

# (overrides, text the message must contain: the key or the value at fault, and the fix)
BAD = [
    (["train.max_stepz=3"], ["max_stepz"]),
    (["train.max_steps=abc"], ["max_steps", "abc"]),
    (["train.max_steps=0"], ["train.max_steps=0", "train.max_steps=1"]),
    (["train.micro_batch_size=-2"], ["train.micro_batch_size=-2", "at least 1"]),
    (["train.gradient_accumulation_steps=0"], ["train.gradient_accumulation_steps"]),
    (["zero=stage4"], ["zero", "stage4"]),
    (["offload=tape"], ["offload", "tape"]),
    (["zero=ddp", "offload=cpu"], ["offload=cpu", "zero=ddp", "zero=stage2 offload=cpu"]),
    (["zero=stage0", "offload=nvme"], ["offload=nvme", "zero=stage0"]),
    (["zero=stage2", "offload=cpu", "offload.params=true"], ["offload.params=True", "zero=stage3"]),
    (["optimizer.name=onebitadam"], ["optimizer.name=onebitadam", "adamw", "1-bit"]),
    (["optimizer.name=muadam"], ["optimizer.name=muadam", "set_base_shapes"]),
    (["optimizer=muon", "zero=stage3"], ["optimizer.name=muon", "convolution", "adapter=lora",
                                         "zero.reduce_scatter=false"]),
    (["optimizer=lamb", "offload=cpu"], ["optimizer.name=lamb", "CPU"]),
    # The formats are lists (config/formats.py); the old single-valued keys say the new form.
    (["adapter=lora", "adapter.format=kohya"], ["adapter.format=kohya", "adapter.formats=[kohya]"]),
    (["export.format=both"], ["export.format=both", "export.formats=[diffusers,single_file]"]),
    (["adapter=lora", "adapter.formats=[]"], ["adapter.formats=[]", "adapter.formats=[diffusers,kohya]"]),
    (["export.formats=[]"], ["export.formats=[]", "train.export=false"]),
    # The model families: SDXL's levers on a flow-matching transformer, flow keys on SDXL, Flux's keys on SD3.
    (["model=sd3_tiny", "train.min_snr_gamma=5"], ["train.min_snr_gamma=5.0", "model.flow.weighting"]),
    (["model=flux_tiny", "text_encoders=lora"], ["text_encoders=lora", "text_encoders=frozen"]),
    (["model.flow.shift=1"], ["model.flow.shift=1", "model.flow is null", "model=sd3_tiny"]),
    (["model=sd3_tiny", "model.flow.guidance=3.5"], ["model.flow.guidance=3.5", "model.flow.guidance=null"]),
    (["model=flux_tiny", "model.flow.shift=3"], ["model.flow.shift=3.0", "dynamic_shift", "model.flow.shift=1.0"]),
    (["model=sd3_tiny", "model.flow.t5_max_length=600"], ["model.flow.t5_max_length=600", "512"]),
    (["model=sd3_tiny", "model.transformer=/nonexistent/sd3.5_medium.safetensors"],
     ["model.transformer=/nonexistent/sd3.5_medium.safetensors", "no such file"]),
    (["zero=ddp", "optimizer=lion"], ["optimizer.name=lion", "torch.optim"]),
    (["optimizer.lr=-1"], ["optimizer.lr=-1.0"]),
    (["optimizer=prodigy", "optimizer.lr=0"], ["optimizer.lr=0.0", "optimizer.lr=1e-4"]),  # not a ZeroDivisionError
    (["optimizer.lr=nan"], ["optimizer.lr=nan", "finite"]),
    (["train.gradient_clipping=inf"], ["train.gradient_clipping=inf", "finite"]),
    (["optimizer.betas=[0.9,1.5]"], ["optimizer.betas"]),
    (["resolution.width=1000"], ["resolution.width=1000", "multiple of 32", "resolution.width=992"]),
    (["resolution.height=16"], ["resolution.height=16", "resolution.height=32"]),
    (["scheduler.warmup_steps=100", "train.max_steps=10"], ["scheduler.warmup_steps=100"]),
    (["data=folder"], ["data.path"]),
    (["data=folder", "data.path=/nonexistent/images"], ["data.path=/nonexistent/images", "not a folder"]),
    (["model.pretrained=not a model"], ["model.pretrained=not a model"]),
    (["resume=/nonexistent/ckpt"], ["resume=/nonexistent/ckpt", "resume=latest"]),
    (["+train.lr=3"], ["train.lr", "not a ds_trainer setting"]),
    (["platform=gpu"], ["platform", "gpu"]),
    (["precision=fp8"], ["precision", "fp8"]),
    (["world_size=0"], ["world_size=0"]),
    (["+sweep=zero_ofload"], ["zero_ofload", "zero_offload"]),
    (["lever=lokr"], ["lever=lokr", "+lever=lokr"]),  # a sweep's cell: added with +, not overridden
    (["data=sources", "data.sources=/data/images"],  # one path where a list of sources goes
     ["data.sources=/data/images", "is a list", "data.sources='[{path: /data/images}]'"]),
    (["validation=on", "validation.timesteps=0", "validation.path=/nonexistent/val"],
     ["validation.timesteps=0", "validation.timesteps=4", "validation.path=/nonexistent/val", "not a folder"]),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_override_exits_with_one_screen_message(workdir: Path, overrides: list[str], expected: list[str]) -> None:
    result = run_cli(*overrides, "dry_run=true", cwd=workdir)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    assert len(output.splitlines()) <= 25, output
    for text in expected:
        assert text in output, output
    assert not list((workdir / "outputs" / "runs").glob("*/*/ds_config.json"))


@pytest.mark.parametrize("overrides", [["zero=fsdp_full_shard", "offload=nvme"], ["zero=stage9"]],
                         ids=["a rule", "an override Hydra refuses"])
def test_a_refusal_under_torchrun_is_said_once_before_any_rank_trains(workdir: Path, overrides: list[str]) -> None:
    """Two ranks check the same configuration: the refusal is printed once (not once per rank), torchrun's exit
    status carries the ranks' 2, and what precedes torchrun's own failure block has no traceback."""
    done = subprocess.run([*torchrun(2), "-m", "ds_trainer", *overrides], cwd=workdir, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ours, hint, torchruns = done.stderr.partition("(torchrun's own failure block follows")
    assert hint, done.stderr
    assert ours.count("problem in the configuration, nothing was run") == 1, done.stderr
    assert "why:" in ours and "fix:" in ours and "Traceback" not in ours, done.stderr
    assert "world_size=<ranks> dry_run=true" in torchruns
    assert done.returncode == 1 and re.search(r"exitcode\s*:\s*2\b", torchruns), done.stderr[-2000:]
    assert not list((workdir / "outputs" / "runs").glob("*/*/metrics.jsonl"))


def test_all_problems_are_reported_at_once(workdir: Path) -> None:
    result = run_cli("zero=ddp", "offload=cpu", "train.max_steps=0", "resolution.width=100", "optimizer.name=sgdx",
                     "dry_run=true", cwd=workdir)
    assert result.returncode == 2
    assert "4 problems" in result.stderr
    for key in ("offload=cpu", "train.max_steps=0", "resolution.width=100", "optimizer.name=sgdx"):
        assert key in result.stderr


@pytest.mark.parametrize(("given", "expected"), [("AdamW", "adamw"), ("adam_w", "adamw"), ("Adam-W", "adamw"),
                                                 ("ADAGRAD", "adagrad"), ("Lion", "lion")])
def test_optimizer_names_are_normalized(given: str, expected: str) -> None:
    report = checks.check(make_cfg(f"optimizer.name={given}", "offload=cpu"))
    assert report.ok, report.render()
    assert report.cfg.resolved.optimizer == expected


@pytest.mark.parametrize("given", ["cpuadam", "FusedAdam", "fused_adam"])
def test_cpuadam_and_fusedadam_become_adamw_with_a_warning(workdir: Path, given: str) -> None:
    result = run_cli(f"optimizer.name={given}", "dry_run=true", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert f"optimizer.name={given} is not a DeepSpeed optimizer type; using adamw" in result.stderr
    assert '"type": "AdamW"' in result.stdout


@pytest.mark.parametrize("platform", ["mps", "rocm"])
def test_platform_without_deepspeed_falls_back_to_ddp(platform: str) -> None:
    report = checks.check(make_cfg("zero=stage3", "offload=cpu"), hardware.PlatformInfo(platform, True, True))
    assert report.ok, report.render()
    assert report.cfg.resolved.backend == "ddp"
    assert report.cfg.resolved.optimizer_state_on == "gpu"
    assert any(f"DeepSpeed does not run on {platform}" in w for w in report.cfg.resolved.warnings)


def test_precision_follows_the_device() -> None:
    no_bf16 = hardware.PlatformInfo("cuda", bf16=False, fp16=True, gpu_name="Tesla V100")
    report = checks.check(make_cfg("precision=bf16"), no_bf16)
    assert [(p.key, p.fix) for p in report.problems] == [("precision", "precision=fp16")]
    assert "V100" in report.problems[0].why
    cpu_without_fp16 = hardware.PlatformInfo("cpu", bf16=True, fp16=False)
    report = checks.check(make_cfg("precision=fp16"), cpu_without_fp16)
    assert [p.key for p in report.problems] == ["precision"]


def test_nvme_path_must_be_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    report = checks.check(make_cfg("zero=stage3", "offload=nvme", f"offload.nvme_path={blocker}/swap"))
    assert [p.key for p in report.problems] == ["offload.nvme_path"]
    assert "cannot be created" in report.problems[0].why


def test_nvme_path_read_only() -> None:
    # /proc exists and nobody, root included, can create a file in it.
    report = checks.check(make_cfg("zero=stage3", "offload=nvme", "offload.nvme_path=/proc"))
    assert [p.key for p in report.problems] == ["offload.nvme_path"]
    assert "not writable" in report.problems[0].why


def test_nvme_free_space_is_checked_against_the_swap_estimate(tmp_path: Path) -> None:
    # sdxl_base at stage 3 with params on NVMe needs ~46 GB of swap; demand it 10^6 times over to be sure.
    report = checks.check(make_cfg("zero=stage3", "offload=nvme", "model=sdxl_base",
                                       f"offload.nvme_path={tmp_path}", "offload.free_space_margin=1e6"))
    assert [p.key for p in report.problems] == ["offload.nvme_path"]
    assert "GiB free" in report.problems[0].why
    assert report.cfg.resolved.nvme_swap_bytes == 2567463684 * 18


def test_stale_swap_folders_are_removed(tmp_path: Path) -> None:
    (tmp_path / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    (tmp_path / "zero_stage_3" / "optimizer" / "rank0" / "0.tensor.swp").write_bytes(b"x" * 10)
    (tmp_path / "keep_me").mkdir()
    removed = nvme.remove_stale_swap(str(tmp_path))
    assert [p.name for p in removed] == ["zero_stage_3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep_me"]


def test_nvme_buffers_hold_the_largest_parameter() -> None:
    count, size = nvme.buffers(max_param_numel=29_491_200, prefetch_bucket=50_000_000)
    assert size >= 29_491_200 and count * size >= 50_000_000 + 29_491_200
    assert count * size * 2 < 2**30  # pinned host memory stays under 1 GiB for SDXL


@pytest.mark.slow
def test_an_unwritable_outputs_folder_is_named_by_the_key_the_user_set(tmp_path: Path) -> None:
    """paths.outputs under /proc (nobody can create a folder there): the message names paths.outputs, not the
    hydra.run.dir the user never set; a hydra.run.dir given is named as itself."""
    for key in ("paths.outputs", "hydra.run.dir"):
        done = run_cli(f"{key}=/proc/ds_trainer_nope", "dry_run=true", cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"  - {key}=/proc/ds_trainer_nope" in done.stderr and f"fix: {key}=<a folder" in done.stderr
