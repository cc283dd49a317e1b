"""Wan 2.2 A14B's two experts trained in one command (`model.video.expert=both`, config/phases.py): the
high-noise expert's run on its timesteps, then the low-noise one's on its own beside the first's trained
expert, each a run folder of its own (`<run>/experts/high`, `<run>/experts/low`), then their exports joined in
the run's folder (`transformer` the high-noise expert, `transformer_2` the low-noise one, as WanPipeline holds
them). The run is stopped (SIGTERM) in its second phase and the same command run again, as a preempted job is:
the first phase is not trained again, the second continues from the step it saved. What a user would notice:
each expert moved from the source on its own timesteps, the exported pipeline holding both, the last sample
being what that pipeline makes for the same seed, the refusals of what cannot combine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import numerics
from helpers.cfg import make_cfg
from helpers.cli import run_cli
from helpers.procs import wait_until
from helpers.ranks import train
from PIL import Image

torch = pytest.importorskip("torch")

PROMPT = "a red square moving right"
STEPS = 40  # a second phase of about two seconds: the signal lands in it
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# fp32: the sample's two experts and the exported pipeline's compute alike (no bf16 copy of one of them)
BASE = ["model=wan22_a14b_tiny", "model.video.expert=both", "logger=none", "scheduler=constant",
        "optimizer.lr=3e-3", "precision=fp32", "resolution.width=64", "resolution.height=64",
        "data.video.frames=[1,5]", "data.num_samples=4"]
SAMPLES = ["samples=on", "samples.every=0", "samples.steps=2", f"samples.prompts=[{PROMPT}]", "samples.frames=5"]
COMMON = [*BASE, *SAMPLES, "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
          f"train.max_steps={STEPS}"]
# Every linear layer of the blocks: the modules musubi-tuner's LoRA holds
EVERY_LINEAR = "adapter.targets=[to_q,to_k,to_v,to_out.0,ffn.net.0.proj,ffn.net.2]"


def _summary(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "summary.json").read_text()))


def _steps(folder: Path) -> list[int]:
    rows = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [row["step"] for row in rows if "loss" in row]


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(folder / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def run(module_tmp: Callable[[str], Path]) -> dict[str, Any]:
    """The both-run, stopped by SIGTERM in its second phase, then the same command again."""
    root = module_tmp("experts")
    run_dir = root / "run"
    args = [*COMMON, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "ds_trainer", *args], cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
    low = run_dir / "experts" / "low"

    def stepping() -> bool:
        return (low / "metrics.jsonl").is_file() and len(_steps(low)) >= 1

    wait_until(stepping, "the run ended before its second phase trained", proc=proc, deadline=time.time() + 300,
               interval=0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    high = run_dir / "experts" / "high"
    stopped = {"top": _summary(run_dir), "low": _summary(low), "high_metrics": (high / "metrics.jsonl").read_text(),
               "high_summary": (high / "summary.json").stat().st_mtime_ns}
    again = run_cli(*args, cwd=root, env=ONE_THREAD)
    assert again.returncode == 0, again.stderr[-3000:]
    return {"dir": run_dir, "stopped": stopped, "log": again.stderr}


def test_a_run_stopped_in_its_second_phase_continues_there_and_leaves_the_first_as_it_was(
        run: dict[str, Any]) -> None:
    run_dir, stopped = run["dir"], run["stopped"]
    high, low = run_dir / "experts" / "high", run_dir / "experts" / "low"
    # The stop: the second phase saved after its step, the run's summary says which phase stopped
    assert stopped["low"]["status"] == "interrupted" and 1 <= stopped["low"]["steps"] < STEPS
    assert stopped["top"]["status"] == "interrupted"
    assert [(p["name"], p["status"]) for p in stopped["top"]["phases"]] == [("high", "ok"), ("low", "interrupted")]
    # Again: the first phase untouched, the second on from the step after the one it saved, to the end
    assert (high / "metrics.jsonl").read_text() == stopped["high_metrics"]
    assert (high / "summary.json").stat().st_mtime_ns == stopped["high_summary"]
    assert "phase high: done in" in run["log"]
    assert _steps(high) == list(range(1, STEPS + 1))
    assert _steps(low) == list(range(1, STEPS + 1))  # the steps after the stop replaced, each once
    assert _summary(low)["resumed_from"]["step"] == stopped["low"]["steps"]
    top = _summary(run_dir)
    assert top["status"] == "ok" and [(p["name"], p["status"], p["steps"]) for p in top["phases"]] == [
        ("high", "ok", STEPS), ("low", "ok", STEPS)]


def test_each_expert_trains_on_its_own_timesteps_and_the_exported_pipeline_holds_both(run: dict[str, Any]) -> None:
    run_dir = run["dir"]
    _trained_on_their_own_timesteps_and_joined(run_dir)
    assert "expert: both" in (run_dir / "config.yaml").read_text()
    assert "expert: low" in (run_dir / "experts" / "low" / "config.yaml").read_text()
    assert (run_dir / "single_file" / "high" / "model.safetensors").is_file()
    assert (run_dir / "single_file" / "low" / "model.safetensors").is_file()
    card = (run_dir / "README.md").read_text()
    assert "experts: both" in card and "`single_file/low/model.safetensors`" in card


def _source(slot: str) -> dict[str, Any]:
    """The tiny model's expert in `slot` before training (its random weights, fixed by the seed)."""
    from ds_trainer.train import families

    cfg = make_cfg("model=wan22_a14b_tiny")
    return dict(families.of(cfg).other_expert(cfg, slot, given=False).state_dict())


