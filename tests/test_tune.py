"""`python -m ds_trainer.tune` on the CPU with sdxl_tiny: planner pruning, the measured winner, its outputs and
preset, a hang stopped at its time limit, a killed tune that continues, and the planner's calibration.

The machine may be loaded by others: these tests assert what ran and which measured cell won, never timings.
"""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.cfg import make_cfg
from helpers.cli import run_cli, run_dirs
from helpers.procs import wait_until
from helpers.ranks import free_port

from ds_trainer import CONF_DIR
from ds_trainer.tools import plan
from ds_trainer.tools.plan import calibration

# Space: stage0/none (fits), stage0/cpu (invalid: nothing to offload), stage2/none (0.127 GiB predicted:
# above the budget, pruned), stage2/cpu (fits). Two cells train.
SPACE = ["tune.zero=[stage0,stage2]", "tune.offload=[none,cpu]", "tune.micro_batch_size=[2]",
         "tune.gradient_checkpointing=[false]", "tune.vram_gib=0.12", "tune.warmup_steps=1", "tune.timed_steps=2",
         "tune.time_limit_s=600"]


def base(root: Path) -> list[str]:
    """What a user's training overrides would be (train.max_steps is the training's own, not the tune's)."""
    return ["model=sdxl_tiny", "resolution=px128", "logger=none", "data.num_samples=4", "train.max_steps=2",
            "validation=on", f"paths.outputs={root / 'outputs'}"]


