"""Shared test helpers: composing configs from the repo's conf/, and CI strictness."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ds_trainer import CONF_DIR
from ds_trainer.config import op_cache, rundir, schema
from ds_trainer.launch import sweep

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"

# Engines built in this process load the ops `make ops` built for this environment (and so do the runs it starts).
op_cache.prepare()
schema.register()
sweep.register()
rundir.register_resolvers()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2`, as `make test` runs) the tests of one local Slurm cluster run one after another
    in one worker, which starts that cluster once: the one-node cluster's tests in one group, the two-node
    cluster's in another (the two clusters run side by side), and both groups start first."""
    rank = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "two_nodes" in fixtures:
            item.add_marker(pytest.mark.xdist_group("slurm_two_nodes"))
            rank[item.nodeid] = 0
        elif "slurm_cluster" in fixtures or "slurm" in item.name:
            item.add_marker(pytest.mark.xdist_group("slurm_one_node"))
            rank[item.nodeid] = 1
        elif item.get_closest_marker("xdist_group") is not None:  # a module's shared runs (test_text_encoders)
            rank[item.nodeid] = 1
    # Each group is one unit of work of several minutes: first, so that the other tests fill the workers around
    # them (last, the suite waited for one worker running a whole group alone).
    items.sort(key=lambda item: rank.get(item.nodeid, 2))


def pytest_configure(config: pytest.Config) -> None:
    """`--dist loadgroup` works by pytest-xdist 3.8 writing each test's group into `item._nodeid`; pytest 9.2 keeps
    the id elsewhere, and the groups are then silently ignored: the Slurm tests ran in both workers at once and
    CI failed three of them. Refuse to run that way."""
    from _pytest import nodes

    if config.getoption("dist", "no") == "loadgroup" and "_nodeid" not in getattr(nodes.Node, "__slots__", ()):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist's --dist loadgroup ignores the test "
                                "groups (the local Slurm cluster's tests would run side by side): install the "
                                "versions of constraints.txt (pytest<9.2), as `make test` does")


def group_options() -> list[tuple[str, str]]:
    """(group, option) for every option file on disk, so a new YAML is tested without anyone listing it."""
    return sorted((d.name, f.stem) for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra"
                  for f in d.glob("*.yaml"))


def make_cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def wait_until(condition: Callable[[], Any], message: str, *, deadline: float,
               proc: subprocess.Popen | None = None, interval: float = 0.2) -> Any:
    """Poll `condition` until it returns something true, and return that; fail with `message` when the
    deadline passes or `proc` (the process expected to make it true) ends first."""
    while not (value := condition()):
        assert (proc is None or proc.poll() is None) and time.time() < deadline, message
        time.sleep(interval)
    return value


def require(ok: bool, reason: str) -> None:
    """Skip when a system dependency is missing; under CI=true that is a failure, not a skip."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a test dependency is missing: {reason}")
    pytest.skip(reason)


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 600,
            module: str = "ds_trainer") -> subprocess.CompletedProcess[str]:
    """Run `python -m ds_trainer ARGS` as a user would, from `cwd`."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# What a run may print on the terminal (stderr): ds_trainer's log lines, its progress bar, its closing summary
# (indented lines under "ds_trainer: <status>"), W&B's own lines. Anything else (a library's warning, a
# traceback's first line) is chatter a user should not have to read.
OUR_LINE = re.compile(r"\[[^]]+\]\[ds_trainer(\.[\w.]+)?\]\[[A-Z]+\] - |ds_trainer: |wandb: |  \S|$")
PROGRESS_BAR = re.compile(r"train:\s+\d+%\|[^|]*\|\s*\d+/\d+\s*\[[^\]]*\]")


def terminal_chatter(stderr: str) -> list[str]:
    """The lines of a run's stderr that are not ds_trainer's. The progress bar's redraws (carriage returns) are
    split apart, and what was printed right after a bar's text (no newline in between) is judged on its own."""
    chatter = []
    for line in (part for row in stderr.splitlines() for part in row.split("\r")):
        while bar := PROGRESS_BAR.match(line):
            line = line[bar.end():].lstrip(" ")  # tqdm pads a redraw with spaces over the longer one before
        if not OUR_LINE.match(line):
            chatter.append(line)
    return chatter


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / "outputs" / "runs").glob("*/*/config.yaml"))


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """An empty working directory for a CLI run (outputs/ lands in it)."""
    yield tmp_path