def _trained_on_their_own_timesteps_and_joined(run_dir: Path) -> None:
    """Each phase's run trained its expert on its side of the boundary, away from the source's; the run's folder,
    its pipeline and the low-noise phase's pipeline hold each in its slot."""
    from omegaconf import OmegaConf

    from ds_trainer.train import families

    for phase, slot in (("high", "transformer"), ("low", "transformer_2")):
        folder = run_dir / "experts" / phase
        # The phase's run as its folder records it: its expert, its share of the timesteps
        cfg = make_cfg(*OmegaConf.load(folder / ".hydra" / "overrides.yaml"))
        assert cfg.model.video.expert.value == phase
        sigmas = families.of(cfg).schedule(cfg).sigmas
        own = sigmas >= 0.875 if phase == "high" else sigmas < 0.875
        assert len(sigmas) > 10 and bool(own.all()), phase
        trained = _weights(folder / "transformer")
        assert numerics.mean_abs_difference(trained, _source(slot)) > 1e-4, phase  # it moved from the source's
        for joined in (run_dir / slot, run_dir / "pipeline" / slot):  # in its slot, as trained
            assert numerics.mean_abs_difference(_weights(joined), trained) == 0, (joined, phase)
    # The low-noise phase sampled and exported beside the high-noise phase's trained expert
    low_pipeline = run_dir / "experts" / "low" / "pipeline" / "transformer"
    assert numerics.mean_abs_difference(_weights(low_pipeline), _weights(run_dir / "transformer")) == 0


# The exported pipeline's clip of PROMPT, seed 0, as the sampler calls it (tests/scripts/sample_reference.py's call),
# each expert's LoRA folder given after the output loaded into its transformer; a fresh process, one thread.
REFERENCE = """
import sys
from pathlib import Path

import numpy as np
import torch

from ds_trainer.train.observe import sampling

sys.path.insert(0, sys.argv[1])
from helpers import pipelines

torch.set_num_threads(1)
pipe = pipelines.load(Path(sys.argv[2]))
pipe.set_progress_bar_config(disable=True)
for k, folder in enumerate(sys.argv[5:]):
    pipe.load_lora_weights(folder, load_into_transformer_2=k == 1)
extra = (("max_sequence_length", 32), ("num_frames", 5), ("output_type", "pil"))
settings = sampling.Settings(2, 5.0, "", 64, 64, extra, ())
frames = sampling.generate(pipe, sys.argv[3], 0, settings, sampling.reference(settings, 0))
np.save(sys.argv[4], np.stack([np.asarray(frame) for frame in frames]))
"""