def tune_cmd(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ds_trainer.tune", *base(root), *SPACE, *extra]


def rows(tune_dir: Path) -> dict[str, dict[str, str]]:
    return {r["cell"]: r for r in csv.DictReader(io.StringIO((tune_dir / "tune.csv").read_text()))}


@pytest.fixture(scope="module")
def tuned(module_tmp: Callable[[str], Path]) -> dict:
    """A tune killed (SIGTERM) once its first cell has a result, then run again to the end."""
    root = module_tmp("tune")
    tune_dir = root / "outputs" / "tune" / "tuned"
    first = tune_dir / "cells" / "stage0-none-b2-a1-nockpt" / "tune_cell.json"
    proc = subprocess.Popen(tune_cmd(root), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(first.exists, "the first cell never got a result", deadline=time.time() + 900, proc=proc, interval=1)
    first_result = first.read_text()
    proc.send_signal(signal.SIGTERM)
    _, killed_err = proc.communicate(timeout=120)
    second = subprocess.run(tune_cmd(root), cwd=root, capture_output=True, text=True, timeout=1200)
    return {"root": root, "dir": tune_dir, "killed_rc": proc.returncode, "killed_err": killed_err,
            "first_result": first_result, "first": first, "second": second}


@pytest.mark.slow
def test_planner_prunes_and_the_winner_is_the_fastest_measured_cell_that_fits(tuned: dict) -> None:
    assert tuned["second"].returncode == 0, tuned["second"].stderr[-3000:]
    table = rows(tuned["dir"])
    status = {cell: r["status"] for cell, r in table.items()}
    assert status == {"stage0/none b2x1": "ok", "stage0/cpu b2x1": "invalid", "stage2/none b2x1": "pruned",
                      "stage2/cpu b2x1": "ok"}
    cells = tuned["dir"] / "cells"
    assert sorted(p.name for p in cells.iterdir()) == ["stage0-none-b2-a1-nockpt", "stage2-cpu-b2-a1-nockpt"]
    assert "budget" in table["stage2/none b2x1"]["message"]
    ok = {cell: float(r["images_per_s"]) for cell, r in table.items() if r["status"] == "ok"}
    best = max(ok, key=ok.__getitem__)
    md = (tuned["dir"] / "tune.md").read_text()
    assert f"**Winner: {best}**" in md
    best_row = table[best]
    line = (tuned["dir"] / "winner.txt").read_text().split()
    assert f"zero={best_row['zero']}" in line and f"offload={best_row['offload']}" in line
    assert "train.max_steps=2" in line and not any(o.startswith("tune.") for o in line)
    assert json.loads((tuned["dir"] / "ds_config.json").read_text())["zero_optimization"]["stage"] == \
        int(best_row["zero"][-1])
    assert (tuned["dir"] / "tune.png").stat().st_size > 0
    for r in table.values():  # each measured cell says what else ran on the machine meanwhile
        if r["status"] == "ok":
            assert r["load_before"] and r["load_after"] and r["measure"] == "host RSS of the loop"
    # validation=on in the training overrides: each cell that ran to its end scored, the others show nothing.
    assert {cell: bool(r["val_loss"]) for cell, r in table.items()} == {cell: s == "ok" for cell, s in status.items()}
    assert all(0 < float(r["val_loss"]) < 10 for r in table.values() if r["val_loss"])


@pytest.mark.slow
def test_a_killed_tune_continues_without_running_finished_cells_again(tuned: dict) -> None:
    assert tuned["killed_rc"] != 0
    assert "stage0/none b2x1: ok" in tuned["killed_err"]
    assert tuned["first"].read_text() == tuned["first_result"]  # not measured again
    assert "stage0/none b2x1: ok (measured before, not run again)" in tuned["second"].stderr
    assert "stage2/cpu b2x1: running" in tuned["second"].stderr
    # the cell interrupted by the kill left no process behind
    leftover = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tuned["dir"]) in
                _cmdline(p)]
    assert not leftover


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped SystemExit, on purpose
def test_a_sigterm_that_lands_in_a_finalizer_still_stops_the_tune() -> None:
    """Python drops (prints as "Exception ignored") the SystemExit a signal handler raises inside a finalizer; a CI
    run's killed tune went on to its end that way. The tune remembers the signal and stops at its next step."""
    import os

    from ds_trainer.tools.tune import cell

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, between two bytecodes of the finalizer
                time.sleep(0.001)

    with pytest.raises(SystemExit) as stopped, cell.terminate_as_exit():
        Finalized()  # collected at once: its finalizer gets the signal
        carried_on = True
    assert carried_on and stopped.value.code == 128 + signal.SIGTERM
    with pytest.raises(SystemExit):
        cell.raise_if_stopped()  # what each next cell asks first


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_the_winning_line_and_the_preset_train(tuned: dict) -> None:
    root = tuned["root"]
    line = (tuned["dir"] / "winner.txt").read_text().split()
    run = run_cli(*line, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ds_trainer: ok after 2 steps" in run.stderr
    # The preset lies with the outputs (never in the source checkout), where +experiment finds it as is.
    preset = root / "outputs" / "presets" / "experiment" / "tuned.yaml"
    assert preset.read_text().startswith("# @package _global_")
    assert not (CONF_DIR / "experiment" / "tuned.yaml").exists()
    assert f"or: python -m ds_trainer paths.outputs={root / 'outputs'} +experiment=tuned" in tuned["second"].stdout
    before = set(run_dirs(root))
    run = run_cli(f"paths.outputs={root / 'outputs'}", "+experiment=tuned", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    (preset_run,) = set(run_dirs(root)) - before
    config = (preset_run / "config.yaml").read_text()
    winner = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in line}
    assert f"stage: {winner['zero'][-1]}" in config and f"device: {winner['offload']}" in config
    assert "ds_trainer: ok after 2 steps" in run.stderr


@pytest.mark.slow
def test_the_planner_learns_from_the_measured_cells(tuned: dict, capsys: pytest.CaptureFixture[str]) -> None:
    root = tuned["root"]
    records = calibration.read(root / "outputs" / "plan_calibration.jsonl",
                               {"model": "sdxl_tiny", "device": "cpu", "precision": "bf16"})
    assert sorted(r["cell"] for r in records) == ["stage0-none-b2-a1-nockpt", "stage2-cpu-b2-a1-nockpt"]
    cal = calibration.fit(records, "cpu")
    before = after = 0.0
    for r in records:
        cfg = make_cfg(*base(root), f"zero={r['zero']}", f"offload={r['offload']}", "train.micro_batch_size=2")
        raw = plan.estimate(cfg, r["zero"], r["offload"], 1).activations
        calibrated = plan.estimate(cfg, r["zero"], r["offload"], 1, cal.factor).activations
        before += abs(raw - r["measured_activation_bytes"])
        after += abs(calibrated - r["measured_activation_bytes"])
    assert after < before
    assert plan.main([*base(root), "plan.vram_gib=1"]) == 0
    out = capsys.readouterr().out
    assert "activations calibrated from 2 measured cell(s) on cpu" in out and "remaining error" in out




# A process named ds-busy that keeps one core busy for 10 s (a third of the cell's time).
BUSY = ("import time; open('/proc/self/comm', 'w').write('ds-busy'); end = time.time() + 10\n"
        "while time.time() < end: pass")


@pytest.mark.slow
def test_a_hanging_cell_is_stopped_at_its_time_limit_and_recorded_with_what_else_ran(tmp_path: Path) -> None:
    # A real hang: the environment announces a second rank that never starts, so the cell's process group
    # setup waits for it (the way a job with a lost rank hangs). The tune must stop it at the time limit.
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "ds_trainer.tune", *base(tmp_path), "tune.zero=[stage2]", "tune.offload=[none]",
           "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[false]", "tune.time_limit_s=25",
           f"tune.preset_dir={tmp_path / 'presets'}"]
    start = time.time()
    tune = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    tune_dir = tmp_path / "outputs" / "tune" / "tuned"
    # Another user's job that starts once the cell runs and ends 10 s later: the cell's row must name it.
    wait_until(lambda: list(tune_dir.glob("cells/*/cell.log")), "the cell never started", deadline=start + 300,
               proc=tune)
    subprocess.run([sys.executable, "-c", BUSY], timeout=60, check=True)
    _, stderr = tune.communicate(timeout=600)
    assert tune.returncode == 1, stderr[-3000:]
    (row,) = rows(tune_dir).values()
    assert row["status"] == "timeout" and "tune.time_limit_s=25" in row["message"]
    assert "ds-busy[" in row["others"], row
    assert time.time() - start < 300
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tune_dir) in _cmdline(p)]
    assert not (tune_dir / "winner.txt").exists()


