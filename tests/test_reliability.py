"""Reliability: bad input, crashes, full disks and bad data lose nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.cli import run_cli, run_dirs
from helpers.deps import require
from helpers.procs import kill_9_at, wait_until
from helpers.ranks import free_port, torchrun
from test_train import metrics, summary, unet_weights

from ds_trainer.config import nvme

torch = pytest.importorskip("torch")


def _tmpfs(folder: Path, size: str) -> Iterator[Path]:
    require(os.geteuid() == 0, "mounting a size-limited tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 200 MiB tmpfs: room for one checkpoint of the tiny model (73 MiB of DeepSpeed's files and 62 MiB
    of portable state), not two."""
    yield from _tmpfs(tmp_path / "small", "200m")


@pytest.fixture
def swap_disk(tmp_path: Path) -> Iterator[Path]:
    """A 150 MiB tmpfs: room for the tiny model's NVMe swap (64 MiB written, 118 MiB asked for)."""
    yield from _tmpfs(tmp_path / "swap_disk", "150m")


@pytest.mark.slow
def test_checkpoint_on_a_full_disk_stops_cleanly_and_keeps_the_previous_one(small_disk: Path,
                                                                             tmp_path: Path) -> None:
    args = ["logger=none", "train.max_steps=6", "train.checkpoint_every=2", "data.num_samples=4",
            "train.checkpoints_to_keep=3"]
    result = run_cli(*args, f"paths.outputs={small_disk}/outputs", cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "disk full while saving the step-4 checkpoint" in result.stderr
    assert "the last checkpoint, step_00000002, is intact" in result.stderr
    (run_dir,) = sorted((small_disk / "outputs" / "runs").glob("*/*"))
    assert summary(run_dir)["status"] == "error"
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002"]  # the failed save left nothing that could pass for a checkpoint
    # ...and the intact one resumes, on a disk with room.
    resumed = run_cli(*args, f"resume={run_dir / 'checkpoints' / 'step_00000002'}",
                      f"paths.outputs={tmp_path}/big", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (new_run,) = sorted((tmp_path / "big" / "runs").glob("*/*"))
    assert [r["step"] for r in metrics(new_run)] == [3, 4, 5, 6]


@pytest.mark.slow
def test_a_disk_that_fills_at_the_export_stops_with_the_disk_full_message_and_resume_latest_exports(
        tmp_path: Path) -> None:
    """Past the checkpoints, any write on a full disk (here the export's pipeline, 23 MiB, after a LoRA checkpoint
    of 8 MiB and its 1 MiB file on a 16 MiB disk) ends with the one-screen message, not a traceback; the
    checkpoint stays loadable and resume=latest, on the same disk made larger, only exports."""
    disk = _tmpfs(tmp_path / "disk", "16m")
    outputs = next(disk)
    try:
        args = ["adapter=lora", "logger=none", "train.max_steps=2", "data.num_samples=2",
                f"paths.outputs={outputs}/outputs", f"data.cache_dir={tmp_path}/cache"]
        full = run_cli(*args, cwd=tmp_path)
        assert full.returncode == 1, full.stderr[-3000:]
        assert "Traceback" not in full.stderr
        assert "disk full while exporting the trained weights" in full.stderr
        assert "the last checkpoint, step_00000002, is intact" in full.stderr and "resume=latest" in full.stderr
        (run_dir,) = run_dirs(outputs)
        subprocess.run(["mount", "-o", "remount,size=200m", str(outputs)], check=True)
        resumed = run_cli(*args, "resume=latest", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        (again,) = [d for d in run_dirs(outputs) if d != run_dir]
        assert summary(again)["status"] == "ok" and metrics(again) == []  # nothing trained again
        assert (again / "pipeline" / "model_index.json").exists() and list((again / "lora").glob("*.safetensors"))
    finally:
        next(disk, None)


@pytest.mark.slow
@pytest.mark.nvme
@pytest.mark.long  # CI budget: a swap disk too small is refused by default
def test_an_nvme_swap_disk_that_fills_up_stops_the_run_and_the_checkpoint_resumes(swap_disk: Path,
                                                                                   tmp_path: Path) -> None:
    # DeepSpeed does not notice a full swap disk: its files end short and reading one back aborts the
    # process (SIGABRT, nothing recorded). The run checks the room again right before DeepSpeed starts.
    require(nvme.aio_load_error() is None, f"DeepSpeed's async_io op: {nvme.aio_load_error()}")
    args = ["zero=stage3", "offload=nvme", f"offload.nvme_path={swap_disk}/swap", "logger=none",
            "train.checkpoint_every=2", "data.num_samples=4"]
    first = run_cli(*args, "train.max_steps=4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = run_dirs(tmp_path)[0] / "checkpoints" / "step_00000004"
    before = {p.name: p.stat().st_mtime_ns for p in saved.rglob("*")}
    # Another process fills the disk after the resume's configuration check passed.
    proc = subprocess.Popen([sys.executable, "-m", "ds_trainer", *args, "train.max_steps=8", "resume=latest"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: len(list(tmp_path.glob("outputs/runs/*/*/ds_config.json"))) >= 2,
               "the resume ended before the disk filled", proc=proc, deadline=time.time() + 120, interval=0.02)
    subprocess.run(["dd", "if=/dev/zero", f"of={swap_disk}/filler", "bs=1M"], capture_output=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in err
    assert f"offload.nvme_path={swap_disk}/swap has " in err  # (its earlier swap, to be replaced, counts as free)
    assert "the disk filled up after the configuration was checked; nothing was trained" in err
    assert summary(run_dirs(tmp_path)[1])["status"] == "error"
    assert {p.name: p.stat().st_mtime_ns for p in saved.rglob("*")} == before  # untouched
    (swap_disk / "filler").unlink()
    resumed = run_cli(*args, "train.max_steps=8", "resume=latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dirs(tmp_path)[2])] == [5, 6, 7, 8]


def test_a_swap_margin_below_one_is_refused() -> None:
    result = run_cli("zero=stage3", "offload=nvme", "offload.free_space_margin=0.5", "dry_run=true", cwd=Path.cwd())
    assert result.returncode == 2 and "offload.free_space_margin=0.5" in result.stderr
    assert "aborts the process" in result.stderr


def test_nvme_swap_on_a_small_disk_is_refused_before_training(small_disk: Path, tmp_path: Path) -> None:
    result = run_cli("zero=stage3", "offload=nvme", f"offload.nvme_path={small_disk}/swap", "model=sdxl_base",
                     "dry_run=true", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"offload.nvme_path={small_disk}/swap" in result.stderr and "GiB free" in result.stderr


def _write_bad_folder(folder: Path) -> None:
    from PIL import Image

    folder.mkdir()
    Image.new("RGB", (256, 192), (200, 30, 30)).save(folder / "good.jpg")
    (folder / "good.txt").write_text("a red picture")
    Image.new("L", (160, 160), 90).save(folder / "gray.png")
    Image.new("CMYK", (200, 200), (0, 100, 200, 0)).save(folder / "cmyk.jpg")
    Image.new("RGBA", (150, 150), (0, 0, 255, 128)).save(folder / "alpha.png")
    Image.new("I;16", (140, 140), 40000).save(folder / "deep.png")
    Image.new("RGB", (40, 30), (1, 2, 3)).save(folder / "tiny.webp")  # smaller than the resolution
    Image.new("RGB", (200, 200), (9, 9, 9)).save(folder / "broken.png")
    data = (folder / "broken.png").read_bytes()
    (folder / "broken.png").write_bytes(data[: len(data) // 2])  # truncated
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.png").write_text("this is not an image")


@pytest.mark.slow
@pytest.mark.multiproc
def test_bad_data_is_converted_or_skipped_with_counts(tmp_path: Path) -> None:
    _write_bad_folder(tmp_path / "images")
    # Two ranks: they split the work of decoding the folder and must end with the same file list.
    # A third of the folder damaged (above data.max_bad_fraction's 5%): trained on the rest, as the user allows.
    result = run_cli("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "ds_trainer", "data=folder",
                     f"data.path={tmp_path / 'images'}", "logger=none", "train.max_steps=4", "train.micro_batch_size=2",
                     "data.max_bad_fraction=0.5", cwd=tmp_path, module="torch.distributed.run")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stderr
    assert "skipped 1 file(s): empty file" in log
    assert "skipped 1 file(s): truncated or corrupt image" in log
    assert "skipped 1 file(s): not an image (unrecognized format)" in log  # text named .png
    assert "5 image(s) have no caption" in log  # gray, cmyk, alpha, deep, tiny
    assert "cached latents and embeddings of 6 samples" in log
    assert "checked 9 image(s): 9 decoded now" in log
    (run_dir,) = run_dirs(tmp_path)
    assert summary(run_dir)["status"] == "ok"


def test_a_folder_is_decoded_once_and_only_changed_files_again(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Checking every image is a full decode: a restart (a resumed or requeued job) must not pay it again."""
    import logging

    from helpers.cfg import make_cfg

    from ds_trainer.train import data

    images = tmp_path / "images"
    _write_bad_folder(images)
    cfg = make_cfg("data=folder", f"data.path={images}", f"data.cache_dir={tmp_path / 'cache'}",
                   "data.max_bad_fraction=0.5")
    caplog.set_level(logging.INFO, logger="ds_trainer.train.data")
    first = data.dataset(cfg)
    assert len(first) == 6 and sum(first.skipped.values()) == 3
    assert "checked 9 image(s): 9 decoded now, 0 known" in caplog.text
    caplog.clear()
    second = data.dataset(cfg)
    assert second.names() == first.names() and second.skipped == first.skipped
    assert "checked 9 image(s): 0 decoded now, 9 known" in caplog.text
    assert "skipped 1 file(s): truncated or corrupt image" in caplog.text  # still reported
    caplog.clear()
    good = images / "good.jpg"
    good.write_bytes(good.read_bytes()[:100])  # the same name, now truncated
    third = data.dataset(cfg)
    assert "checked 9 image(s): 1 decoded now, 8 known" in caplog.text
    assert "good.jpg" not in third.names() and third.skipped["truncated or corrupt image"] == 2


def test_a_folder_with_nothing_usable_fails_before_training(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "a.jpg").write_bytes(b"")
    (images / "b.png").write_text("no")
    result = run_cli("data=folder", f"data.path={images}", "logger=none", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr  # the user's input: as a bad override
    assert f"data.path={images}: 2 image file(s), none readable; nothing to train on" in result.stderr
    (run_dir,) = run_dirs(tmp_path)
    assert summary(run_dir)["status"] == "error" and summary(run_dir)["steps"] == 0




def _train_args(zero: str, offload: str) -> list[str]:
    return [f"zero={zero}", f"offload={offload}", "logger=none", "train.max_steps=8", "train.checkpoint_every=1",
            "train.checkpoints_to_keep=2", "data.num_samples=8", "train.export=true", "train.ema=true"]


class References:
    """Exported UNet and EMA UNet of an uninterrupted run per zero x offload, trained when a test first asks."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}  # type: ignore[var-annotated]

    def __getitem__(self, key: tuple[str, str]) -> dict[str, dict]:
        if key not in self.done:
            cwd = self.root / "-".join(key)
            cwd.mkdir()
            result = run_cli(*_train_args(*key), cwd=cwd)
            assert result.returncode == 0, result.stderr[-3000:]
            run_dir = run_dirs(cwd)[0]
            self.done[key] = {folder: unet_weights(run_dir / folder) for folder in ("unet", "unet_ema")}
        return self.done[key]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def references(module_tmp: Callable[[str], Path]) -> References:
    return References(module_tmp("references"))


@pytest.mark.slow
@pytest.mark.parametrize(("zero", "offload", "moment"), [
    pytest.param(zero, offload, moment, marks=() if (zero, offload, moment) in
                 {("stage2", "none", "step")} else pytest.mark.long)
    for zero, offload in (("stage2", "none"), ("stage2", "cpu"), ("stage3", "none"), ("stage3", "cpu"),
                          ("stage3", "nvme"), ("ddp", "none"), ("fsdp_full_shard", "none"), ("fsdp_full_shard", "cpu"))
    for moment in ("step", "save")])
def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path: Path, references: References, zero: str,
                                                         offload: str, moment: str) -> None:
    if offload == "nvme":  # DeepSpeed's own load lost Adam's moments there; the portable state resumes it
        require(nvme.aio_load_error() is None, f"DeepSpeed's async_io op: {nvme.aio_load_error()}")
    rng = random.Random(f"{zero}{offload}{moment}{tmp_path.name}")
    proc = subprocess.Popen([sys.executable, "-m", "ds_trainer", *_train_args(zero, offload)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = rng.randint(2, 6)
    kill_9_at(proc, tmp_path, moment, target, rng, jitter=0.15)
    resumed = run_cli(*_train_args(zero, offload), "resume=latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = run_dirs(tmp_path)
    start = metrics(second)[0]["step"]
    complete = sorted(int(p.name[5:]) for p in (first / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    assert start == complete[-1] + 1  # resumed from the newest complete checkpoint, never a partial one
    # Bit for bit, the UNet and its EMA: the resume restores the learning rate (without DeepSpeed, the schedule
    # saved as a checkpoint object: before it was, DDP resumed at LR 0), DeepSpeed's C++ Adam step state
    # (backends.masters.restore_optimizer_clocks; without it the weights differ by ~5e-4 after a few steps) and the
    # EMA.
    for folder, expected in references[(zero, offload)].items():
        got = unet_weights(second / folder)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{folder}/{key}"


@pytest.mark.slow
def test_sigterm_stops_after_a_step_with_a_checkpoint_and_resume_continues(tmp_path: Path) -> None:
    """What scancel, a scheduler's preemption or `docker stop` sends: the run finishes its step, saves,
    and says so; nothing trained is lost (no periodic checkpoints here: only the one SIGTERM asks for). Under FSDP2
    with its CPU offload: DeepSpeed's runs stop by the same path in the Ctrl-C and Slurm requeue tests."""
    args = ["zero=fsdp_full_shard", "offload=cpu", "logger=none", "train.max_steps=16", "data.num_samples=8"]
    proc = subprocess.Popen([sys.executable, "-m", "ds_trainer", *args], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def three_steps() -> bool:
        return bool(list(tmp_path.glob("outputs/runs/*/*/metrics.jsonl"))) and len(metrics(run_dirs(tmp_path)[0])) >= 3

    wait_until(three_steps, "the run ended before the signal", proc=proc, deadline=time.time() + 300, interval=0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Traceback" not in err  # 128 + SIGTERM, as a shell reports it
    (first,) = run_dirs(tmp_path)
    stopped = summary(first)
    assert stopped["status"] == "interrupted" and 3 <= stopped["steps"] < 16
    saved = first / "checkpoints" / f"step_{stopped['steps']:08d}"
    assert (saved / "COMPLETE").is_file()
    assert f"stopped by SIGTERM after step {stopped['steps']}; checkpoint {saved}" in err
    resumed = run_cli(*args, "resume=latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = run_dirs(tmp_path)[1]
    assert metrics(second)[0]["step"] == stopped["steps"] + 1 and summary(second)["steps"] == 16


def test_two_ranks_never_write_the_same_file(tmp_path: Path) -> None:
    """Every file a rank opens for writing (through Python) is logged by an audit hook; the logs of the
    two ranks of one run share no path under the run's outputs."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        "log = open(os.path.join(os.environ['WRITE_LOG_DIR'], f'{os.getpid()}.log'), 'a', buffering=1)\n"
        "def audit(event, args):\n"
        "    path = None\n"
        "    if event == 'open' and isinstance(args[0], str) and args[1] and any(c in str(args[1]) for c in 'wax+'):\n"
        "        path = args[0]\n"
        "    elif event == 'os.rename':\n"
        "        path = os.fsdecode(args[1])\n"
        "    if path:\n"
        "        log.write(f\"{os.environ.get('RANK', '-')} {os.path.abspath(path)}\\n\")\n"
        "sys.addaudithook(audit)\n")
    logs = tmp_path / "writes"
    logs.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}", "WRITE_LOG_DIR": str(logs)}
    cmd = [*torchrun(2), "-m", "ds_trainer", "zero=stage3",
           "train.max_steps=2", "data.num_samples=4", "train.checkpoint_every=1"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    by_rank: dict[str, set[str]] = {}
    for line in "".join(p.read_text() for p in logs.iterdir()).splitlines():
        rank, path = line.split(" ", 1)
        if path.startswith(str(tmp_path / "outputs")):
            by_rank.setdefault(rank, set()).add(path)
    assert set(by_rank) >= {"0", "1"}, by_rank.keys()  # both wrote (rank 1: its share of the latent cache)
    assert not by_rank["0"] & by_rank["1"], by_rank["0"] & by_rank["1"]
    assert any(p.endswith("metrics.jsonl") for p in by_rank["0"])
    assert not any(p.endswith(("metrics.jsonl", "summary.json", "config.yaml")) for p in by_rank["1"])
