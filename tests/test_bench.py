"""The GPU benchmark script: its FLOP count, and its mechanics on the CPU with the tiny model."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.parametrize(("res", "published"), [(1024, 20.2), (512, 4.7)])
def test_sdxl_unet_flops_per_image_match_the_published_figures(res: int, published: float) -> None:
    from ds_trainer.tools.bench import cells as bench_cells

    assert bench_cells.tflop_per_image("sdxl_base", res) == pytest.approx(published, rel=0.01)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("pairs", [pytest.param(1, id="one_pair"), pytest.param(2, id="pairs")])
def test_bench_runs_the_target_cells_writes_results_and_continues(tmp_path: Path, pairs: int) -> None:
    """`make test-long` only (six cell runs and the raw loop: 140 s alone, 340 s next to another CI worker); the
    default suite runs a cell and its raw loop through `test_bench_times_the_first_step_against_the_raw_loop`."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "ds_trainer.bench", "--out", str(out), "--model", "sdxl_tiny", "--resolutions", "128",
           "--batches", "2", "--cells", "targets", "--steps", "3", "--overhead-pairs", str(pairs)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = list(csv.DictReader((out / "results.csv").open()))
    # Six target cells (with one batch size the first and third target name the same cell: run once).
    assert len({r["cell"] for r in rows}) == len(rows) == 6
    assert [r["status"] for r in rows] == ["ok"] * 6, [(r["cell"], r["message"]) for r in rows]
    assert all(float(r["mfu"]) > 0 and float(r["images_per_s"]) > 0 for r in rows)
    assert all(0 < float(r["first_step_s"]) < 120 for r in rows)  # timed from outside, from the process start
    (raw,) = [r for r in rows if r["overhead"]]
    # A sanity range, not a measure: 3 steps a run, one or two pairs, next to another test worker (CI measured 0.495
    # and, with the raw loop's single timed step disturbed, 0.195).
    assert raw["cell"] == "stage2-none-px128-b2-gc0-acc1" and 0.1 < float(raw["overhead"]) < 10
    assert len(raw["overhead_pairs"].split()) == pairs  # the cell and the raw loop, back to back, `pairs` times
    text = (out / "results.md").read_text()
    assert ("(median of 2 alternating pairs)" in text) is (pairs == 2)
    assert "| 128px, batch 2, grad ckpt, stage2 + offload=cpu: peak allocated <= 7.0 GiB | " in text
    assert text.count("no GPU figures (not a CUDA run)") == 3  # memory targets need a GPU
    assert (out / "cells" / "report.png").stat().st_size > 0
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0 and "0 cell(s) to run" in again.stdout  # finished cells are kept


