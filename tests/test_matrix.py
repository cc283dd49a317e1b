"""Every combination a user composes either trains or is refused before its first step (issue 44).

A cell is one composition of the groups users combine. It passes when it finishes with status ok (a finite loss at
every step, the export or the LoRA file written, samples and a validation loss where asked), or when it exits 2
before its first step with the one-screen refusal (each problem's key, why and fix; no traceback, no step logged).
A crash after training started is a defect, whatever its message.

`make test-long` runs the pairwise covering array of every axis below (allpairspy: every pair of values of any
two axes is in some cell). The default suite runs the covering array of the five axes whose pairs break most
(model, backend, precision, adapter, and samples + validation + EMA together), the other axes at their defaults.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun
from test_buckets import make_folder

from ds_trainer import CONF_DIR

# The full array's axes (make test-long). The first value of each is the default the core cells keep.
AXES: dict[str, list[str]] = {
    "model": ["sdxl_tiny", "sd3_tiny", "flux_tiny"],
    "zero": ["stage2", "ddp", "stage0", "stage1", "stage3", "fsdp_full_shard", "fsdp_shard_grad_op"],
    "offload": ["none", "cpu", "nvme"],
    "precision": ["bf16", "bf16_pure", "fp16", "fp32"],
    "adapter": ["none", "lora"],
    "text_encoders": ["frozen", "lora", "full"],
    "optimizer": ["adamw", *sorted(p.stem for p in (CONF_DIR / "optimizer").glob("*.yaml") if p.stem != "adamw")],
    "ema": ["off", "gpu", "cpu"],
    "samples": ["off", "on"],
    "validation": ["off", "on"],
    "buckets": ["off", "on"],
    "ranks": ["1", "2"],
    "resume": ["none", "another_layout"],
}
# The default suite's axes: a backend stands for its ZeRO option, "extras" for samples, validation and EMA at once.
BACKENDS = {"deepspeed": "stage2", "fsdp": "fsdp_full_shard", "ddp": "ddp"}
CORE: dict[str, list[str]] = {"model": AXES["model"], "backend": list(BACKENDS), "precision": AXES["precision"],
                              "adapter": AXES["adapter"], "extras": ["all", "none"]}
FAST = ["logger=none", "train.max_steps=2", "data.num_samples=4", "scheduler=constant", "train.checkpoint_every=0"]


def covering(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    """The pairwise covering array of `axes` (deterministic: allpairspy is greedy over the values in order)."""
    from allpairspy import AllPairs

    return [dict(zip(axes, row, strict=True)) for row in AllPairs(list(axes.values()))]


TRAINABLE = Path(__file__).parent / "data" / "matrix_trainable.json"


def trainable_covering() -> list[dict[str, str]]:
    """The pairwise covering array of AXES restricted to cells this machine's checks accept: every pair of values
    that can train together here is in a cell that trains (allpairspy's filter asks `config.checks` of each
    partial row, the other axes at their defaults). The full array above pairs everything, so most of its cells
    are refusals; this one is the trained half. Slow to build (a composed config per partial row, minutes): its
    cells are committed in TRAINABLE, and a long test builds it again and compares."""
    from allpairspy import AllPairs

    from ds_trainer.config import checks, portability

    names, known = list(AXES), {}

    def accepted(row: list[str]) -> bool:
        cell = {axis: values[0] for axis, values in AXES.items()} | dict(zip(names, row, strict=False))
        if cell["resume"] != "none" and cell["optimizer"] not in portability.MOMENT_OPTIMIZERS:
            return False  # refused once the checkpoint is read: only Adam's moments carry to another layout
        key = tuple(cell.values())
        if key not in known:
            scratch = Path(tempfile.gettempdir())  # a folder that is there: the checks look for the images' folder
            args = [*FAST, *overrides(cell, scratch, scratch),
                    *([f"world_size={cell['ranks']}"] if cell["ranks"] != "1" else [])]
            known[key] = checks.check(_compose(args)).ok
        return known[key]

    return [dict(zip(names, row, strict=True)) for row in AllPairs(list(AXES.values()), filter_func=accepted)]


def _compose(args: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=args)


def trainable_cells() -> list[dict[str, str]]:
    return json.loads(TRAINABLE.read_text())


def core_cells() -> list[dict[str, str]]:
    """The default suite's cells, each as a full-array cell (the other axes at their defaults)."""
    out = []
    for core in covering(CORE):
        cell = {axis: values[0] for axis, values in AXES.items()}
        cell.update(model=core["model"], zero=BACKENDS[core["backend"]], precision=core["precision"],
                    adapter=core["adapter"])
        if core["extras"] == "all":
            cell.update(ema="cpu", samples="on", validation="on")
        out.append(cell)
    return out


