"""The written accelerate_config.yaml drives `accelerate launch --config_file` on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli import run_cli, run_dirs
from helpers.ranks import free_port

SCRIPT = Path(__file__).parent / "scripts" / "one_step.py"


def launch(config: Path, cwd: Path) -> list[dict]:
    out = cwd / "one_step"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")} | {"ONE_STEP_OUT": str(out)}
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                             "--main_process_port", str(free_port()), str(SCRIPT)], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "stage", "world"), [
    # DeepSpeed's yaml (one rank of ZeRO-2 with offload, two of ZeRO-3) in make test-long, for the CI budget (111 s):
    # test_train's accelerate launch drives DeepSpeed's by default.
    pytest.param(["zero=stage2", "offload=cpu"], 2, 1, marks=pytest.mark.long),
    pytest.param(["zero=stage3", "world_size=2"], 3, 2, marks=pytest.mark.long),
    (["zero=ddp", "world_size=2"], None, 2),
    (["zero=fsdp_shard_grad_op", "world_size=2"], None, 2),
])
def test_accelerate_config_drives_a_step(workdir: Path, overrides: list[str], stage: int | None, world: int) -> None:
    dry = run_cli(*overrides, "dry_run=true", cwd=workdir)
    assert dry.returncode == 0, dry.stderr
    (run_dir,) = run_dirs(workdir)
    steps = launch(run_dir / "accelerate_config.yaml", workdir)
    assert sorted(s["rank"] for s in steps) == list(range(world))
    for step in steps:
        assert step["world"] == world and step["zero_stage"] == stage and step["mixed_precision"] == "bf16"
        assert ("DEEPSPEED" in step["distributed_type"]) == (stage is not None)
        fsdp = "fsdp" in overrides[0]
        assert ("FSDP" in step["distributed_type"]) == fsdp
        if fsdp:  # the yaml's FSDP fields reached the plugin Accelerate built from them
            assert step["fsdp"] == {"version": 2, "reshard_after_forward": False, "units": 2}
