"""Every combination a user composes either trains or is refused before its first step (issues 44, 60).

A cell is one composition of the groups users combine. It passes when it finishes with status ok (a finite loss at
every step, the export or the LoRA file written, samples and a validation loss where asked), or when it exits 2
before its first step with the one-screen refusal (each problem's key, why and fix; no traceback, no step logged).
A crash after training started is a defect, whatever its message.

The axes are read from the registries (the family specs, the adapter methods, the quantized bases, the backends, the
config groups' options, the data source kinds), so a new entry is paired with every other value without a change
here. `make test-long` runs the pairwise covering array of every axis below (allpairspy: every pair of values of any
two axes is in some cell), and the trained half of it. The default suite trains every pair of family, adapter
method, quantized base, backend and precision that this machine's checks accept, in the cells of
tests/data/matrix_core.json (samples, validation and EMA on in some), and checks that each pair no cell can train is
refused before its first step.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from itertools import combinations, product
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import sources
from helpers.cli import run_cli, run_dirs
from helpers.ranks import torchrun
from test_buckets import make_folder

from ds_trainer import CONF_DIR
from ds_trainer.config import families, source_kinds
from ds_trainer.config.choices import AdapterMethod, Backend, Compile, QuantizeKind


def _options(group: str) -> list[str]:
    """A config group's options, the default first (conf/config.yaml's defaults list)."""
    default = next(next(iter(d.values())) for d in yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
                   if isinstance(d, dict) and next(iter(d)) == group)
    return [default, *sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if p.stem != default)]


def _option(group: str, name: str) -> dict[str, Any]:
    return yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text()) or {}


def tiny_models() -> list[str]:
    """The model options at a tiny size (`about.tiny`), the default first."""
    return [m for m in _options("model") if _option("model", m).get("about", {}).get("tiny")]


def tiny_model(family: str) -> str:
    """A family's tiny model option: `<family>_tiny` (test_the_axes_follow_the_registries: every family has one)."""
    return f"{family}_tiny"


def family_of(model: str) -> str:
    return str(_option("model", model).get("family", "sdxl"))  # ModelConfig's default family


def zero_option(backend: str) -> str:
    """The `zero` option that stands for a backend: the default where it is that backend's, else its first."""
    return next(z for z in _options("zero") if _option("zero", z)["backend"] == backend)


def _default_first(values: list[str], default: str) -> list[str]:
    return [default, *[v for v in values if v != default]]


# The full array's axes (make test-long). The first value of each is the default the core cells keep.
AXES: dict[str, list[str]] = {
    "model": tiny_models(),
    "zero": _options("zero"),
    "offload": _options("offload"),
    "precision": _options("precision"),
    "adapter": _options("adapter"),
    "quantize": _options("quantize"),
    "text_encoders": _options("text_encoders"),
    "optimizer": _options("optimizer"),
    "compile": [c.value for c in Compile],
    "ema": ["off", "gpu", "cpu"],
    "samples": ["off", "on"],
    "validation": ["off", "on"],
    "source": ["synthetic", *source_kinds.KINDS],
    "ranks": ["1", "2"],
    "resume": ["none", "another_layout"],
}
# The default suite's axes: a family stands for its tiny model, a backend for its ZeRO option, an adapter method
# for its option, "extras" for samples, validation and EMA at once.
CORE: dict[str, list[str]] = {
    "family": list(families.NAMES),
    "adapter": [m.value for m in AdapterMethod],
    "quantize": [q.value for q in QuantizeKind],
    "backend": _default_first([b.value for b in Backend], str(_option("zero", _options("zero")[0])["backend"])),
    "precision": _options("precision"),
    "extras": ["none", "all"],
}
FAST = ["logger=none", "train.max_steps=2", "data.num_samples=4", "scheduler=constant", "train.checkpoint_every=0"]