def _name(cell: dict[str, str]) -> str:
    defaults = {axis: values[0] for axis, values in AXES.items()}
    return "-".join(f"{k}={v}" for k, v in cell.items() if v != defaults[k] or k in ("model", "zero", "precision"))


def overrides(cell: dict[str, str], folder: Path, swap: Path) -> list[str]:
    """The command line of a cell (without resume)."""
    out = [f"{axis}={cell[axis]}" for axis in ("model", "zero", "offload", "precision", "adapter", "text_encoders",
                                               "optimizer")]
    if cell["offload"] == "nvme":
        out.append(f"offload.nvme_path={swap}")
    out += {"off": ["train.ema=false"], "gpu": ["train.ema=true", "train.ema_device=gpu"],
            "cpu": ["train.ema=true", "train.ema_device=cpu"]}[cell["ema"]]
    if cell["samples"] == "on":
        out += ["samples=on", "samples.every=0", "samples.steps=2", "samples.prompts=[a red cube]"]
    if cell["validation"] == "on":
        out += ["validation=on", "validation.split=1"]
    if cell["buckets"] == "on":
        out += ["data=folder", f"data.path={folder}", "data.bucket_remainder=repeat"]
    return out


def _launch(cell: dict[str, str], args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    if cell["ranks"] == "1":
        return run_cli(*args, cwd=cwd, timeout=900)
    return subprocess.run([*torchrun(int(cell["ranks"])), "-m", "ds_trainer", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _first_layout(cell: dict[str, str], args: list[str]) -> list[str]:
    """Where a cell's `resume=another_layout` was saved: one rank, another backend, no offload, the cell's own
    optimizer and precision (a resume under another optimizer is refused by design); the first backend of DDP,
    ZeRO-2, ZeRO-1 and FSDP2 that the checks accept for them."""
    from ds_trainer.config import checks

    for zero in ("ddp", "stage2", "stage1", "fsdp_full_shard"):
        if zero != cell["zero"] and checks.check(_compose([*args, f"zero={zero}", "offload=none"])).ok:
            return [f"zero={zero}", "offload=none"]
    return ["zero=stage2" if cell["zero"] == "ddp" else "zero=ddp", "offload=none"]


def run_cell(cell: dict[str, str], tmp_path: Path) -> str:
    """Run a cell; 'trained' or 'refused', or an AssertionError saying what broke."""
    folder, swap = tmp_path / "images", tmp_path / "swap"
    if cell["buckets"] == "on":
        make_folder(folder)
    args = [*FAST, *overrides(cell, folder, swap)]
    if cell["resume"] != "none":
        first = [a for a in args if not a.startswith(("zero=", "offload=", "offload.nvme_path"))]
        saved = run_cli(*first, *_first_layout(cell, first), "train.export=false", cwd=tmp_path, timeout=900)
        if saved.returncode == 2:
            return _refused(saved, tmp_path)
        assert saved.returncode == 0, saved.stderr[-3000:]
        (run_dir,) = run_dirs(tmp_path)
        args = [*args, "train.max_steps=4", f"resume={run_dir / 'checkpoints' / 'step_00000002'}"]  # steps 3, 4
    before = set(run_dirs(tmp_path))
    done = _launch(cell, args, tmp_path)
    if done.returncode == 2 or (cell["ranks"] != "1" and _torchrun_refused(done)):
        return _refused(done, tmp_path, before)
    assert done.returncode == 0, f"{_name(cell)} crashed:\n{done.stderr[-4000:]}"
    (run_dir,) = set(run_dirs(tmp_path)) - before
    _trained(cell, run_dir, 2)
    return "trained"


def _torchrun_refused(done: subprocess.CompletedProcess[str]) -> bool:
    """torchrun exits 1 for a rank's exit 2; its failure block names the first rank's exit code."""
    root = done.stderr.partition("Root Cause (first observed failure)")[2]
    return done.returncode == 1 and re.search(r"exitcode\s*:\s*2\b", root) is not None


def _refused(done: subprocess.CompletedProcess[str], tmp_path: Path, before: set[Path] | None = None) -> str:
    """Exit 2: the one-screen refusal, before any step; said once however many ranks checked it (under
    torchrun, its own failure block follows ours: torchrun's, not a traceback of ds_trainer)."""
    ours = done.stderr.partition("(torchrun's own failure block follows")[0]
    assert "Traceback" not in ours, done.stderr[-3000:]
    assert "why:" in ours and "fix:" in ours, done.stderr[-3000:]
    assert len(re.findall(r"^ds_trainer: \d+ problems? ", ours, re.MULTILINE)) == 1, ours[-3000:]
    for run_dir in set(run_dirs(tmp_path)) - (before or set()):
        rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        assert not [r for r in rows if "loss" in json.loads(r)], f"refused after training started: {run_dir}"
    return "refused"


def _trained(cell: dict[str, str], run_dir: Path, steps: int) -> None:
    """Status ok, a finite loss at every step, and what the cell asked for written."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    lora = cell["adapter"] == "lora" or cell["text_encoders"] == "lora"
    if lora:  # both layouts (adapter.formats' default)
        assert {p.name for p in (run_dir / "lora").glob("*.safetensors")} == {
            "pytorch_lora_weights.safetensors", "kohya.safetensors"}, sorted(p.name for p in run_dir.iterdir())
    if cell["adapter"] == "none":
        component = "unet" if cell["model"] == "sdxl_tiny" else "transformer"
        assert list((run_dir / component).glob("*.safetensors")), sorted(p.name for p in run_dir.iterdir())
        family = cell["model"].removesuffix("_tiny")
        _single_file_is_the_export(run_dir, family, "")
        if cell["ema"] != "off":
            assert list((run_dir / f"{component}_ema").glob("*.safetensors"))
            _single_file_is_the_export(run_dir, family, "_ema")
    card = (run_dir / "README.md").read_text()  # the model card: what trained, the loss, the samples, the files
    assert card.startswith("---\n") and "## What trained" in card and "| file | opens in |" in card, card[:2000]
    if cell["samples"] == "on":
        assert list((run_dir / "samples").rglob("*.png")), "no samples written"
        images = [line.split("](")[1].rstrip(")") for line in card.splitlines() if line.startswith("![")]
        assert images and all((run_dir / image).is_file() for image in images), card
    if cell["validation"] == "on":
        assert math.isfinite(summary["val_loss"]), summary
        assert f"- final: {summary['val_loss']:.5f} at step" in card, card


def _single_file_is_the_export(run_dir: Path, family: str, suffix: str) -> None:
    """export.formats' default: `single_file/model[_ema].safetensors` holds the diffusers export's weights in the
    makers' layout, in bf16 (export.dtype), with the model spec in its header (test_exports: the layouts themselves)."""
    import torch
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel
    from safetensors import safe_open

    from ds_trainer.train.export import single_file

    cls = {"sdxl": UNet2DConditionModel, "sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel}[family]
    component = "unet" if family == "sdxl" else "transformer"
    expected = single_file.denoiser_tensors(family, cls.from_pretrained(run_dir / f"{component}{suffix}"))
    with safe_open(run_dir / "single_file" / f"model{suffix}.safetensors", "pt") as f:
        assert f.metadata()["modelspec.architecture"] and f.metadata()["modelspec.sai_model_spec"]
        for key, value in expected.items():
            assert torch.equal(f.get_tensor(key), value.to(torch.bfloat16)), key


def test_the_default_cells_cover_every_pair_of_the_core_axes() -> None:
    """Each pair of values of any two core axes is in some default cell; the cells are what the array says."""
    cells = covering(CORE)
    for a, b in combinations(CORE, 2):
        missing = {(x, y) for x in CORE[a] for y in CORE[b]} - {(c[a], c[b]) for c in cells}
        assert not missing, (a, b, missing)
    assert len(core_cells()) == len(cells) and len({_name(c) for c in core_cells()}) == len(cells)
    full = covering(AXES)
    assert all(set(c) == set(AXES) for c in full) and len(full) >= len(AXES["optimizer"]) * len(AXES["zero"])


@pytest.mark.slow
@pytest.mark.parametrize("cell", core_cells(), ids=_name)
def test_a_core_cell_trains_or_is_refused_before_its_first_step(cell: dict[str, str], tmp_path: Path,
                                                                record_property: Callable[[str, object], None]) -> None:
    record_property("outcome", run_cell(cell, tmp_path))  # trained or refused: --junitxml counts them


@pytest.mark.slow
@pytest.mark.long
def test_the_committed_trainable_array_is_the_one_the_checks_allow_now() -> None:
    """tests/data/matrix_trainable.json holds trainable_covering()'s cells (a rule or an axis changed: write it again
    with `python -c "import json, test_matrix as m; print(json.dumps(m.trainable_covering(), indent=1))"` from
    tests/)."""
    assert trainable_covering() == trainable_cells()


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("cell", trainable_cells(), ids=_name)
def test_a_cell_the_checks_accept_trains(cell: dict[str, str], tmp_path: Path,
                                         record_property: Callable[[str, object], None]) -> None:
    outcome = run_cell(cell, tmp_path)
    record_property("outcome", outcome)
    assert outcome == "trained", f"{_name(cell)}: the checks accept it, the run refused it later"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("cell", covering(AXES), ids=_name)
def test_a_cell_of_the_full_array_trains_or_is_refused_before_its_first_step(
        cell: dict[str, str], tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    record_property("outcome", run_cell(cell, tmp_path))