def _sample_is_the_pipelines(run_dir: Path, *loras: Path) -> None:
    """The run's last sample clip (its frames in the grid, lossless) is what its exported pipeline (with `loras`:
    the high-noise expert's, then the low-noise one's) makes for the same seed."""
    out = run_dir / "reference.npy"
    cmd = [sys.executable, "-c", REFERENCE, str(Path(__file__).parent), str(run_dir / "pipeline"), PROMPT, str(out),
           *map(str, loras)]
    result = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = np.load(out)
    assert expected.shape == (5, 64, 64, 3) and expected.std() > 1
    last = sorted((run_dir / "samples").glob("step_*"))[-1]
    grid = np.asarray(Image.open(last / "grid.png").convert("RGB"))  # one row: the clip's five frames
    got = np.stack([grid[:, 64 * k:64 * (k + 1)] for k in range(5)])
    numerics.assert_same_image(got, expected, "the both-run's last sample against its exported pipeline's")


def test_the_last_sample_is_the_exported_pipelines_for_the_same_seed(run: dict[str, Any]) -> None:
    run_dir = run["dir"]
    assert (run_dir / "samples" / f"step_{STEPS:08d}" / "0_0.mp4").is_file()
    _sample_is_the_pipelines(run_dir)


@pytest.mark.parametrize(("overrides", "key"), [
    (["model=wan_tiny"], "model.video.expert"),  # one transformer: one expert
    (["adapter=lokr"], "adapter.method"),
    (["adapter=lora", "adapter.formats=[kohya]"], "adapter.formats"),
    (["export.formats=[single_file]"], "export.formats"),
    (["train.export=false"], "train.export"),
    (["model.video.other_expert=/nowhere"], "model.video.other_expert"),
    (["resume=/tmp"], "resume"),  # a checkpoint of none of its phases
])
def test_what_cannot_combine_with_both_experts_is_refused_with_the_fix(overrides: list[str], key: str) -> None:
    from ds_trainer.config import checks

    report = checks.check(make_cfg("model=wan22_a14b_tiny", "model.video.expert=both", *overrides))
    assert key in [p.key for p in report.problems], report.render()
    assert all(p.fix for p in report.problems)


