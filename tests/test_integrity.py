"""Damaged checkpoints: a file truncated or changed after its COMPLETE marker was written is found before
anything loads; `resume=latest` goes on from the newest intact checkpoint, `resume=<damaged>` stops. And
checkpoints from elsewhere: a pickle planted in one never runs unless `resume_trust_native=true`."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.cli import run_cli, run_dirs
from test_train import metrics, summary, unet_weights

from ds_trainer.config import trust
from ds_trainer.errors import TrainingError
from ds_trainer.train.state import checkpoint, integrity, portable

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


@pytest.fixture(scope="module")
def damaged(module_tmp: Callable[[str], Path]) -> tuple[Path, Path]:
    """A ZeRO-2 run of 6 steps with checkpoints at 2, 4 and 6: the working folder it ran in, and its run folder."""
    cwd = module_tmp("damaged")
    first = run_cli(*ARGS, cwd=cwd)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = run_dirs(cwd)
    return cwd, run


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_by_latest_and_refused_by_name(damaged: tuple[Path, Path]) -> None:
    tmp_path, run = damaged
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


class _Payload:
    """What a planted pickle does when it is unpickled: create a file (any code could run instead)."""

    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.proof), "w")


def _plant(folder: Path, proof: Path, keep: tuple[str, ...] = ()) -> list[str]:
    """A payload in place of every pickle of a checkpoint (torch's zip files, plain pickles) but `keep`, and the
    marker's record of its files rewritten to match, as whoever planted them would: its signature then fails."""
    planted = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        head = path.read_bytes()[:2]
        if (head == b"PK" or head[:1] == b"\x80") and path.name not in keep:
            path.write_bytes(pickle.dumps(_Payload(proof)))
            planted.append(path.relative_to(folder).as_posix())
    marker = json.loads((folder / "COMPLETE").read_text())
    (folder / "COMPLETE").write_text(json.dumps({**marker, **checkpoint.record_files(folder)}))
    return planted


@pytest.mark.slow
def test_a_pickle_planted_in_a_checkpoint_from_elsewhere_never_runs_unless_trusted(damaged: tuple[Path, Path],
                                                                                    tmp_path: Path) -> None:
    run = damaged[1]
    own = run / "checkpoints" / "step_00000002"
    assert trust.trusted(json.loads((own / "COMPLETE").read_text()))  # this user's run signed what it wrote
    elsewhere, proof = tmp_path / "from_a_colleague" / "step_00000002", tmp_path / "payload_ran"
    shutil.copytree(own, elsewhere)
    planted = _plant(elsewhere, proof, keep=("scheduler.pt",))  # the weights-only files: below, and test_portable
    assert any(p.startswith("pytorch_model/") for p in planted) and "random_states_0.pkl" in planted, planted
    assert checkpoint.damaged(elsewhere) is None  # its files match the rewritten record

    resumed = run_cli(*ARGS, f"resume={elsewhere}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not proof.exists(), "a planted pickle ran"
    (second,) = [d for d in run_dirs(tmp_path) if (d / "metrics.jsonl").exists()]
    assert "it resumes through its portable state" in resumed.stderr
    warnings = yaml.safe_load((second / "config.yaml").read_text())["resolved"]["warnings"]
    assert any(str(elsewhere) in w and "not written by this user's runs" in w for w in warnings), warnings
    rows = {r["step"]: r["loss"] for r in metrics(second) if "loss" in r}
    reference = {r["step"]: r["loss"] for r in metrics(run) if "loss" in r}
    assert sorted(rows) == [3, 4, 5, 6]
    for step, loss in rows.items():  # the same training as the run the checkpoint came from
        assert loss == pytest.approx(reference[step], rel=1e-4, abs=1e-6), (step, loss, reference[step])

    (tmp_path / "trusting").mkdir()
    trusting = run_cli(*ARGS, f"resume={elsewhere}", "resume_trust_native=true", cwd=tmp_path / "trusting")
    assert proof.exists(), f"resume_trust_native=true loaded the native files: {trusting.stderr[-2000:]}"


def test_the_files_ds_trainer_reads_itself_refuse_a_planted_or_damaged_file_by_name(tmp_path: Path) -> None:
    """The EMA, the LR schedule (weights-only) and the portable shards (safetensors), one screen each."""
    proof = tmp_path / "payload_ran"
    (tmp_path / "ema.pt").write_bytes(pickle.dumps(_Payload(proof)))
    with pytest.raises(TrainingError, match=r"ema\.pt is not the EMA state a run writes"):
        portable.saved_state(tmp_path / "ema.pt", "EMA")
    (tmp_path / "portable").mkdir()
    (tmp_path / "portable" / "state-00001.safetensors").write_bytes(pickle.dumps(_Payload(proof)))
    reader = portable.Reader(tmp_path, {"index": {"fp32/w": "state-00001.safetensors"}})
    with pytest.raises(TrainingError, match=r"state-00001\.safetensors cannot be read .* reading fp32/w"):
        reader.get("fp32/w")
    assert not proof.exists()


def test_a_checkpoint_from_elsewhere_without_what_the_portable_state_carries_is_refused_up_front(
        tmp_path: Path) -> None:
    """Not this user's, and nothing safe to resume from instead: refused before anything starts, with the trust
    option as the fix; a damaged portable record is named too."""
    from helpers.cfg import make_cfg

    from ds_trainer.config import checks, portability

    def resolved(*args: str) -> Any:
        return checks.check(make_cfg("zero=stage2", f"resume={folder}", *args)).cfg

    folder = tmp_path / "step_00000002"
    folder.mkdir()
    (folder / "COMPLETE").write_text(json.dumps({"step": 2, "layout": {}}))  # train.portable_state=false's
    cfg = resolved()
    (problem,), _ = portability.check(cfg, folder)
    assert problem.key == "resume" and "not written by this user's runs" in problem.why, problem
    assert "resume_trust_native=true" in problem.fix
    assert portability.check(resolved("resume_trust_native=true"), folder) == ([], [])
    signed = trust.signed({"step": 2, "layout": {}})  # the user's own: resumes natively, nothing said
    (folder / "COMPLETE").write_text(json.dumps(signed))
    assert portability.check(cfg, folder) == ([], [])
    (folder / "portable").mkdir()
    (folder / "portable" / "meta.json").write_text('{"step": 2')  # cut short
    (problem,), _ = portability.check(cfg, folder)
    assert "portable/meta.json cannot be read" in problem.why, problem