@pytest.mark.slow
@pytest.mark.long  # CI budget: the bench's precision comparison runs by default
def test_bench_times_the_first_step_against_the_raw_loop(tmp_path: Path) -> None:
    out = tmp_path / "startup"
    cmd = [sys.executable, "-m", "ds_trainer.bench", "--out", str(out), "--model", "sdxl_tiny", "--resolutions", "128",
           "--batches", "2", "--steps", "4", "--startup-pairs", "1", "--zeros", "ddp", "fsdp_full_shard"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = list(csv.DictReader((out / "startup.csv").open()))
    # torch's loop for ddp; for FSDP the raw loop is fully_shard on the same units, nothing around it.
    assert [(r["zero"], r["status"]) for r in rows] == [("ddp", "ok"), ("fsdp_full_shard", "ok")], rows
    for row in rows:
        for key in ("first_step_s", "raw_first_step_s"):  # each from its own process's start, imports included
            assert 1 < float(row[key]) < 120, row
        # Measured, not judged (the benchmarks judge speed): 2-11 s/it in a CI run, beside the other worker's runs.
        assert 0 < float(row["s_per_it"]) < 60 and 0 < float(row["raw_s_per_it"]) < 60
    table = (out / "startup.md").read_text()
    assert "| zero | pairs | first step (s) | raw loop (s) | ratio | s/it | raw s/it | ratio |" in table
    last = table.splitlines()[-2:]
    assert last[0].startswith("| ddp | 1 | ") and last[1].startswith("| fsdp_full_shard | 1 | "), last


@pytest.mark.slow
@pytest.mark.long  # CI budget (112 s of bf16 emulated on the CPU): the bench's other cells run by default
def test_bench_compares_the_training_loss_of_precisions_on_the_same_run(tmp_path: Path) -> None:
    out = tmp_path / "precision"
    cmd = [sys.executable, "-m", "ds_trainer.bench", "--out", str(out), "--model", "sdxl_tiny", "--resolutions", "128",
           "--batches", "1", "--steps", "4", "--samples", "4", "--precisions", "bf16", "bf16_pure", "--zeros", "stage2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = list(csv.DictReader((out / "precision.csv").open()))
    curves = {p: [float(r["loss"]) for r in rows if r["precision"] == p] for p in ("bf16", "bf16_pure")}
    assert [len(c) for c in curves.values()] == [4, 4]
    # The same seed, data, timesteps and noise: the first step's loss is computed before any update, the same under
    # both; the updates then differ by the precision of the masters and moments alone.
    assert curves["bf16"][0] == curves["bf16_pure"][0] and curves["bf16"] != curves["bf16_pure"]
    table = (out / "precision.md").read_text()
    assert "## lr 0.0001" in table and table.count("| bf16") == 2 and "%" in table.splitlines()[-2]


@pytest.mark.parametrize(("flags", "said"), [
    pytest.param([], "add --startup-pairs", id="without_startup_pairs"),
    pytest.param(["--startup-pairs", "1", "--peer-script", "missing.py"], "missing.py: no such file", id="missing"),
])
def test_bench_refuses_a_peer_script_it_cannot_time(flags: list[str], said: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from ds_trainer.tools import bench

    script = tmp_path / "train_text_to_image_sdxl.py"
    script.write_text("")
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--out", str(tmp_path / "out"), "--peer-script", str(script), *flags])
    assert stopped.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # stopped before anything ran


def test_the_script_s_steps_are_timed_when_its_progress_bar_first_shows_them() -> None:
    """diffusers' script reports its steps on a tqdm bar only: each line after a carriage return, rewritten when the
    step's loss is set, and a line may arrive in two pieces."""
    from ds_trainer.tools.bench.peer import StepClock, _median_s_per_it

    clock = StepClock()
    for chunk, at in [("Map: 100%|##########| 16/16 [00:01<00:00, 10.7 examples/s]\n", 1.0),
                      ("\rSteps:   0%|          | 0/5 [00:00<?, ?it/s]", 2.0),
                      ("\rSteps:  20%|##        | 1/5 [00:03<00:12,  3.00s/it]", 5.0),
                      ("\rSteps:  20%|##        | 1/5 [00:03<00:12,  3.00s/it, lr=0.0001, step_loss=1.17]", 5.1),
                      ("\rSteps:  40%|####      | 2/5 [00:04<00:06,  2.00s/it, lr=0.0001, step_loss=1.17]", 6.0),
                      ("\rSteps:  60%|######    | 3/", 6.4), ("5 [00:04<00:03,  1.50s/it, lr=0.0001]", 6.5),
                      ("\rSteps:  80%|########  | 4/5 [00:05<00:01,  1.20s/it, lr=0.0001]", 7.0),
                      ("\rSteps: 100%|##########| 5/5 [00:05<00:00,  1.00s/it, lr=0.0001]\n", 7.7)]:
        clock.feed(chunk, at)
    assert clock.seen == {0: 2.0, 1: 5.0, 2: 6.0, 3: 6.5, 4: 7.0, 5: 7.7} and clock.total == 5
    assert _median_s_per_it(clock.seen, warmup=2) == 0.5  # steps 3, 4 and 5: 0.5, 0.5 and 0.7 s


@pytest.mark.parametrize(("zero", "ran_as"), [
    pytest.param("stage3", "DeepSpeed ZeRO-3 (accelerate launch)", id="stage3"),
    pytest.param("ddp", "plain python", id="ddp"),
    pytest.param("fsdp_full_shard", "plain python (Accelerate gives a CPU process no FSDP)", id="fsdp"),
])
def test_the_script_runs_under_the_run_s_backend_where_accelerate_can_give_it_that_backend(
        zero: str, ran_as: str, tmp_path: Path) -> None:
    """The peer of a ZeRO-3 run is the script under ZeRO-3 (as a user would launch it: `accelerate launch` with a
    DeepSpeed config, the script's own AdamW and LR schedule), not the script alone."""
    import yaml
    from helpers.cli import cli_in_process

    from ds_trainer.tools.bench.peer import Peer, backend, cfg_of

    run = tmp_path / "run"
    code, output = cli_in_process([f"zero={zero}", "dry_run=true", f"hydra.run.dir={run}"], tmp_path)
    assert code == 0, output
    probe = tmp_path / "train_text_to_image_sdxl.py"  # stands in for the script: what Accelerate gives it
    probe.write_text("from accelerate import Accelerator\n"
                     "a = Accelerator()\n"
                     "print('RAN', a.distributed_type, a.state.deepspeed_plugin.zero_stage)\n")
    cmd = Peer(probe, sys.executable, tmp_path / "model", tmp_path / "images").command(run)
    assert backend(cfg_of(run)) == ran_as
    if zero != "stage3":
        assert cmd[1] == str(probe)
        return
    assert cmd[1:5] == ["-m", "accelerate.commands.launch", "--config_file", str(run / "peer_accelerate_config.yaml")]
    ds = json.loads((run / "peer_ds_config.json").read_text())
    assert "optimizer" not in ds and "scheduler" not in ds  # the script's AdamW and schedule
    assert ds["zero_optimization"] == json.loads((run / "ds_config.json").read_text())["zero_optimization"]
    accel = yaml.safe_load((run / "peer_accelerate_config.yaml").read_text())
    assert accel["deepspeed_config"]["deepspeed_config_file"] == str(run / "peer_ds_config.json")
    launched = subprocess.run(cmd[:cmd.index(str(probe)) + 1], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "RAN DistributedType.DEEPSPEED 3" in launched.stdout
