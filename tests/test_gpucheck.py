"""The GPU check (`python -m ds_trainer.gpucheck`), its device calls rehearsed here in a short form
(python -m ds_trainer.gpucheck.rehearse --short), so the kit works before a GPU machine exists, and
the wheelhouse it is carried with.

One rehearsal runs for the module: the two device calls' exact command (docs/gpu-check.md) in a
copy of what the tool sends, under its limits, each call cut to a few steps on a small budget:
call 1 the machine step with a timeout it cannot meet and a resume whose source step did not run
(it fails), call 2 (on the same "machine") a real-size cell in its CPU form (it measures) and the
Flux step. The tests read what a user reads: what came back in each call's $OUT, as it was
rewritten, and the calibration lines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg

from ds_trainer.config import checks, hardware, toolkit
from ds_trainer.gpucheck import rehearse, results, runner, wheelhouse
from ds_trainer.gpucheck.steps import BUILDERS, GPU_BUDGET_S, PART_BUDGET_S, sequence

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = float(rehearse.SHORT[rehearse.SHORT.index("--budget-s") + 1])
GPU = hardware.PlatformInfo("cuda", bf16=True, fp16=True, gpu_name="NVIDIA H100 80GB HBM3",
                            gpu_memory_mib=81559)


def _done(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["done"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def check(module_tmp: Any) -> dict[str, Any]:
    """Rehearse both calls once; what each call's $OUT/results.json said each time it changed."""
    root = module_tmp("gpucheck")
    cmd = [sys.executable, "-m", "ds_trainer.gpucheck.rehearse", "--short", "--json", "--keep",
           str(root)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen: dict[int, list[int]] = {1: [], 2: []}
    while proc.poll() is None:
        for part in seen:
            done = _done(root / f"out{part}" / "results.json")
            if done is not None and (not seen[part] or seen[part][-1] != done):
                seen[part].append(done)
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, (stdout[-3000:], stderr[-3000:])
    for part in seen:  # the last writes may fall between two looks
        final = _done(root / f"out{part}" / "results.json")
        if final is not None and (not seen[part] or seen[part][-1] != final):
            seen[part].append(final)
    outs = {part: json.loads((root / f"out{part}" / "results.json").read_text()) for part in seen}
    return {"root": root, "elapsed": time.monotonic() - start, "seen": seen, "output": stderr,
            "report": json.loads(stdout), "results": outs}


def _rows(check: dict[str, Any], part: int = 2) -> dict[str, dict[str, Any]]:
    return {row["step"]: row for row in check["results"][part]["steps"]}


def test_each_call_brings_back_its_results_under_the_device_limits(check: dict[str, Any]) -> None:
    """The rehearsal held every limit: the tree under 64 MiB, each call well inside 600 s with its
    install, four plain files back from $OUT."""
    report = check["report"]
    assert report["problems"] == [], report
    assert report["tree_mib"] < rehearse.TREE_MIB
    for call in report["calls"]:
        assert call["seconds"] < BUDGET_S + 60 and call["rc"] in (0, 1), call
        assert sorted(call["returned"]) == ["logs.tgz", "plan_calibration.jsonl", "results.json",
                                            "results.md"]


def test_results_reach_out_after_every_step(check: dict[str, Any]) -> None:
    """A call killed at any moment keeps what it measured: $OUT's results.json grew one step at a
    time while the call ran (review 3's K2)."""
    # The machine step's row is there seconds before the others; the last ones may be written
    # within one look (a failed resume and a finished build end fast).
    for part, steps in ((1, 3), (2, 2)):
        seen = check["seen"][part]
        assert seen[0] == 1 and seen[-1] == steps and seen == sorted(set(seen)), check["seen"]
    with tarfile.open(check["root"] / "out2" / "logs.tgz") as tar:
        names = tar.getnames()
    assert "logs/sdxl_zero2.log" in names and "runs/sdxl_zero2/summary.json" in names


def test_the_second_call_continues_where_the_first_stopped(check: dict[str, Any]) -> None:
    """Call 2 runs what call 1 did not, in a fresh work folder, and brings back both calls' rows
    (review 3's K6: nothing continues from an earlier run's checkpoints)."""
    first, second = check["results"][1], check["results"][2]
    assert [r["step"] for r in first["steps"]] == ["machine", "tiny_fsdp_cpu_resume",
                                                   "ops_fused_adam"]
    assert [(r["step"], r["call"]) for r in second["steps"]] == [
        ("machine", 1), ("tiny_fsdp_cpu_resume", 1), ("ops_fused_adam", 1), ("sdxl_zero2", 2),
        ("flux_dev_lora", 2)]
    assert first["command"].split("--out ")[1].split()[0] != \
        second["command"].split("--out ")[1].split()[0]


def test_a_timeout_and_a_failure_are_recorded_and_the_next_step_runs(check: dict[str, Any]) -> None:
    rows = _rows(check, 1)
    assert rows["machine"]["status"] == "timeout"
    assert "no result within 3 s" in rows["machine"]["error"]
    failed = rows["tiny_fsdp_cpu_resume"]
    assert failed["status"] == "failed"
    assert "resume" in failed["error"] and "checkpoint" in failed["error"], failed["error"]
    assert check["report"]["calls"][0]["rc"] == 1  # a step that did not pass: the exit status
    assert f"**{failed['error']}**" in (check["root"] / "out1" / "results.md").read_text()


def test_the_op_build_runs_in_the_background_and_its_step_waits_for_it(
        check: dict[str, Any]) -> None:
    """Review 3's K3: FusedAdam's build starts when the call starts, its step records the build, and
    the run that loads it starts once it is built (in call 2 as well: found built)."""
    build = _rows(check, 1)["ops_fused_adam"]
    assert build["status"] == "ok" and "FusedAdamBuilder: ready" in build["note"], build
    for part in (1, 2):
        logs = list((check["root"] / "machine").glob("call-*/logs/build_fused_adam.log"))
        assert len(logs) == 2 and all("ready" in log.read_text() for log in logs), part
    assert _rows(check)["sdxl_zero2"]["status"] == "ok"


def test_a_real_size_cell_is_measured_against_the_planner(check: dict[str, Any]) -> None:
    """The CPU form's real-size cell: s/it after warm-up, host RSS, the planner's estimate from the
    run's own log, and a calibration line in the tuner's form."""
    row = _rows(check)["sdxl_zero2"]
    assert row["status"] == "ok", row
    assert row["s_per_it"] > 0 and row["host_rss_gib"] > 0.1
    assert row["plan_gib"] > 0 and row["plan"]["activations"] > 0
    assert row["gpu_alloc_gib"] is None and row["measured_over_planned"] is None  # no GPU here
    text = (check["root"] / "out2" / "plan_calibration.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["cell"] for r in records] == ["gpucheck-sdxl_zero2"]
    record = records[0]
    assert record["model"] == "sdxl_tiny" and record["device"] == "cpu"
    assert record["measure"] == "host_rss_loop" and record["measured_activation_bytes"] > 0
    assert record["predicted_activation_bytes"] == int(row["plan"]["activations"] * 2**30)


def test_the_budget_holds(check: dict[str, Any]) -> None:
    """The last step runs on what the others left, and each call ends within its budget."""
    rows = check["results"][2]["steps"]
    for part in (1, 2):
        mine = [r for r in rows if r["call"] == part]
        assert sum(r.get("elapsed_s", 0) for r in mine) <= BUDGET_S
        assert check["results"][part]["elapsed_s"] <= BUDGET_S + 5
    flux = rows[-1]
    used = sum(r.get("elapsed_s", 0) for r in rows if r["call"] == 2 and r is not flux)
    if flux["status"] == "skipped":
        assert "budget spent" in flux["error"]
    else:
        assert flux["timeout_s"] <= BUDGET_S - used  # greedy, capped by the budget


def test_a_broken_limit_fails_the_rehearsal(tmp_path: Path) -> None:
    """Each of the tool's limits, broken, is named: too many files, one too big, a name or a depth
    the tool does not bring back, no results; a command past its wall clock is stopped."""
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    for i in range(8):
        (out / f"f{i}.txt").write_text("x")
    (out / "a" / "b" / "c" / "deep.txt").write_text("x")
    (out / "bad name.txt").write_text("x")
    with (out / "big.bin").open("wb") as f:
        f.truncate(17 * 2**20)
    said = " | ".join(rehearse.returned(out)[1])
    for words in ("11 files", "big.bin is 17.0 MiB", "more than 2 folders", "bad name.txt: only",
                  "no results.json"):
        assert words in said, said
    (out / "results.json").write_text("{}")
    for path in [*out.glob("f*.txt"), out / "big.bin", out / "bad name.txt"]:
        path.unlink()
    shutil.rmtree(out / "a")
    assert rehearse.returned(out)[1] == []
    rc, seconds = rehearse.run("sleep 30", tmp_path, dict(os.environ), limit=1)
    assert rc is None and seconds < 10
    assert "over 64 MiB" in " ".join(rehearse.tree_problems(60 * 2**20, 5 * 2**20))
    assert rehearse.tree_problems(3 * 2**20, 32 * 2**20) == []


def test_the_docs_give_the_rehearsed_commands() -> None:
    """docs/gpu-check.md shows each call's command and carry exactly as the rehearsal runs them."""
    page = (REPO / "docs" / "gpu-check.md").read_text()
    carry = json.dumps(list(rehearse.CARRY))
    for part in PART_BUDGET_S:
        line = f'run(command="{rehearse.command(part, [])}", carry={carry}, timeout_s=600)'
        assert line in page, line


def _gpu_machine_kit() -> toolkit.Toolkit:
    """The GPU machine's CUDA toolkit (nvcc 13.0 beside torch's cu130): a stand-in, since nvcc
    cannot run here."""
    return toolkit.Toolkit(torch_cuda="13.0", cuda_home="/usr/local/cuda", nvcc="13.0",
                           minor_mismatch_ok={}, prebuilt=frozenset())


def test_every_gpu_step_passes_the_products_own_check_on_a_gpu(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Review 3's K1: the CPU form swaps fp16 for bf16, so a GPU step the product refuses never
    showed. Each GPU step is checked on a CUDA platform, as the GPU machine checks it; the ops each
    declares are the ones it loads there, and each comes after the wait for its op's build (K3);
    each part's timeouts fit its budget."""
    monkeypatch.setattr(toolkit, "probe", _gpu_machine_kit)
    no_triton = importlib.util.find_spec("triton") is None  # the GPU machine has Triton 3.6
    gpu = sequence(cpu=False)
    waited: set[str] = set()
    for step in gpu:
        if step.kind == "build":
            waited.add(step.args[0])
        if step.kind != "train":
            continue
        if step.tagged_images:  # the files the step's command names, as the check writes them
            runner.write_tagged_images(tmp_path / "data" / step.name, step.tagged_images)
        if step.reference_image:
            runner.write_reference(tmp_path / "data" / "reference.png")
        args = [a for a in runner.command(step, tmp_path)[3:] if not a.startswith("resume=")]
        report = checks.check(make_cfg("platform=cuda", *args), info=GPU)
        problems = [p for p in report.problems
                    if not (no_triton and p.key == "train.compile" and "Triton" in p.why)]
        assert problems == [], (step.name, report.render())
        assert set(step.ops) == set(toolkit.needed_ops(report.cfg)) & set(BUILDERS), step.name
        assert set(step.ops) <= waited, f"{step.name} loads {step.ops} before their build's wait"
    assert any("precision=fp16" in s.args and "zero=stage2" in s.args for s in gpu)  # DeepSpeed fp16
    for part, budget in PART_BUDGET_S.items():
        assert sum(s.timeout_s for s in gpu if s.part == part) <= budget, part
    assert sum(PART_BUDGET_S.values()) == GPU_BUDGET_S
    assert [s.name for s in gpu] == [s.name for s in sequence(cpu=True)]
    for step in sequence(cpu=True):
        if step.kind == "train":
            assert str(make_cfg(*step.args).model.name) == step.overrides.get("model", "sdxl_tiny")


def test_a_gpu_measure_is_never_filed_as_the_cpus() -> None:
    """Review 3's K5: a real-size cell measured on the GPU, after a machine step that gave no GPU
    name, gets no calibration record rather than one labelled `device: cpu`."""
    step = next(s for s in sequence(cpu=False) if s.name == "sdxl_zero2")
    row = {"status": "ok", "plan": {"gpu": 10.0, "activations": 2.0},
           "run_summary": {"gpu_mem_peak_allocated_mib": 9000.0}}
    assert results.calibration_record(row, step, {}) is None
    record = results.calibration_record(row, step, {"gpu_name": "NVIDIA H100 80GB HBM3"})
    assert record is not None and record["device"] == "cuda:NVIDIA H100 80GB HBM3"


def _wheel(folder: Path, name: str, version: str, requires: list[str],
           files: dict[str, bytes] | None = None) -> Path:
    info = f"{name}-{version}.dist-info"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)]).encode()
    folder.mkdir(parents=True, exist_ok=True)
    return rehearse.write_wheel(folder / f"{name}-{version}-py3-none-any.whl",
                                {**(files or {}), f"{info}/METADATA": meta}, info, "py3-none-any")


