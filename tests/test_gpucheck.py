"""The GPU check (`python -m ds_trainer.gpucheck`): its CPU form in a short run, so the kit works before a GPU
machine exists, and the wheelhouse it is carried with.

One check runs for the module, on a 70 s budget (its last step takes what is left): the machine step with a
timeout it cannot meet, a resume whose source step did not run (it fails), a real-size cell in its CPU form (it
measures), and the Flux step. The tests read what a user reads: results.json and results.md as they are
rewritten, and the calibration lines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg

from ds_trainer.gpucheck.steps import GPU_BUDGET_S, sequence

REPO = Path(__file__).resolve().parents[1]

BUDGET_S = 100  # the real-size cell needs about 15 s on an idle 2-core machine, over 60 s at a load of 8
STEPS = ["machine", "tiny_fsdp_cpu_resume", "sdxl_zero2", "flux_dev_lora"]


@pytest.fixture(scope="module")
def check(module_tmp: Any) -> dict[str, Any]:
    """Run the short CPU check once; what results.json held each time it changed, and the final files."""
    out = module_tmp("gpucheck")
    cmd = [sys.executable, "-m", "ds_trainer.gpucheck", "--cpu", "--out", str(out), "--budget-s", str(BUDGET_S),
           "--only", *STEPS, "--timeout", "machine=3"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[int] = []
    while proc.poll() is None:
        path = out / "results.json"
        if path.exists():
            done = json.loads(path.read_text())["done"]
            if not seen or seen[-1] != done:
                seen.append(done)
        time.sleep(0.2)
    final = json.loads((out / "results.json").read_text())["done"]  # the last writes may fall between two looks
    if not seen or seen[-1] != final:
        seen.append(final)
    output = proc.stdout.read() if proc.stdout else ""
    return {"out": out, "elapsed": time.monotonic() - start, "seen": seen, "output": output, "rc": proc.returncode,
            "results": json.loads((out / "results.json").read_text()),
            "md": (out / "results.md").read_text()}


def _rows(check: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["step"]: row for row in check["results"]["steps"]}


def test_results_are_rewritten_after_every_step(check: dict[str, Any]) -> None:
    """A check cut short keeps what it measured: results.json grew one step at a time while the check ran."""
    # The first two steps end seconds apart; the last two may be written within one look (a skip is immediate).
    assert check["seen"][:2] == [1, 2] and check["seen"] == sorted(check["seen"]), (check["seen"], check["output"])
    assert check["seen"][-1] == len(STEPS)
    assert [row["step"] for row in check["results"]["steps"]] == STEPS
    for step in STEPS:
        assert f"| {step} |" in check["md"]


def test_a_timeout_and_a_failure_are_recorded_and_the_next_step_runs(check: dict[str, Any]) -> None:
    rows = _rows(check)
    assert rows["machine"]["status"] == "timeout"
    assert "no result within 3 s" in rows["machine"]["error"]
    failed = rows["tiny_fsdp_cpu_resume"]
    assert failed["status"] == "failed"
    assert "resume" in failed["error"] and "checkpoint" in failed["error"], failed["error"]
    assert check["rc"] == 1  # a step that did not pass: the check's exit status says so
    assert f"**{failed['error']}**" in check["md"]


def test_a_real_size_cell_is_measured_against_the_planner(check: dict[str, Any]) -> None:
    """The CPU form's real-size cell: s/it after warm-up, host RSS, the planner's estimate from the run's own log,
    and a calibration line in the tuner's form."""
    row = _rows(check)["sdxl_zero2"]
    assert row["status"] == "ok", row
    assert row["s_per_it"] > 0 and row["host_rss_gib"] > 0.1
    assert row["plan_gib"] > 0 and row["plan"]["activations"] > 0
    assert row["gpu_alloc_gib"] is None and row["measured_over_planned"] is None  # no GPU: nothing to hold it to
    records = [json.loads(line) for line in (check["out"] / "plan_calibration.jsonl").read_text().splitlines()]
    assert [r["cell"] for r in records] == ["gpucheck-sdxl_zero2"]
    record = records[0]
    assert record["model"] == "sdxl_tiny" and record["device"] == "cpu" and record["zero"] == "stage2"
    assert record["measure"] == "host_rss_loop" and record["measured_activation_bytes"] > 0
    assert record["predicted_activation_bytes"] == int(row["plan"]["activations"] * 2**30)