@pytest.mark.slow
@pytest.mark.long
def test_a_diffusion_transformer_is_tuned_and_calibrates_the_planner(tmp_path: Path) -> None:
    """Flux (flux_tiny) through the tuner: its cells train, the winner's command names the model, and the measured
    cells are recorded for the planner under that model."""
    cmd = [sys.executable, "-m", "ds_trainer.tune", "model=flux_tiny", *base(tmp_path)[1:], "tune.zero=[stage2,stage3]",
           "tune.offload=[none]", "tune.micro_batch_size=[2]", "tune.gradient_checkpointing=[false]",
           "tune.warmup_steps=1", "tune.timed_steps=2", "tune.time_limit_s=600", f"tune.preset_dir={tmp_path / 'p'}"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    tune_dir = tmp_path / "outputs" / "tune" / "tuned"
    assert [(name, row["status"]) for name, row in rows(tune_dir).items()] == [
        ("stage2/none b2x1", "ok"), ("stage3/none b2x1", "ok")]
    assert "model=flux_tiny" in (tune_dir / "winner.txt").read_text()
    records = calibration.read(tmp_path / "outputs" / "plan_calibration.jsonl",
                               calibration.key(make_cfg("model=flux_tiny", "resolution=px128"), "cpu"))
    assert len(records) == 2


def test_a_global_batch_no_cell_makes_is_one_screen(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ds_trainer.tools import tune

    code = tune.main([*base(tmp_path), "world_size=1", "tune.global_batch=3", "tune.micro_batch_size=[2,4]"])
    err = capsys.readouterr().err
    assert code == 2
    assert "tune.global_batch=3" in err and "fix: tune.global_batch=" in err and "Traceback" not in err


def test_a_budget_no_cell_fits_names_the_closest_cell(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ds_trainer.tools import tune

    code = tune.main([*base(tmp_path), "tune.vram_gib=0.01", "tune.zero=[stage2,stage3]", "tune.offload=[cpu]",
                      "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[true]"])
    err = capsys.readouterr().err
    assert code == 2
    assert "tune.vram_gib=0.01" in err and "closest, stage3/cpu b1x1 ckpt" in err and "GiB per rank" in err
    assert not (tmp_path / "outputs" / "tune").exists()  # nothing ran


def test_sweep_report_labels_cells_by_every_axis_that_varies(tmp_path: Path) -> None:
    from ds_trainer.launch import report

    common = {"zero": "stage2", "offload": "cpu", "resolution": "128x128", "micro_batch_size": 2,
              "precision": "bf16", "world_size": 1}
    table = [{**common, "gradient_accumulation_steps": a, "gradient_checkpointing": c, "status": s,
              "host_rss_peak_mib": 700.0, "median_s_per_it": 0.5, "images_per_s": 4.0 * a}
             for a, c, s in ((1, False, "ok"), (1, True, "ok"), (2, False, "ok"), (2, True, "oom"))]
    names = report.labels(table)
    assert len(set(names)) == 4  # these four once all read `stage2/cpu 128x128 b2`
    assert names == ["accum 1 no ckpt", "accum 1 ckpt", "accum 2 no ckpt", "accum 2 ckpt"]
    for r, cell in zip(table, ("a", "b", "c", "d"), strict=True):
        (tmp_path / cell).mkdir()
        (tmp_path / cell / "summary.json").write_text(json.dumps(r))
    out = report.write(tmp_path, use_wandb=False)
    assert out["png"].stat().st_size > 0
    text = out["md"].read_text()
    assert "| accum | ckpt | message |" in text and "oom" in text
    # An optimizer sweep's cells read by their optimizer and precision (+sweep=optimizers, bf16_pure beside bf16).
    cells = [{**common, "optimizer": o, "precision": p} for o, p in
             (("adamw", "bf16"), ("adamw8bit", "bf16"), ("adamw", "bf16_pure"))]
    assert report.labels(cells) == ["bf16 adamw", "bf16 adamw8bit", "bf16_pure adamw"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", ["local_2proc", pytest.param("slurm_localtest", marks=pytest.mark.long)])
def test_a_tune_through_the_sweep_launchers_on_two_ranks_logs_its_table_to_wandb(
        tmp_path: Path, launcher: str, request: pytest.FixtureRequest) -> None:
    # The cell goes through the sweeps' launchers (submitit on this machine, and sbatch on the local Slurm
    # cluster; two tasks = two DeepSpeed ranks), and the table of cells reaches W&B (offline here).
    from helpers import wandb_log

    env = request.getfixturevalue("slurm_cluster") if launcher.startswith("slurm") else dict(os.environ)

    user = [a for a in base(tmp_path) if a != "logger=none"]
    cmd = [sys.executable, "-m", "ds_trainer.tune", *user, "logger=wandb", "world_size=2", "tune.zero=[stage2]",
           "tune.offload=[none]", "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[false]",
           "tune.warmup_steps=1", "tune.timed_steps=2", "tune.time_limit_s=600", f"tune.launcher={launcher}",
           f"tune.preset_dir={tmp_path / 'presets'}"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    tune_dir = tmp_path / "outputs" / "tune" / "tuned"
    (row,) = rows(tune_dir).values()
    assert row["status"] == "ok" and float(row["s_per_it"]) > 0, row
    (cell_dir,) = (tune_dir / "cells").iterdir()
    assert len(list((cell_dir / ".submitit").glob("*/*_log.out"))) == 2  # submitted through submitit: two tasks
    assert json.loads((cell_dir / "run" / "summary.json").read_text())["world_size"] == 2
    (wandb_file,) = tune_dir.glob("wandb/offline-run-*/run-*.wandb")
    (logged,) = [{k.split(".", 1)[1]: v for k, v in r.items() if k.startswith("tune.")}
                 for r in wandb_log.history(wandb_file) if "tune._type" in r]
    assert logged["_type"] == "table-file" and logged["nrows"] == 1
    table = json.loads((wandb_file.parent / "files" / logged["path"]).read_text())
    assert table["columns"][:3] == ["cell", "zero", "offload"] and table["data"][0][0] == row["cell"]


@pytest.mark.slow
@pytest.mark.long  # CI budget: 1024 px steps in emulated bf16 take minutes; the hanging cell runs by default
def test_a_cell_out_of_memory_is_a_result_and_the_search_goes_on(tmp_path: Path) -> None:
    # A real allocation failure: the tune, and so each cell, gets 4 GiB of address space; micro batch 16 at
    # 1024 px needs far more, micro batch 1 does not. No budget prunes either (tune.vram_gib is huge).
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    user = [a for a in base(tmp_path) if not a.startswith(("resolution=", "data.num_samples="))]
    cmd = [sys.executable, "-m", "ds_trainer.tune", *user, "resolution=px1024", "data.num_samples=16",
           "tune.zero=[stage2]", "tune.offload=[none]", "tune.micro_batch_size=[1,16]",
           "tune.gradient_checkpointing=[false]", "tune.vram_gib=1000", "tune.warmup_steps=1", "tune.timed_steps=1",
           "tune.time_limit_s=600", f"tune.preset_dir={tmp_path / 'presets'}"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, preexec_fn=limit)
    assert run.returncode == 0, run.stderr[-3000:]
    tune_dir = tmp_path / "outputs" / "tune" / "tuned"
    by_batch = {r["micro_batch_size"]: r for r in rows(tune_dir).values()}
    assert by_batch["16"]["status"] == "oom" and by_batch["1"]["status"] == "ok", by_batch
    assert "train.micro_batch_size=1" in (tune_dir / "winner.txt").read_text()


def test_the_optimizer_is_an_axis_each_cell_checked_and_planned_with_its_own_state() -> None:
    """tune.optimizer multiplies the space; each cell is validated and planned with its optimizer (8-bit moments
    predict less memory), and a combination the optimizer cannot run is invalid, not run as another."""
    from ds_trainer.tools.tune import space as tune_space

    cfg = make_cfg("model=sdxl_tiny", "world_size=2", "tune.zero=[stage0,stage2]", "tune.offload=[none]",
                   "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[false]",
                   "tune.optimizer=[adamw,adamw8bit,prodigy]")
    cells = tune_space.space(cfg.tune, {}, 2, 1)
    assert sorted(c.label for c in cells) == sorted(f"{z}/none b1x1 {o}" for z in ("stage0", "stage2")
                                                    for o in ("adamw", "adamw8bit", "prodigy"))
    assert all(f"optimizer={c.optimizer}" in c.overrides() for c in cells)
    tune_space.plan_cells(cells, lambda overrides: make_cfg(*overrides), ["model=sdxl_tiny", "world_size=2"], None,
                          None, 1.0)
    by = {(c.zero, c.optimizer): c for c in cells}
    assert by["stage2", "prodigy"].status == "invalid" and "prodigy" in (by["stage2", "prodigy"].message or "")
    assert by["stage0", "prodigy"].status == by["stage2", "adamw8bit"].status == "planned"
    assert by["stage2", "adamw8bit"].predicted_gib < by["stage2", "adamw"].predicted_gib
    # A user's optimizer=... holds the axis, like zero=...
    assert {c.optimizer for c in tune_space.space(cfg.tune, {"optimizer": "adamw8bit"}, 2, 1)} == {"adamw8bit"}


def test_adapters_and_quantized_bases_are_axes_each_cell_checked_and_planned_with_its_own_bytes() -> None:
    """tune.adapter and tune.quantize multiply the space: an NF4 base and LoKr's smaller state predict less memory
    than a bf16 base and LoRA; LoKr on a quantized base (peft has no bitsandbytes LoKr) is invalid, not run."""
    from ds_trainer.tools.tune import outputs
    from ds_trainer.tools.tune import space as tune_space

    cfg = make_cfg("model=sdxl_tiny", "world_size=1", "tune.zero=[stage2]", "tune.offload=[none]",
                   "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[true]", "tune.adapter=[lora,lokr]",
                   "tune.quantize=[none,nf4]")
    cells = tune_space.space(cfg.tune, {}, 1, 1)
    assert sorted(c.label for c in cells) == sorted(f"stage2/none b1x1 ckpt adapter={a} quantize={q}"
                                                    for a in ("lora", "lokr") for q in ("none", "nf4"))
    assert all({f"adapter={dict(c.levers)['adapter']}", f"quantize={dict(c.levers)['quantize']}"}
               <= set(c.overrides()) for c in cells)
    tune_space.plan_cells(cells, lambda overrides: make_cfg(*overrides), ["model=sdxl_tiny", "world_size=1"], None,
                          None, 1.0)
    by = {tuple(v for _, v in c.levers): c for c in cells}
    assert by["lokr", "nf4"].status == "invalid" and "quantize" in (by["lokr", "nf4"].message or "")
    assert by["lora", "nf4"].predicted_gib < by["lora", "none"].predicted_gib
    assert by["lokr", "none"].predicted_gib < by["lora", "none"].predicted_gib
    assert {"adapter", "quantize"} <= set(outputs.columns(cells))
    assert outputs.row(by["lora", "nf4"])["quantize"] == "nf4"
    # A user's adapter=... holds the axis, as zero=... does; a tune that searches neither shows neither column
    assert {dict(c.levers)["adapter"] for c in tune_space.space(cfg.tune, {"adapter": "lokr"}, 1, 1)} == {"lokr"}
    plain = tune_space.space(make_cfg("tune.zero=[stage2]", "tune.offload=[none]").tune, {}, 1, 1)
    assert not {"adapter", "quantize"} & set(outputs.columns(plain))


def test_compile_is_a_lever_its_seconds_a_column_apart_from_s_per_it() -> None:
    """tune.compile=[none,blocks] doubles the space; a cell that compiles runs with train.compile=blocks, under ZeRO-3
    it is invalid with the reason (the check's), and its compile seconds get their own column."""
    from ds_trainer.tools.tune import outputs
    from ds_trainer.tools.tune import space as tune_space

    cfg = make_cfg("model=sdxl_tiny", "world_size=1", "tune.zero=[stage2,stage3]", "tune.offload=[none]",
                   "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[false]", "tune.compile=[none,blocks]")
    cells = tune_space.space(cfg.tune, {}, 1, 1)
    assert sorted(c.label for c in cells) == sorted(f"{z}/none b1x1 compile={m}" for z in ("stage2", "stage3")
                                                    for m in ("none", "blocks"))
    tune_space.plan_cells(cells, lambda overrides: make_cfg(*overrides), ["model=sdxl_tiny", "world_size=1"], None,
                          None, 1.0)
    by = {(c.zero, dict(c.levers)["compile"]): c for c in cells}
    assert "train.compile=blocks" in by["stage2", "blocks"].overrides()
    assert by["stage3", "blocks"].status == "invalid" and "torch.compiler.disable" in (by["stage3", "blocks"].message
                                                                                       or "")
    assert by["stage2", "blocks"].status == "planned" and by["stage3", "none"].status == "planned"
    by["stage2", "blocks"].result = {"summary": {"compile_s": 14.2}, "s_per_it": 0.1, "images_per_s": 10.0}
    assert {"compile", "compile_s"} <= set(outputs.columns(cells)) and "quantize" not in outputs.columns(cells)
    assert outputs.row(by["stage2", "blocks"])["compile_s"] == 14.2
    base, fixed = tune_space.split_overrides(["train.compile=blocks", "zero=stage2"])
    assert fixed == {"compile": "blocks", "zero": "stage2"} and base == []
    assert {dict(c.levers)["compile"] for c in tune_space.space(cfg.tune, fixed, 1, 1)} == {"blocks"}
    assert "compile_s" not in outputs.columns(tune_space.space(make_cfg("tune.zero=[stage2]").tune, {}, 1, 1))


def test_context_is_a_lever_each_cell_planned_with_its_split_and_its_own_accumulation() -> None:
    """tune.context=[1,2,4] on Wan 2.1 14B at 720p, 81 frames, ZeRO-3 on 8 GPUs: the planner prunes the
    unsplit cell above an 80 GiB budget and keeps the split ones; a fixed global batch counts the data
    groups (8 images: accumulation 1, 2, 4); a context the ranks cannot divide is invalid with the reason."""
    from ds_trainer.tools.tune import outputs
    from ds_trainer.tools.tune import space as tune_space

    clip = ["model=wan21_t2v_14b", "resolution.width=1280", "resolution.height=720", "data.video.frames=[81]",
            "train.gradient_checkpointing=true", "world_size=8"]
    cfg = make_cfg(*clip, "tune.zero=[stage3]", "tune.offload=[none]", "tune.micro_batch_size=[1]",
                   "tune.gradient_checkpointing=[true]", "tune.context=[1,2,4]", "tune.global_batch=8")
    cells = tune_space.space(cfg.tune, {}, 8, 1)
    assert sorted((dict(c.levers)["context"], c.accum) for c in cells) == [("1", 1), ("2", 2), ("4", 4)]
    tune_space.plan_cells(cells, lambda overrides: make_cfg(*overrides), clip, 80 * 2**30, None, 1.0)
    by = {dict(c.levers)["context"]: c for c in cells}
    assert by["1"].status == "pruned" and by["2"].status == by["4"].status == "planned"
    assert round(by["1"].predicted_gib or 0, 1) == 93.4 and round(by["2"].predicted_gib or 0, 1) == 65.1
    assert {"parallel.context=2", "train.gradient_accumulation_steps=2"} <= set(by["2"].overrides())
    assert "context" in outputs.columns(cells) and outputs.row(by["4"])["context"] == "4"
    # The user's parallel.context=... holds the axis; on 6 ranks a context of 4 is refused with the divisors
    base, fixed = tune_space.split_overrides(["parallel.context=4", "world_size=6"])
    assert fixed == {"context": "4"} and base == ["world_size=6"]
    odd = tune_space.space(make_cfg("model=wan_tiny", "tune.zero=[stage2]", "tune.offload=[none]",
                                    "tune.micro_batch_size=[1]", "tune.gradient_checkpointing=[false]").tune,
                           fixed, 6, 1)
    tune_space.plan_cells(odd, lambda overrides: make_cfg(*overrides), ["model=wan_tiny", *base], None, None, 1.0)
    assert [c.status for c in odd] == ["invalid"] and "does not divide them" in (odd[0].message or "")
    assert "context" not in outputs.columns(tune_space.space(make_cfg("tune.zero=[stage2]").tune, {}, 1, 1))