@contextlib.contextmanager
def one_rank_process_group(port: int) -> Iterator[None]:
    """A one-rank gloo process group in this process (for engines built in-process), the environment restored."""
    import deepspeed
    import torch

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def module_tmp(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """`module_tmp(name)`: a folder for a run that a module's tests share, removed when the module is done unless one
    of its tests failed (then kept to look at, as pytest keeps a failed test's `tmp_path`). With pyproject's
    retention policy ("failed": a passed test's `tmp_path` goes at once), what the suite holds on disk at a time
    stays a few GiB: it kept every run, 35 GiB a CI run, and a CI machine's disk ran full mid-suite."""
    made: list[Path] = []
    failed_before = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """The one-node Slurm cluster of `python -m ds_trainer.slurm_local` (started if it is not running);
    the environment its commands need."""
    from ds_trainer.launch import slurm_local

    require(not slurm_local.missing(), f"Slurm is not installed ({', '.join(slurm_local.missing())})")
    require(os.geteuid() == 0, "the local SLURM cluster needs root")
    folder = slurm_local.DEFAULT_DIR
    running = slurm_local.running(folder)
    slurm_local.start(folder)
    yield slurm_local.env(folder)
    if not running:  # leave a cluster the user had started alone
        slurm_local.stop(folder)


def slurm_jobs(env: dict[str, str], workdir: Path, states: str = "PENDING,RUNNING,CONFIGURING,REQUEUED") -> list[str]:
    """The ids of this test's jobs (submitted from `workdir`) in `states`: a job of the previous test may still
    be completing (state CG, for seconds on a loaded machine), and squeue lists it by default."""
    out = subprocess.run(["squeue", "-h", "-t", states, "-o", "%i|%Z"], env=env, capture_output=True,
                         text=True).stdout
    mine = str(workdir.resolve())
    return [job for job, _, folder in (line.partition("|") for line in out.splitlines())
            if Path(folder).resolve().is_relative_to(mine)]


ACTIVE_STATES = "PENDING,RUNNING,CONFIGURING,REQUEUED,COMPLETING"


def torchrun(ranks: int) -> list[str]:
    """`python -m torch.distributed.run` for `ranks` ranks on this machine, on a free port (not torchrun's
    default 29500, which two tests running side by side would both take)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port())]


def sigint_at_default() -> None:
    """A `preexec_fn`: SIGINT at its default disposition, as a terminal's foreground job has it. A child inherits
    an ignored SIGINT (a shell's background job, a test runner's worker may have one), and Python then installs no
    KeyboardInterrupt handler: Ctrl-C would do nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """(exit status, what it printed) of `python -m ds_trainer <argv>` run in this process from `cwd`: fast, for
    commands that stop before training (a dry run, a refused configuration). What the run leaves in the process is
    undone after it."""
    from ds_trainer import cli

    out = io.StringIO()
    old, environ, sigint = Path.cwd(), dict(os.environ), signal.getsignal(signal.SIGINT)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                cli.main(argv)
                code = 0
            except SystemExit as exc:
                code = int(exc.code or 0)
    finally:
        os.chdir(old)
        # The run sets DS_TRAINER_RUN_STAMP for the processes it starts; left in this process it would send
        # every later test's runs into one run directory.
        os.environ.clear()
        os.environ.update(environ)
        # main() ends by ignoring SIGINT (a process's last moments); every process this worker starts later would
        # inherit that, and Ctrl-C would do nothing to them (CI5: the Slurm Ctrl-C test in the same worker).
        signal.signal(signal.SIGINT, sigint)
    return code, out.getvalue()


def kill_9_at(proc: subprocess.Popen, root: Path, moment: str, target: int, rng: random.Random,
              jitter: float) -> None:
    """SIGKILL the training run `proc` (its outputs under `root`) while step `target` trains (`moment="step"`: once
    step target-1's checkpoint is complete, after up to `jitter` s more) or while step `target`'s checkpoint is
    being written (`moment="save"`), then reap it."""
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
        ckpt = list(root.glob("outputs/runs/*/*/checkpoints"))
        names = {p.name for p in ckpt[0].iterdir()} if ckpt else set()
        if moment == "save" and f".step_{target:08d}.partial" in names:
            break
        if moment == "step" and f"step_{target - 1:08d}" in names:
            time.sleep(rng.uniform(0.0, jitter))
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