def test_a_sweeps_report_counts_a_run_in_phases_once(tmp_path: Path) -> None:
    from ds_trainer.launch import report

    for cell in ("0", "1"):
        for folder in ("", "experts/high", "experts/low"):
            (tmp_path / cell / folder).mkdir(parents=True, exist_ok=True)
            (tmp_path / cell / folder / "summary.json").write_text(json.dumps({"status": "ok"}))
    assert report.cells(tmp_path) == [tmp_path / "0", tmp_path / "1"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long
def test_two_ranks_under_zero3_train_both_experts_and_their_sample_is_the_exported_pipelines(tmp_path: Path) -> None:
    run_dir = train(tmp_path, 2, *BASE, *SAMPLES, "train.max_steps=4", "zero=stage3")
    top = _summary(run_dir)
    assert top["status"] == "ok" and top["world_size"] == 2
    assert [(p["name"], p["status"], p["steps"]) for p in top["phases"]] == [("high", "ok", 4), ("low", "ok", 4)]
    _trained_on_their_own_timesteps_and_joined(run_dir)
    _sample_is_the_pipelines(run_dir)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long
def test_an_fsdp2_lora_of_each_expert_loads_into_its_own_transformer(tmp_path: Path) -> None:
    """Two ranks under FSDP2, a LoRA each: the base pipeline holds the source's experts, each expert's LoRA files
    (diffusers' layout, musubi-tuner's) are under its name, and the base pipeline with the high-noise LoRA in
    `transformer` and the low-noise one in `transformer_2` makes the run's last sample."""
    from safetensors.torch import load_file

    run_dir = train(tmp_path, 2, *BASE, *SAMPLES, "train.max_steps=4", "zero=fsdp_full_shard", "adapter=lora",
                    EVERY_LINEAR)
    assert _summary(run_dir)["status"] == "ok"
    for slot in ("transformer", "transformer_2"):
        assert numerics.mean_abs_difference(_weights(run_dir / "pipeline" / slot), _source(slot)) == 0
    for phase in ("high", "low"):
        folder = run_dir / "lora" / phase
        assert load_file(folder / "pytorch_lora_weights.safetensors").keys() == load_file(
            run_dir / "experts" / phase / "lora" / "pytorch_lora_weights.safetensors").keys()
        musubi = load_file(folder / "kohya.safetensors")
        assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in musubi
        assert "lora_unet_blocks_1_ffn_2.alpha" in musubi
    _sample_is_the_pipelines(run_dir, run_dir / "lora" / "high", run_dir / "lora" / "low")


@pytest.mark.slow
@pytest.mark.long
def test_a_new_run_continues_a_both_run_from_its_second_phases_checkpoint_or_the_latest(tmp_path: Path) -> None:
    """resume=<a checkpoint of the low-noise phase>: that phase continues from it, the high-noise one from the
    same run's newest checkpoint; resume=latest: each phase from its own newest of the same experiment."""
    args = [*BASE, "train.checkpoint_every=2"]

    def both(name: str, steps: int, *more: str) -> Path:
        run_dir = tmp_path / "outputs" / "runs" / "both" / name
        result = run_cli(*args, f"train.max_steps={steps}", f"hydra.run.dir={run_dir}", *more, cwd=tmp_path,
                         env=ONE_THREAD)
        assert result.returncode == 0, result.stderr[-3000:]
        return run_dir

    first = both("a", 4)
    given = first / "experts" / "low" / "checkpoints" / "step_00000002"
    second = both("b", 6, f"resume={given}")
    steps = {phase: _steps(second / "experts" / phase) for phase in ("high", "low")}
    assert steps == {"high": [5, 6], "low": [3, 4, 5, 6]}
    resumed = _summary(second / "experts" / "high")["resumed_from"]
    assert resumed["checkpoint"] == str(first / "experts" / "high" / "checkpoints" / "step_00000004")
    third = both("c", 8, "resume=latest")
    for phase in ("high", "low"):
        assert _steps(third / "experts" / phase) == [7, 8]
        assert _summary(third / "experts" / phase)["resumed_from"]["run_dir"] == str(second / "experts" / phase)
    assert _summary(third)["status"] == "ok"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.long
def test_a_sweep_of_both_runs_on_the_submitit_launcher_with_two_ranks_a_cell(tmp_path: Path) -> None:
    """Each cell (a submitit job of two ranks, each rank a task) trains both phases; the report has a row a cell."""
    import csv
    import io

    result = run_cli("-m", "train.seed=0,1", "hydra/launcher=local_2proc", *BASE, "train.max_steps=3",
                     "zero=stage3", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (sweep_dir,) = sorted(p.parent for p in (tmp_path / "outputs" / "sweeps").glob("*/*/multirun.yaml"))
    rows = list(csv.DictReader(io.StringIO((sweep_dir / "report.csv").read_text())))
    assert [(r["status"], r["world_size"]) for r in rows] == [("ok", "2"), ("ok", "2")]
    for cell in ("0", "1"):
        phases = _summary(sweep_dir / cell)["phases"]
        assert [(p["name"], p["status"], p["steps"]) for p in phases] == [("high", "ok", 3), ("low", "ok", 3)]
