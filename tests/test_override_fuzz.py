"""Property test: hundreds of generated override sets, run as a user runs them (dry run). Each either
runs or exits non-zero with a one-screen message naming a key it was given; none prints a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHOICES = {
    "zero": ["ddp", "stage0", "stage1", "stage2", "stage3", "stage4", "zero3"],
    "offload": ["none", "cpu", "nvme", "tape"],
    "optimizer": ["adamw", "adam", "adagrad", "lion", "lamb", "muon", "sgd"],
    "scheduler": ["warmup", "warmup_decay", "warmup_cosine", "one_cycle", "constant", "linear"],
    "resolution": ["px128", "px512", "px1024", "px100"],
    "precision": ["bf16", "fp16", "fp32", "fp8"],
    "model": ["sdxl_tiny", "sdxl_base", "sd15"],
    "data": ["synthetic", "folder"],
    "logger": ["wandb", "none", "tensorboard"],
}
NUMBERS = ["train.max_steps", "train.micro_batch_size", "train.gradient_accumulation_steps", "resolution.width",
           "resolution.height", "world_size", "train.checkpoint_every", "scheduler.warmup_steps", "zero.stage"]
FLOATS = ["optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "train.gradient_clipping", "train.ema_decay",
          "scheduler.cos_min_ratio", "train.min_snr_gamma"]
STRINGS = ["optimizer.name", "resume", "model.pretrained", "train.ema", "offload.params", "platform", "logger.mode"]
UNKNOWN = ["train.lr", "optimizer.beta1", "zero.stage3_prefetch", "batch_size", "foo.bar"]

text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789AW", min_size=1, max_size=12)
number = st.one_of(st.integers(-10, 5000), st.sampled_from(["abc", "1.5", "1e3", "null"]))
floating = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32).map(lambda f: f"{f!r}"),
                     st.sampled_from(["-1", "0", "1e-4", "2", "x", "null"]))
override = st.one_of(
    st.sampled_from(sorted(CHOICES)).flatmap(lambda g: st.sampled_from(CHOICES[g]).map(lambda o: f"{g}={o}")),
    st.sampled_from(NUMBERS).flatmap(lambda k: number.map(lambda v: f"{k}={v}")),
    st.sampled_from(FLOATS).flatmap(lambda k: floating.map(lambda v: f"{k}={v}")),
    st.sampled_from(STRINGS).flatmap(lambda k: st.one_of(text, st.sampled_from(["latest", "true", "auto", "cpu"]))
                                     .map(lambda v: f"{k}={v}")),
    st.sampled_from(UNKNOWN).flatmap(lambda k: st.sampled_from(["", "+"]).map(lambda plus: f"{plus}{k}=1")),
)
override_sets = st.lists(override, min_size=1, max_size=5, unique_by=lambda o: o.split("=")[0].lstrip("+"))


def _key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+")


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "500")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(overrides=override_sets)
def test_generated_overrides_run_or_fail_with_one_screen_naming_the_key(tmp_path_factory: pytest.TempPathFactory,
                                                                        overrides: list[str]) -> None:
    cwd: Path = tmp_path_factory.mktemp("fuzz")
    result = subprocess.run([sys.executable, "-m", "ds_trainer", *overrides, "dry_run=true",
                             f"offload.nvme_path={cwd}/swap"], cwd=cwd, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, (overrides, output)
    if result.returncode == 0:
        assert (list(cwd.glob("outputs/runs/*/*/config.yaml"))), overrides
        return
    message = result.stderr
    assert len(message.splitlines()) <= 25, (overrides, message)
    named = [_key(o) for o in overrides] + [o.split("=", 1)[1] for o in overrides]
    assert any(part and part in message for part in named), (overrides, message)