def test_the_budget_holds(check: dict[str, Any]) -> None:
    """The last step runs on what the others left, and the whole check ends within its budget."""
    rows = check["results"]["steps"]
    assert check["elapsed"] <= BUDGET_S + 5
    assert sum(row.get("elapsed_s", 0) for row in rows) <= BUDGET_S
    flux = rows[-1]
    used = sum(row.get("elapsed_s", 0) for row in rows[:-1])
    if flux["status"] == "skipped":
        assert "budget spent" in flux["error"]
    else:
        assert flux["timeout_s"] > 90 or flux["timeout_s"] <= BUDGET_S - used  # greedy, capped by the budget


def test_the_gpu_sequence_fits_its_budget_and_composes() -> None:
    """Every step of both sequences composes as a config here (a typo would waste a GPU lease), and the GPU
    sequence's timeouts sum to at most its budget (575 s)."""
    gpu = sequence(cpu=False)
    assert sum(step.timeout_s for step in gpu) <= GPU_BUDGET_S
    assert [s.name for s in gpu] == [s.name for s in sequence(cpu=True)]
    for step in gpu + sequence(cpu=True):
        if step.kind == "train":
            cfg = make_cfg(*step.args)
            assert str(cfg.model.name) == step.overrides.get("model", "sdxl_tiny")


WHEELHOUSE = REPO / ".wheelhouse"
# Building the wheelhouse needs the network: without one already built this is a `make test-long` test.
_long_unless_built = (lambda test: test) if (WHEELHOUSE / "core").is_dir() else pytest.mark.long


@_long_unless_built
def test_wheelhouse_core_installs_offline_and_runs_the_check(tmp_path: Path) -> None:
    """The core set installs without network into a clean folder, and with it (and this machine's torch) the
    check's CPU form trains: what the GPU machine does with it."""
    if not (WHEELHOUSE / "core").is_dir():
        subprocess.run([sys.executable, "-m", "ds_trainer.gpucheck.wheelhouse", "--out", str(WHEELHOUSE),
                        "--constraints", str(REPO / "constraints.txt"), "--sets", "core"], cwd=REPO, check=True)
    target = tmp_path / "site"
    wheels = sorted(str(w) for w in (WHEELHOUSE / "core").glob("*.whl"))
    # As the GPU machine installs them (CPython 3.12 on a glibc the wheelhouse's platforms cover; torchao's wheel is
    # manylinux_2_28): pip checks every wheel's tags against that interpreter.
    from ds_trainer.gpucheck.wheelhouse import PLATFORMS

    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--only-binary=:all:",
                    *platforms, *wheels], check=True)
    if sys.version_info[:2] != (3, 12):  # a cp312 extension (pydantic_core) does not load here: this Python's own
        for wheel in (WHEELHOUSE / "core").glob("*-cp312-*.whl"):  # build of the same pinned version stands in
            name, version = wheel.name.split("-")[:2]
            assert metadata.version(name) == version, f"this Python's {name} is not the pinned {version}"
            for path in [target / name, *target.glob(f"{name}-*.dist-info")]:
                shutil.rmtree(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(target)])}
    code = ("import deepspeed, diffusers, hydra, omegaconf, pydantic, ds_trainer.cli, ds_trainer.train.recipe; "
            "print('FROM', deepspeed.__file__, diffusers.__file__, hydra.__file__, omegaconf.__file__, "
            "pydantic.__file__)")  # DeepSpeed prints its accelerator on stdout too
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    where = next(line for line in printed if line.startswith("FROM ")).split()[1:]
    assert len(where) == 5 and all(path.startswith(str(target)) for path in where), where
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "ds_trainer.gpucheck", "--cpu", "--out", str(out), "--only",
                           "tiny_ddp", "--timeout", "tiny_ddp=300"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=400)
    row = json.loads((out / "results.json").read_text())["steps"][0]
    assert row["status"] == "ok", (row, proc.stdout[-2000:])
