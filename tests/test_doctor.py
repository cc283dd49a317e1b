"""`python -m ds_trainer.doctor`: the pre-flight of a machine, and the CUDA-toolkit facts training acts on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers.cli import run_cli
from test_reliability import _tmpfs

from ds_trainer.config import toolkit


def doctor(*overrides: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ds_trainer.doctor", *overrides], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from _tmpfs(tmp_path / "small", "200m")


def test_this_machine_can_start_the_default_run_and_the_doctor_says_what_it_loads(tmp_path: Path) -> None:
    result = doctor(cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "ds_trainer doctor: zero=stage2 offload=none optimizer=adamw precision=bf16 on cpu, 1 rank(s)" in out
    assert "GPUs: none seen by torch (this run trains on the CPU)" in out
    assert "DeepSpeed ops this run loads: fused_adam " in out and "deepspeed_shm_comm " in out
    assert f"disk at {tmp_path / 'outputs'}:" in out and "PROBLEM" not in out
    assert out.rstrip().endswith("ds_trainer doctor: the configured run can start")
    assert result.stderr == ""  # nothing of the libraries' on the terminal


def test_what_would_stop_a_run_is_a_problem_with_its_fix_and_exit_status_2(tmp_path: Path, small_disk: Path) -> None:
    # A GPU configuration on this CPU machine: no CUDA torch, and Lion's fused kernel cannot be compiled.
    gpu = doctor("platform=cuda", "optimizer=lion", cwd=tmp_path)
    assert gpu.returncode == 2, gpu.stdout + gpu.stderr
    assert "PROBLEM: platform=cuda but the installed torch is a CPU build" in gpu.stdout
    assert "PROBLEM: optimizer.name=lion: DeepSpeed compiles its fused lion kernel (fused_lion) with nvcc" in gpu.stdout
    assert "or offload=cpu (DeepSpeed's C++ CPU Lion)" in gpu.stdout
    # Three checkpoints of the tiny model (135 MiB each) do not fit a 200 MiB disk: said before the run.
    full = doctor(f"paths.outputs={small_disk}/outputs", cwd=tmp_path)
    assert full.returncode == 2, full.stdout + full.stderr
    assert f"PROBLEM: {small_disk}/outputs has 200 MiB free and the run writes up to" in full.stdout
    assert "fix: paths.outputs=<a folder with" in full.stdout and "train.checkpoints_to_keep=1" in full.stdout
    # DeepSpeed's ops not built and no compiler to build them: refused before any model loads, by the doctor
    # and by the run itself (the same one screen as a bad override).
    bare = {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "no_ops")}
    run = subprocess.run([sys.executable, "-m", "ds_trainer", "offload=cpu", "logger=none"], cwd=tmp_path, env=bare,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "DeepSpeed's ops cpu_adam, deepspeed_shm_comm are not built" in run.stderr
    assert "missing a C++ compiler (CXX or c++)" in run.stderr and "then `make ops`" in run.stderr
    assert not list(tmp_path.glob("outputs/cache/*"))  # nothing was loaded or encoded
    said = subprocess.run([sys.executable, "-m", "ds_trainer.doctor", "offload=cpu"], cwd=tmp_path, env=bare,
                          capture_output=True, text=True, timeout=300).stdout
    assert "PROBLEM: zero=stage2: DeepSpeed's ops cpu_adam, deepspeed_shm_comm are not built" in said
    assert said.count("PROBLEM") == said.count("fix: apt-get install g++") == 1, said  # one cause, said once
    # A mistake in the overrides: the configuration's one screen, exit 2, no traceback.
    typo = doctor("zero=stage9", cwd=tmp_path)
    assert typo.returncode == 2 and "zero has no option 'stage9'" in typo.stderr and "Traceback" not in typo.stderr


def test_a_gpu_run_without_a_matching_cuda_toolkit_uses_torch_adamw_and_records_it(tmp_path: Path) -> None:
    """The dry run of a GPU configuration here (a CPU torch: nothing can compile CUDA ops) shows the fallback
    training takes: torch's AdamW instead of compiling FusedAdam, said and recorded in config.yaml."""
    result = run_cli("platform=cuda", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ds = json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"] is True
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["resolved"]
    assert resolved["torch_adam"] is True
    assert any("DeepSpeed's FusedAdam cannot be compiled here" in w for w in resolved["warnings"])
    assert "using torch's AdamW instead" in result.stderr
    # Offloaded, the optimizer steps in DeepSpeed's C++ CPU Adam, which needs no nvcc: no fallback.
    offloaded = run_cli("platform=cuda", "offload=cpu", "dry_run=true", f"hydra.run.dir={tmp_path / 'off'}",
                        cwd=tmp_path)
    assert offloaded.returncode == 0, offloaded.stderr[-3000:]
    assert "torch_adam" not in json.loads((tmp_path / "off" / "ds_config.json").read_text())["optimizer"]["params"]
    # On the CPU, DeepSpeed's FusedAdam is a C++ op: nothing changes.
    cpu = run_cli("dry_run=true", f"hydra.run.dir={tmp_path / 'cpu'}", cwd=tmp_path)
    assert cpu.returncode == 0 and "FusedAdam" not in cpu.stderr, cpu.stderr[-3000:]
    assert "torch_adam" not in json.loads((tmp_path / "cpu" / "ds_config.json").read_text())["optimizer"]["params"]


def test_cuda_toolkit_rules_are_deepspeeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toolkit found as torch finds it, its nvcc's release read by running it, and DeepSpeed's rule: the
    same major.minor as torch, or both in DeepSpeed's list of compatible minors, or DS_SKIP_CUDA_CHECK=1."""
    home = tmp_path / "cuda-12.4"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert toolkit.cuda_home() == str(home) and toolkit.nvcc_release(str(home)) == "12.4"
    rules = toolkit.probe().minor_mismatch_ok  # read from the installed DeepSpeed
    assert "12.4" in rules[12] and "12.8" in rules[12]

    def kit(torch_cuda: str | None, nvcc_release: str | None = "12.4", where: str | None = str(home)) -> str | None:
        return toolkit.Toolkit(torch_cuda, where, nvcc_release, rules, frozenset()).problem

    assert kit("12.4") is None and kit("12.8") is None  # the same family: DeepSpeed accepts it
    assert "is 12.4 and torch was built with CUDA 13.0; DeepSpeed refuses" in (kit("13.0") or "")
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")
    assert kit("13.0") is None
    assert "no CUDA toolkit" in (kit("12.8", None, None) or "")
    assert "nvcc cannot be run" in (kit("12.8", None) or "")
    assert toolkit.Toolkit("12.8", None, None, rules, frozenset({"fused_adam"})).can_compile("fused_adam")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", str(home / "bin") + os.pathsep + os.environ["PATH"])
    assert toolkit.cuda_home() == str(home)  # nvcc on PATH: its folder's parent, as torch does
