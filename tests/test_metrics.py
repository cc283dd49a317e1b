"""Metrics as a user reads them: metrics.jsonl, summary.json, the W&B offline file, the oom path."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wandb_log
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs, terminal_chatter
from test_train import metrics, summary

pytest.importorskip("torch")
STEPS = ["train.max_steps=5", "data.num_samples=8"]


@pytest.mark.slow
def test_offline_wandb_run_holds_the_same_values_as_metrics_jsonl(workdir: Path) -> None:
    result = run_cli("zero=stage2", "offload=cpu", *STEPS, cwd=workdir)  # logger=wandb, mode=offline: defaults
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = metrics(run_dir)
    history = wandb_log.history(wandb_file)
    assert [h["_step"] for h in history] == [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row, logged in zip(rows, history, strict=True):
        for key, value in row.items():
            if key != "step":
                assert logged[key] == pytest.approx(value, rel=1e-6), key
        assert {"loss", "lr", "grad_norm", "s_per_it", "data_wait_s", "images_per_s", "host_rss_peak_mib"} <= set(row)
    run = wandb_log.run_info(wandb_file)
    assert run.run_id == (run_dir / "wandb_id.txt").read_text()
    assert run.display_name == "data.num_samples=8,offload=cpu,train.max_steps=5,zero=stage2"
    config = wandb_log.config(wandb_file)
    assert config["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["config"]["resolved"]["optimizer_state_on"] == "cpu"


@pytest.mark.slow
def test_summary_says_what_ran_and_how_fast(workdir: Path) -> None:
    result = run_cli("logger=none", "zero=stage3", "train.micro_batch_size=2", *STEPS, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(workdir)
    s = summary(run_dir)
    rows = metrics(run_dir)
    assert s["status"] == "ok" and s["message"] is None and s["steps"] == 5
    assert (s["zero"], s["offload"], s["resolution"], s["micro_batch_size"], s["precision"], s["world_size"]) == \
        ("stage3", "none", "128x128", 2, "bf16", 1)
    from ds_trainer.train.families import sdxl

    # What trained, counted whole though ZeRO-3 partitioned it as it was built (the tiny UNet, every parameter).
    assert s["trained_parameters"] == {"unet": sum(p.numel() for p in sdxl.load_unet(make_cfg()).parameters())}
    timed = sorted(r["s_per_it"] for r in rows[2:])  # warm-up steps excluded
    assert s["median_s_per_it"] == pytest.approx(timed[len(timed) // 2])
    assert s["host_rss_peak_mib"] == max(r["host_rss_peak_mib"] for r in rows)
    assert "gpu_mem_peak_allocated_mib" not in s  # no GPU here: absent, never zero
    # The terminal shows ds_trainer alone; the libraries' known messages (ZeRO-3's per-step FutureWarning of
    # torch, DeepSpeed's and diffusers' notes) are in the run's log file, once each.
    assert terminal_chatter(result.stderr) == []
    log_text = (run_dir / "ds_trainer.log").read_text()
    assert log_text.count("`torch.distributed.reduce_scatter_tensor` is deprecated") == 1
    assert "Attempting to get learning rate from scheduler before it has started" in log_text
    assert "deepspeed_shm_comm_op built successfully" in log_text and result.stdout == ""


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(workdir: Path) -> None:
    first = run_cli("train.checkpoint_every=2", "train.max_steps=2", "data.num_samples=8", cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("train.checkpoint_every=2", "train.max_steps=4", "data.num_samples=8", "resume=latest",
                     cwd=workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert terminal_chatter(first.stderr) == terminal_chatter(second.stderr) == []  # the default job, quiet
    a, b = run_dirs(workdir)
    assert (a / "wandb_id.txt").read_text() == (b / "wandb_id.txt").read_text()
    (wandb_file,) = b.glob("wandb/offline-run-*/run-*.wandb")
    assert [h["_step"] for h in wandb_log.history(wandb_file)] == [3, 4]
    assert f"W&B offline: `wandb sync {wandb_file.parent}` uploads it" in second.stderr  # its 25-line table is not


@pytest.mark.slow
def test_out_of_memory_ends_with_status_oom_and_advice(workdir: Path) -> None:
    # A real allocation failure: the run gets 4 GiB of address space and a batch that needs far more.
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    args = ["logger=none", "train.max_steps=3", "resolution=px1024", "train.micro_batch_size=16",
            "data.num_samples=16", "data.cache=false"]
    result = subprocess.run([sys.executable, "-m", "ds_trainer", *args], cwd=workdir, preexec_fn=limit,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (run_dir,) = run_dirs(workdir)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "oom"
    assert "out of memory with zero=stage2 offload=none resolution=1024x1024 train.micro_batch_size=16" in s["message"]
    for advice in ("zero=stage3", "offload=cpu", "train.gradient_checkpointing=true", "train.micro_batch_size=8"):
        assert advice in s["message"]
    assert result.stderr.count(s["message"]) == 1