def covering(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    """The pairwise covering array of `axes` (deterministic: allpairspy is greedy over the values in order)."""
    from allpairspy import AllPairs

    return [dict(zip(axes, row, strict=True)) for row in AllPairs(list(axes.values()))]


TRAINABLE = Path(__file__).parent / "data" / "matrix_trainable.json"
CORE_CELLS = Path(__file__).parent / "data" / "matrix_core.json"
# The committed arrays are the answers for a CPU without fp16 kernels, whatever CPU checks them: CI's machines
# differ, and one with AMX-FP16 accepts precision=fp16 (a pair committed as refused).
MATRIX_CPU = {"kind": "cpu", "bf16": True, "fp16": False}


def _check(cfg: Any) -> Any:
    """The config checks on the matrix's CPU (MATRIX_CPU)."""
    from ds_trainer.config import checks, hardware

    return checks.check(cfg, hardware.PlatformInfo(**MATRIX_CPU))


def _problems(cell: dict[str, str], known: dict[tuple[str, ...], list[Any]], scratch: Path) -> list[Any]:
    """What the checks find in a full-array cell on MATRIX_CPU, and what the CLI finds in its model before a run
    (`known`: the answers so far, by cell)."""
    key = tuple(cell.values())
    if key not in known:
        args = [*FAST, *overrides(cell, scratch, scratch / "swap"),
                *([f"world_size={cell['ranks']}"] if cell["ranks"] != "1" else [])]
        report = _check(_compose(args))
        known[key] = report.problems
        if report.ok:  # what needs the model's module names (adapter.targets), as the CLI asks before a run
            from ds_trainer.train.adapters import adapter

            known[key] = adapter.inspect(report.cfg)[0]
    return known[key]


def _accepts(cell: dict[str, str], known: dict[tuple[str, ...], list[Any]], scratch: Path) -> bool:
    """Whether this machine's checks accept a full-array cell."""
    from ds_trainer.config import portability

    if cell["resume"] != "none" and cell["optimizer"] not in portability.MOMENT_OPTIMIZERS:
        return False  # refused once the checkpoint is read: only Adam's moments carry to another layout
    return not _problems(cell, known, scratch)


def trainable_covering() -> list[dict[str, str]]:
    """The pairwise covering array of AXES restricted to cells this machine's checks accept: every pair of values
    that can train together here is in a cell that trains (allpairspy's filter asks `config.checks` of each
    partial row, the other axes at their defaults). The full array above pairs everything, so most of its cells
    are refusals; this one is the trained half. Slow to build (a composed config per partial row, minutes): its
    cells are committed in TRAINABLE, and a long test builds it again and compares."""
    from allpairspy import AllPairs

    names, known = list(AXES), {}
    defaults = {axis: values[0] for axis, values in AXES.items()}
    with tempfile.TemporaryDirectory() as scratch:  # the sources the checks read, written once
        def accepted(row: list[str]) -> bool:
            return _accepts(defaults | dict(zip(names, row, strict=False)), known, Path(scratch))

        return [dict(zip(names, row, strict=True)) for row in AllPairs(list(AXES.values()), filter_func=accepted)]


def _compose(args: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from ds_trainer.config import rundir, schema

    rundir.register_resolvers()  # as conftest.py does (the arrays are built from the command line too)
    schema.register()

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=args)


def trainable_cells() -> list[dict[str, str]]:
    return json.loads(TRAINABLE.read_text())


def as_cell(core: dict[str, str]) -> dict[str, str]:
    """A core cell as a full-array cell: the family's tiny model, the backend's ZeRO option, the method's adapter
    option, the other axes at their defaults ("extras": samples, validation and the EMA on)."""
    cell = {axis: values[0] for axis, values in AXES.items()}
    cell.update(model=tiny_model(core["family"]), zero=zero_option(core["backend"]), precision=core["precision"],
                adapter=core["adapter"], quantize=core["quantize"])
    if core["extras"] == "all":
        cell.update(ema="cpu", samples="on", validation="on")
    return cell


def core_covering() -> dict[str, Any]:
    """What tests/data/matrix_core.json holds: `cells`, the pairwise covering array of CORE restricted to cells this
    machine's checks accept (allpairspy's greedy array, then the product's cells that cover the most pairs that can
    train and that array left out), and `refused`, each pair of CORE values that no cell of the whole product trains
    here, with the first problem of the cell that has the fewest (minutes to build: the product is checked cell by
    cell)."""
    from allpairspy import AllPairs

    names, known = list(CORE), {}
    defaults = {axis: values[0] for axis, values in CORE.items()}

    def pairs_of(core: dict[str, str]) -> set[tuple[str, str, str, str]]:
        return {(a, core[a], b, core[b]) for a, b in combinations(names, 2)}

    with tempfile.TemporaryDirectory() as scratch:
        trainable: list[dict[str, str]] = []
        why: dict[tuple[str, str, str, str], tuple[int, str]] = {}  # (problems, the first): the fewest's
        for row in product(*CORE.values()):
            core = dict(zip(names, row, strict=True))
            problems = _problems(as_cell(core), known, Path(scratch))
            if not problems:
                trainable.append(core)
                continue
            reason = (len(problems), f"{problems[0].key}={problems[0].value}: {problems[0].why}")
            why.update({pair: reason for pair in pairs_of(core) if pair not in why or reason < why[pair]})

        def accepted(row: list[str]) -> bool:
            return _accepts(as_cell(defaults | dict(zip(names, row, strict=False))), known, Path(scratch))

        cells = [dict(zip(names, row, strict=True)) for row in AllPairs(list(CORE.values()), filter_func=accepted)]
    covered = set().union(*map(pairs_of, cells))
    while trainable and (best := max(trainable, key=lambda core: len(pairs_of(core) - covered))):
        if not pairs_of(best) - covered:  # the cells that cover the most pairs left out, until none is
            break
        cells.append(best)
        covered |= pairs_of(best)
    refused = {f"{a}={x} {b}={y}": reason for (a, x, b, y), (_, reason) in sorted(why.items())
               if (a, x, b, y) not in covered}
    return {"cells": cells, "refused": refused}


def core_cells() -> list[dict[str, str]]:
    return json.loads(CORE_CELLS.read_text())["cells"]


def _name(cell: dict[str, str]) -> str:
    defaults = {axis: values[0] for axis, values in AXES.items()}
    return "-".join(f"{k}={v}" for k, v in cell.items() if v != defaults.get(k) or k in ("model", "zero", "precision"))


def _core_name(core: dict[str, str]) -> str:
    return "-".join(core.values())


def _source(cell: dict[str, str], root: Path) -> list[str]:
    """The data of a cell's source kind, written under `root` (once), as overrides."""
    kind = cell["source"]
    if kind == "synthetic":
        return []
    if kind == "folder":
        if not (root / "images").is_dir():
            make_folder(root / "images")
        return ["data=folder", f"data.path={root / 'images'}", "data.bucket_remainder=repeat"]
    written = {"table": "jsonl"}.get(kind, kind)  # a table as its simplest file (test_sources: every format)
    marker = root / f"{kind}.path"
    if not marker.exists():
        marker.write_text(sources.make(written, root / kind))
    return ["data=sources", sources.override([{"path": marker.read_text()}]), "data.bucket_remainder=repeat"]


def overrides(cell: dict[str, str], root: Path, swap: Path) -> list[str]:
    """The command line of a cell (without resume); its data written under `root`."""
    out = [f"{axis}={cell[axis]}" for axis in ("model", "zero", "offload", "precision", "adapter", "quantize",
                                               "text_encoders", "optimizer")]
    if cell["offload"] == "nvme":
        out.append(f"offload.nvme_path={swap}")
    out += {"off": ["train.ema=false"], "gpu": ["train.ema=true", "train.ema_device=gpu"],
            "cpu": ["train.ema=true", "train.ema_device=cpu"]}[cell["ema"]]
    if cell["compile"] != "none":
        out.append(f"train.compile={cell['compile']}")
    if cell["samples"] == "on":
        out += ["samples=on", "samples.every=0", "samples.steps=2", "samples.prompts=[a red cube]"]
    if cell["validation"] == "on":
        out += ["validation=on", "validation.split=1"]
    return out + _source(cell, root)


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
    args = [*FAST, *overrides(cell, tmp_path, tmp_path / "swap")]
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
    if cell["adapter"] != "none" or cell["text_encoders"] == "lora":  # each of adapter.formats, as recorded
        asked = yaml.safe_load((run_dir / "config.yaml").read_text())["adapter"]["formats"]
        files = {"diffusers": "pytorch_lora_weights.safetensors", "kohya": "kohya.safetensors"}
        assert {p.name for p in (run_dir / "lora").glob("*.safetensors")} == {files[f] for f in asked}, \
            sorted(p.name for p in run_dir.iterdir())
    if cell["adapter"] == "none":
        family = family_of(cell["model"])
        component = families.spec(family).component
        assert list((run_dir / component).glob("*.safetensors")), sorted(p.name for p in run_dir.iterdir())
        _single_file_is_the_export(run_dir, family, "")
        if cell["ema"] != "off":
            assert list((run_dir / f"{component}_ema").glob("*.safetensors"))
            _single_file_is_the_export(run_dir, family, "_ema")
    card = (run_dir / "README.md").read_text()  # the model card: what trained, the loss, the samples, the files
    assert card.startswith("---\n") and "## What trained" in card and "| file | opens in |" in card, card[:2000]
    if cell["samples"] == "on":
        assert list((run_dir / "samples").rglob("*.png")), "no samples written"
        # an image shown (![...](...png)), a video linked ([... (video)](...mp4))
        shown = [line for line in card.splitlines() if line.startswith("![") or "(video)](" in line]
        files = [line.split("](")[1].rstrip(")") for line in shown]
        assert files and all((run_dir / file).is_file() for file in files), card
    if cell["validation"] == "on":
        assert math.isfinite(summary["val_loss"]), summary
        assert f"- final: {summary['val_loss']:.5f} at step" in card, card


def _single_file_is_the_export(run_dir: Path, family: str, suffix: str) -> None:
    """export.formats' default: `single_file/model[_ema].safetensors` holds the diffusers export's weights in the
    makers' layout, in bf16 (export.dtype), with the model spec in its header (test_exports: the layouts themselves)."""
    import diffusers
    import torch
    from safetensors import safe_open

    from ds_trainer.train.export import single_file

    spec = families.spec(family)
    cls, component = getattr(diffusers, spec.module_classes[0]), spec.component
    expected = single_file.denoiser_tensors(family, cls.from_pretrained(run_dir / f"{component}{suffix}"))
    with safe_open(run_dir / "single_file" / f"model{suffix}.safetensors", "pt") as f:
        assert f.metadata()["modelspec.architecture"] and f.metadata()["modelspec.sai_model_spec"]
        for key, value in expected.items():
            assert torch.equal(f.get_tensor(key), value.to(torch.bfloat16)), key


def test_the_axes_follow_the_registries() -> None:
    """Each family has a tiny model option, each adapter method and quantized base an option of its name, each
    backend a ZeRO option, each source kind a writer here: an entry added to a registry joins the matrix."""
    assert {family_of(tiny_model(f)) for f in CORE["family"]} == set(CORE["family"]) == set(families.NAMES)
    assert {family_of(m) for m in AXES["model"]} == set(families.NAMES)
    assert {str(_option("adapter", m).get("method", m)) for m in CORE["adapter"]} == set(CORE["adapter"])
    assert set(CORE["quantize"]) == set(AXES["quantize"])
    assert {_option("zero", zero_option(b))["backend"] for b in CORE["backend"]} == {b.value for b in Backend}
    assert set(AXES["source"]) == {"synthetic", *source_kinds.KINDS}
    with tempfile.TemporaryDirectory() as root:
        assert all(_source({"source": kind}, Path(root)) or kind == "synthetic" for kind in AXES["source"])


def test_the_default_cells_cover_every_pair_the_checks_let_train() -> None:
    """Each pair of values of any two core axes is in a committed default cell, or refused by tests/data/
    matrix_core.json's list; the full array covers every pair of AXES."""
    committed = json.loads(CORE_CELLS.read_text())
    cells, refused = committed["cells"], committed["refused"]
    for a, b in combinations(CORE, 2):
        missing = {(x, y) for x in CORE[a] for y in CORE[b]} - {(c[a], c[b]) for c in cells}
        assert not {f"{a}={x} {b}={y}" for x, y in missing} - refused.keys(), (a, b, missing)
    assert len({_core_name(c) for c in cells}) == len(cells)
    full = covering(AXES)
    assert all(set(c) == set(AXES) for c in full) and len(full) >= len(AXES["optimizer"]) * len(AXES["zero"])


def test_a_pair_no_cell_can_train_is_refused_before_its_first_step() -> None:
    """Each pair matrix_core.json lists as refused is refused by the checks with the other core axes at their
    defaults (the one-screen refusal of test_cli), and each committed cell is accepted."""
    committed = json.loads(CORE_CELLS.read_text())
    defaults = {axis: values[0] for axis, values in CORE.items()}
    with tempfile.TemporaryDirectory() as root:
        for pair in committed["refused"]:
            core = defaults | dict(part.split("=") for part in pair.split())
            report = _check(_compose([*FAST, *overrides(as_cell(core), Path(root), Path(root))]))
            assert not report.ok and all(p.why and p.fix for p in report.problems), pair
        for core in committed["cells"]:
            assert _check(_compose([*FAST, *overrides(as_cell(core), Path(root), Path(root))])).ok, core


@pytest.mark.slow
@pytest.mark.parametrize("core", core_cells(), ids=_core_name)
def test_a_core_cell_trains(core: dict[str, str], tmp_path: Path) -> None:
    assert run_cell(as_cell(core), tmp_path) == "trained", f"{_core_name(core)}: the checks accept it, the run refused"


@pytest.mark.slow
@pytest.mark.long
def test_the_committed_core_cells_are_the_ones_the_checks_allow_now() -> None:
    """tests/data/matrix_core.json holds core_covering() (a rule or an axis changed: write it again with
    `python -c "import json, test_matrix as m; print(json.dumps(m.core_covering(), indent=1))"` from tests/)."""
    assert core_covering() == json.loads(CORE_CELLS.read_text())


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