def test_the_wheelhouse_check_reads_the_machines_versions(tmp_path: Path) -> None:
    """A carried wheel that needs a newer version of what the GPU machine has (or something
    neither has) is named; bitsandbytes keeps only the native libraries the machine loads."""
    _wheel(tmp_path / "core", "needs_hub", "1.0", ["huggingface-hub>=1.40", "torch>=2.0"])
    _wheel(tmp_path / "core", "needs_nothing", "1.0", ["tokenizers<0.24,>=0.23.1", "diffusers"])
    _wheel(tmp_path / "core", "diffusers", "0.42.1", [])
    _wheel(tmp_path / "core", "needs_missing", "1.0", ["no-such-package"])
    said = " | ".join(wheelhouse.check(tmp_path))
    assert "needs huggingface-hub>=1.40, and the GPU machine would have huggingface-hub 1.33.0" in said
    assert "needs no-such-package, which is neither" in said and "needs_nothing" not in said
    libs = {f"bitsandbytes/libbitsandbytes_{v}.so": b"\0" * 1000 for v in ("cpu", "cuda128", "cuda130",
                                                                          "rocm64")}
    bnb = _wheel(tmp_path / "bnb", "bitsandbytes", "0.50.2", [], libs)
    assert wheelhouse.trim_native(bnb, ("_cpu.so", "_cuda130.so")) > 0
    with zipfile.ZipFile(bnb) as z:
        kept = sorted(n for n in z.namelist() if n.endswith(".so"))
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert kept == ["bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"]
    assert "cuda128" not in record and "cuda130" in record
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(tmp_path / "site"), str(bnb)], check=True)
    assert (tmp_path / "site" / "bitsandbytes" / "libbitsandbytes_cuda130.so").exists()


