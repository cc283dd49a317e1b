"""Property test: generated override sets (100, and 2500 in `make test-long`), run as a user runs them (dry
run). Each either runs or exits 2 with a one-screen message naming a key or value it was given; none prints a
traceback.

The sets give every config group choices of every type (integers, floats, booleans, lists, empty, null,
unknown names, near-misses of real names, several values without -m), plain keys wrong types, and
Hydra's own keys (run and sweep folders, job.chdir, launcher fields). Most run in-process through the
same entry function as `python -m ds_trainer` (fast); a sample runs as real subprocesses, `plan` too,
to show nothing reaches the terminal as a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cfg import group_options
from helpers.cli import cli_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GROUPS: dict[str, list[str]] = {}
for _group, _option in group_options():
    GROUPS.setdefault(_group, []).append(_option)
GROUPS["+lever"] = GROUPS.pop("lever")  # a sweep's cell (conf/lever/), added to the defaults as +sweep is
# A real sweep option starts a sweep of processes (tested in test_sweeps.py): here only its near-misses.
GROUPS["+sweep"] = ["zero_ofload", "resolutions", "batch"]
REAL_SWEEPS = {"zero_offload", "resolution", "batch_size"}
GROUPS["hydra/launcher"] = ["basic", "submitit_local", "ds_submitit_local"]
GROUPS["hydra/job_logging"] = ["default", "disabled", "none"]

NUMBERS = ["train.max_steps", "train.micro_batch_size", "train.gradient_accumulation_steps", "resolution.width",
           "resolution.height", "world_size", "train.checkpoint_every", "scheduler.warmup_steps", "zero.stage"]
FLOATS = ["optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "train.gradient_clipping", "train.ema_decay",
          "scheduler.cos_min_ratio", "train.min_snr_gamma"]
STRINGS = ["optimizer.name", "resume", "model.pretrained", "train.ema", "offload.params", "platform", "logger.mode"]
UNKNOWN = ["train.lr", "optimizer.beta1", "zero.stage3_prefetch", "batch_size", "foo.bar", "hydra.launcher.nope"]
HYDRA_VALUES = {
    "hydra.job.chdir": ["true", "false", "maybe", "1", "[true]", "null"],
    "hydra.launcher.timeout_min": ["5", "abc", "1.5"],
    "hydra.job.name": ["fuzz", "''"],
    "hydra.verbose": ["false", "true", "ds_trainer"],
}


def _near_miss(option: str) -> st.SearchStrategy[str]:
    return st.sampled_from([option[:-1], option.upper(), option + "x", option.replace("_", "-"), option[1:],
                            option.replace("stage", "zero"), option[::-1]]).filter(bool)


def _group_value(group: str) -> st.SearchStrategy[str]:
    real = st.sampled_from(GROUPS[group])
    return st.one_of(
        real, real, real,
        st.integers(-4, 4096).map(str),
        st.floats(-10, 2000, allow_nan=False).map(lambda f: f"{f!r}"),
        st.sampled_from(["true", "false", "null", "", "''", "none", "latest", "[]"]),
        st.lists(real, min_size=1, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(real, min_size=2, max_size=3).map(",".join),  # a sweep without -m
        real.flatmap(_near_miss),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=10),
    ).filter(lambda v: group != "+sweep" or v not in REAL_SWEEPS)  # a real sweep runs processes


def _dir_value(tmp: str) -> st.SearchStrategy[str]:
    return st.sampled_from([f"{tmp}/run_a", "outputs/custom", "/etc/passwd/x", "/proc/nope/x", f"{tmp}/f/sub",
                            "''", "null"])


number = st.one_of(st.integers(-10, 5000).map(str), st.sampled_from(["abc", "1.5", "1e3", "null", "", "[1,2]",
                                                                    "1,2", "true"]))
floating = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32).map(lambda f: f"{f!r}"),
                     st.sampled_from(["-1", "0", "1e-4", "2", "x", "null", "[0.1]", "true"]))
text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-0123456789AW", min_size=1, max_size=12)


def override(tmp: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(sorted(GROUPS)).flatmap(lambda g: _group_value(g).map(lambda v: f"{g}={v}")),
        st.sampled_from(sorted(GROUPS)).flatmap(lambda g: _group_value(g).map(lambda v: f"{g}={v}")),
        st.sampled_from(NUMBERS).flatmap(lambda k: number.map(lambda v: f"{k}={v}")),
        st.sampled_from(FLOATS).flatmap(lambda k: floating.map(lambda v: f"{k}={v}")),
        st.sampled_from(STRINGS).flatmap(lambda k: st.one_of(text, st.sampled_from(["latest", "true", "auto", "cpu"]))
                                         .map(lambda v: f"{k}={v}")),
        st.sampled_from(UNKNOWN).flatmap(lambda k: st.sampled_from(["", "+"]).map(lambda plus: f"{plus}{k}=1")),
        st.sampled_from(["hydra.run.dir", "hydra.sweep.dir"]).flatmap(lambda k: _dir_value(tmp)
                                                                       .map(lambda v: f"{k}={v}")),
        st.sampled_from(sorted(HYDRA_VALUES)).flatmap(lambda k: st.sampled_from(HYDRA_VALUES[k])
                                                      .map(lambda v: f"{k}={v}")),
    )


def override_sets(tmp: str) -> st.SearchStrategy[list[str]]:
    return st.lists(override(tmp), min_size=1, max_size=4, unique_by=lambda o: _key(o))


def _key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+")


def _check(overrides: list[str], code: int, output: str, places: list[Path]) -> None:
    assert "Traceback" not in output, (overrides, output)
    if code == 0:
        assert any(list(p.glob("**/config.yaml")) for p in places), (overrides, output)
        return
    assert code == 2, (overrides, code, output)
    if any(o.startswith("hydra.verbose=") and not o.endswith("=false") for o in overrides):
        output = output[output.find("ds_trainer: "):]  # Hydra's debug log, asked for, comes first
    assert len(output.splitlines()) <= 25, (overrides, output)
    named = [_key(o) for o in overrides] + [o.split("=", 1)[1] for o in overrides]
    assert any(part and part in output for part in named), (overrides, output)


FIXED = str(Path("/tmp") / f"ds_trainer_fuzz_{os.getpid()}")


def _one_set(tmp_path_factory: pytest.TempPathFactory, overrides: list[str]) -> None:
    cwd: Path = tmp_path_factory.mktemp("fuzz")
    shutil.rmtree(f"{FIXED}/run_a", ignore_errors=True)
    Path(FIXED).mkdir(exist_ok=True)
    (Path(FIXED) / "f").write_text("a file where a folder is expected")
    code, output = cli_in_process([*overrides, "dry_run=true", f"offload.nvme_path={cwd}/swap"], cwd)
    _check(overrides, code, output, [cwd, Path(FIXED) / "run_a"])


# 50 sets in the default suite (about 30 s; CI budget), 2500 in `make test-long` (FUZZ_EXAMPLES overrides both).
@pytest.mark.slow
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "50")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(overrides=override_sets(FIXED))
def test_generated_overrides_run_or_fail_with_one_screen_naming_the_key(tmp_path_factory: pytest.TempPathFactory,
                                                                        overrides: list[str]) -> None:
    _one_set(tmp_path_factory, overrides)


@pytest.mark.long
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "2500")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(overrides=override_sets(FIXED))
def test_many_more_generated_overrides_run_or_fail_with_one_screen(tmp_path_factory: pytest.TempPathFactory,
                                                                  overrides: list[str]) -> None:
    _one_set(tmp_path_factory, overrides)


# The classes of the issue, as real processes: python -m ds_trainer, python -m ds_trainer.plan and .tune.
SAMPLE = [
    ["zero=2"], ["precision=16"], ["resolution=1024"], ["offload=true"], ["zero=stage9"], ["zero=[stage2,stage3]"],
    ["zero="], ["hydra/launcher=nope"], ["train.max_steps=1.5"], ["train.max_steps=abc"], ["train.max_steps=1,2"],
    ["train.max_steps=[1,2]"], ["train.lr=3"], ["hydra.job.chdir=maybe"], ["hydra.run.dir=/proc/nope/x"],
    ["hydra.run.dir=/etc/passwd/x"], ["-m", "hydra.sweep.dir=/etc/passwd/x", "zero=stage2,stage3"],
    ["-m", "zero=stage2,2"], ["-m", "zero=stage2,stage3", "hydra.launcher.nope=1"],
    ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=abc"], ["train.max_steps=${oops}"], ["'bad"],
]


def _for_plan(overrides: list[str]) -> bool:
    """The planner composes without Hydra's run/sweep machinery: no -m, no run folder, no interpolation."""
    return "-m" not in overrides and not any(o.startswith("hydra.") or "${" in o for o in overrides)


