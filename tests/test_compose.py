"""Hydra composition: every option composes, the CLI behaves as any Hydra app, the dry run writes its files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.cfg import group_options, make_cfg
from helpers.cli import run_cli, run_dirs
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from ds_trainer import CONF_DIR
from ds_trainer.config import checks, ds_config


@pytest.mark.parametrize(("group", "option"), group_options())
def test_every_option_composes(group: str, option: str) -> None:
    if group == "lever":  # `+lever=<name>`: a sweep's cell, setting other groups (# @package _global_)
        cfg = make_cfg(f"+lever={option}")
        assert checks.check(cfg).problems == [], option  # no refused cell in +sweep=memory_levers
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        return
    override = f"{group}={option}"
    extra = ["data.path=."] if override == "data=folder" else []
    cfg = make_cfg(override, *extra)
    assert cfg[group] is not None
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def test_every_group_has_options_and_defaults() -> None:
    groups = {g for g, _ in group_options()}
    assert groups == {"zero", "offload", "optimizer", "scheduler", "resolution", "precision", "model", "data",
                      "logger", "adapter", "text_encoders", "quantize", "samples", "validation", "lever"}
    cfg = make_cfg()
    assert (cfg.zero.stage, cfg.offload.device.value, cfg.optimizer.name, cfg.model.name) == (2, "none", "adamw",
                                                                                             "sdxl_tiny")


@pytest.mark.parametrize(("override", "message"), [
    ("train.max_stepz=3", "max_stepz"),
    ("train.max_steps=many", "many"),
    ("offload.device=tape", "tape"),
    ("precision=fp8", "fp8"),
])
def test_typos_and_wrong_types_fail_at_composition(override: str, message: str) -> None:
    with pytest.raises((ConfigCompositionException, MissingConfigException, ValidationError, ConfigKeyError)) as info:
        make_cfg(override)
    assert message in str(info.value) + str(info.value.__cause__)


def test_force_added_keys_are_reported_not_ignored() -> None:
    report = checks.check(make_cfg("+zero.stage3_prefetch=1"))
    assert [p.key for p in report.problems] == ["zero.stage3_prefetch"]
    assert "zero.stage3_prefetch_bucket_size" in report.problems[0].fix


def test_option_files_are_typed_by_the_schema(tmp_path: Path) -> None:
    # A key that is not in a group's schema, written into an option file, fails composition.
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "zero" / "stage2.yaml").write_text("backend: deepspeed\nstage: 2\nbucket_sise: 5\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"), pytest.raises(
            (ConfigCompositionException, ConfigKeyError), match="bucket_sise"):
        compose(config_name="config")


def test_batch_size_and_no_auto_in_the_deepspeed_json() -> None:
    cfg = checks.check(make_cfg("train.micro_batch_size=3", "train.gradient_accumulation_steps=4")).cfg
    ds = ds_config.build(cfg, world_size=8)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (96, 3,
                                                                                                               4)
    assert '"auto"' not in json.dumps(ds)


def test_help_commands_work_as_in_any_hydra_app(workdir: Path) -> None:
    job = run_cli("--cfg", "job", cwd=workdir)
    assert job.returncode == 0, job.stderr
    assert yaml.safe_load(job.stdout)["zero"]["stage"] == 2
    info = run_cli("--info", "defaults", cwd=workdir)
    assert info.returncode == 0, info.stderr
    # The schema first, the groups, then the root config's own values (_self_) last.
    names = re.findall(r"^\| (\S+)\s+\|", info.stdout, flags=re.M)
    assert names.index("ds_trainer_schema") < names.index("zero/stage2") < names.index("logger/wandb") \
        < names.index("config") == len(names) - 1, names


def test_headline_dry_run_writes_the_three_files(workdir: Path) -> None:
    result = run_cli("zero=stage2", "offload=nvme", "dry_run=true", cwd=workdir)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    (run_dir,) = run_dirs(workdir)
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert printed == ds
    # DeepSpeed keeps an NVMe optimizer state in host memory below stage 3: we say so and write what happens.
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "swaps to disk only on stage 3" in result.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["resolved"]["optimizer_state_on"] == "cpu"
    assert any("stage 3" in w for w in config["resolved"]["warnings"])
    accel = yaml.safe_load((run_dir / "accelerate_config.yaml").read_text())
    assert accel["distributed_type"] == "DEEPSPEED"
    assert Path(accel["deepspeed_config"]["deepspeed_config_file"]) == (run_dir / "ds_config.json").resolve()


def test_dry_run_imports_no_heavy_library(workdir: Path) -> None:
    result = run_cli("dry_run=true", cwd=workdir, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hydra" in imported  # the probe works
    assert not imported & {"torch", "deepspeed", "diffusers", "accelerate", "transformers", "wandb"}


def test_runs_started_together_get_their_own_directories(workdir: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "ds_trainer", "dry_run=true"], cwd=workdir,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert len(run_dirs(workdir)) == 3


def test_ddp_writes_no_deepspeed_json(workdir: Path) -> None:
    result = run_cli("zero=ddp", "dry_run=true", "world_size=2", cwd=workdir)
    assert result.returncode == 0, result.stderr
    (run_dir,) = run_dirs(workdir)
    assert not (run_dir / "ds_config.json").exists()
    accel = yaml.safe_load((run_dir / "accelerate_config.yaml").read_text())
    assert accel["num_processes"] == 2 and accel["distributed_type"] == "MULTI_GPU"
    assert "deepspeed_config" not in accel