WHEELHOUSE = REPO / ".wheelhouse"
# Building the wheelhouse needs the network: without one already built this is a `make test-long` test.
_long_unless_built = (lambda test: test) if (WHEELHOUSE / "core").is_dir() else pytest.mark.long


@_long_unless_built
def test_wheelhouse_core_installs_offline_and_runs_the_check(tmp_path: Path) -> None:
    """The core set installs without network into a clean folder, and with it (and this machine's
    torch) the check's CPU form trains: what the GPU machine does with it."""
    if not (WHEELHOUSE / "core").is_dir():
        subprocess.run([sys.executable, "-m", "ds_trainer.gpucheck.wheelhouse", "--out",
                        str(WHEELHOUSE), "--constraints", str(REPO / "constraints.txt"), "--sets",
                        "core"], cwd=REPO, check=True)
    target = tmp_path / "site"
    wheels = sorted(str(w) for w in (WHEELHOUSE / "core").glob("*.whl"))
    # As the GPU machine installs them (CPython 3.12 on a glibc the wheelhouse's platforms cover;
    # torchao's wheel is manylinux_2_28): pip checks every wheel's tags against that interpreter.
    platforms = [arg for platform in wheelhouse.PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(target), "--python-version", "3.12", "--implementation", "cp",
                    "--abi", "cp312", "--only-binary=:all:", *platforms, *wheels], check=True)
    if sys.version_info[:2] != (3, 12):  # a cp312 extension (pydantic_core) does not load here:
        for wheel in (WHEELHOUSE / "core").glob("*-cp312-*.whl"):  # this Python's own build of
            name, version = wheel.name.split("-")[:2]  # the same pinned version stands in
            assert metadata.version(name) == version, f"this Python's {name} is not {version}"
            for path in [target / name, *target.glob(f"{name}-*.dist-info")]:
                shutil.rmtree(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(target)])}
    carried = ("deepspeed", "diffusers", "hydra", "omegaconf", "pydantic", "peft", "transformers")
    code = (f"import {', '.join(carried)}, ds_trainer.cli, ds_trainer.train.recipe; "
            f"print('FROM', {', '.join(f'{m}.__file__' for m in carried)})")
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.splitlines()  # DeepSpeed prints on stdout too
    where = next(line for line in printed if line.startswith("FROM ")).split()[1:]
    assert len(where) == len(carried) and all(p.startswith(str(target)) for p in where), where
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "ds_trainer.gpucheck", "--cpu", "--out", str(out),
                           "--only", "tiny_ddp", "--timeout", "tiny_ddp=300"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=400)
    row = json.loads((out / "results.json").read_text())["steps"][0]
    assert row["status"] == "ok", (row, proc.stdout[-2000:])


@pytest.mark.long
def test_both_calls_rehearsed_with_the_real_wheels_hold_every_limit(tmp_path: Path) -> None:
    """The full rehearsal: both calls' exact commands with the carried wheel sets (built here if
    missing), each under 600 s with its install, on the CPU form of the whole sequence."""
    if not all((REPO / p).is_dir() for p in rehearse.CARRY):
        subprocess.run([sys.executable, "-m", "ds_trainer.gpucheck.wheelhouse", "--out",
                        str(WHEELHOUSE), "--constraints", str(REPO / "constraints.txt"), "--sets",
                        "core", "bnb"], cwd=REPO, check=True)
    report = rehearse.rehearse([1, 2], [], tmp_path)
    assert report["problems"] == [], report
    assert report["carried"] == list(rehearse.CARRY)