CASES = [("ds_trainer", s) for s in SAMPLE] + [("ds_trainer.plan", s) for s in SAMPLE if _for_plan(s)]
# The tuner composes as the planner does (it ended in Hydra's traceback on an unparsable argument such as --help).
CASES += [("ds_trainer.tune", s) for s in (["zero=stage9"], ["'bad"], ["train.max_steps=abc"])]


@pytest.mark.slow
@pytest.mark.parametrize(("module", "overrides"), CASES, ids=[f"{m} {' '.join(s)}" for m, s in CASES])
def test_mistakes_reach_the_terminal_as_one_screen_without_traceback(tmp_path: Path, module: str,
                                                                     overrides: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    result = subprocess.run([sys.executable, "-m", module, *overrides, "dry_run=true"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == 2, output
    assert output.startswith("ds_trainer: 1 problem"), output
    assert len(output.splitlines()) <= 25, output
    assert "fix:" in output, output


TOOLS = ["ds_trainer", "ds_trainer.plan", "ds_trainer.tune", "ds_trainer.doctor", "ds_trainer.cache",
         "ds_trainer.convert", "ds_trainer.report", "ds_trainer.bench", "ds_trainer.gpucheck",
         "ds_trainer.slurm_local"]


@pytest.mark.slow
def test_every_tool_answers_help() -> None:
    """`python -m ds_trainer.<tool> --help` (and -h) prints what the tool does and exits 0 (the planner,
    the tuner and the doctor took it for an override, exit 2)."""
    import concurrent.futures

    def asked(module: str, flag: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        return module, subprocess.run([sys.executable, "-m", module, flag], capture_output=True, text=True,
                                      timeout=300, env={k: v for k, v in os.environ.items()
                                                        if k != "HYDRA_FULL_ERROR"})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda a: asked(*a), [(m, "--help") for m in TOOLS] + [("ds_trainer.plan", "-h")]))
    for module, result in done:
        output = result.stdout + result.stderr
        assert result.returncode == 0 and "Traceback" not in output, (module, output[-2000:])
        assert "problem" not in output.splitlines()[0] and len(result.stdout.split()) > 10, (module, output)
