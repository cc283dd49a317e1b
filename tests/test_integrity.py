"""Damaged checkpoints: a file truncated or changed after its COMPLETE marker was written is found before
anything loads; `resume=latest` goes on from the newest intact checkpoint, `resume=<damaged>` stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import run_cli, run_dirs
from test_train import metrics, summary, unet_weights

from ds_trainer.train.state import checkpoint, integrity

torch = pytest.importorskip("torch")

ARGS = ["zero=stage2", "offload=none", "logger=none", "train.max_steps=6", "train.checkpoint_every=2",
        "train.checkpoints_to_keep=3", "data.num_samples=8", "train.export=true"]


def test_the_marker_records_every_file_and_finds_truncation_and_changed_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"a" * 1000)
    (folder / "sub" / "b.bin").write_bytes(b"b" * 1000)
    recorded = integrity.manifest(folder)
    assert sorted(recorded["files"]) == ["a.bin", "sub/b.bin"]
    assert integrity.damage(folder, recorded) is None
    data = bytearray((folder / "sub" / "b.bin").read_bytes())
    data[500] ^= 0xFF
    (folder / "sub" / "b.bin").write_bytes(bytes(data))
    assert "sub/b.bin has changed" in (integrity.damage(folder, recorded) or "")
    assert integrity.damage(folder, recorded, hashes=False) is None  # same size: only the hash sees it
    (folder / "a.bin").write_bytes(b"a" * 10)
    assert "a.bin is 10 bytes, 1000" in (integrity.damage(folder, recorded) or "")
    assert integrity.damage(folder, {"step": 3}) is None  # a marker from before files were recorded


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_by_latest_and_refused_by_name(tmp_path: Path) -> None:
    first = run_cli(*ARGS, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    reference = unet_weights(run / "unet")
    newest = run / "checkpoints" / "step_00000006"
    marker = json.loads((newest / "COMPLETE").read_text())
    assert marker["hash"] in ("xxh3_128", "blake2b")
    assert {"size", "hash"} <= set(next(iter(marker["files"].values())))
    files = sorted((p for p in newest.rglob("*") if p.is_file() and p.name != "COMPLETE"),
                   key=lambda p: p.stat().st_size)
    assert len(files) >= 2 and all(f.relative_to(newest).as_posix() in marker["files"] for f in files)
    flipped, truncated = files[-1], files[-2]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = bytes(b ^ 0x5A for b in data[len(data) // 2: len(data) // 2 + 8])
    flipped.write_bytes(bytes(data))
    assert "has changed" in (checkpoint.damaged(newest) or "")
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])

    by_name = run_cli(*ARGS, f"resume={newest}", cwd=tmp_path)
    assert by_name.returncode == 2, by_name.stderr[-3000:]
    assert "Traceback" not in by_name.stderr + by_name.stdout
    assert f"resume={newest}" in by_name.stderr and "damaged" in by_name.stderr
    assert truncated.name in by_name.stderr and "resume=latest" in by_name.stderr

    latest = run_cli(*ARGS, "resume=latest", cwd=tmp_path)
    assert latest.returncode == 0, latest.stderr[-3000:]
    assert f"skipping the damaged checkpoint {newest}" in latest.stderr
    resumed = [d for d in run_dirs(tmp_path) if d != run and (d / "metrics.jsonl").exists()]
    (second,) = [d for d in resumed if summary(d)["status"] == "ok"]
    assert [r["step"] for r in metrics(second)] == [5, 6]  # from step 4, the newest intact one
    got = unet_weights(second / "unet")
    for key in reference:  # the same weights as the run that was never damaged
        assert torch.equal(got[key], reference[key]), key
