"""pytest's hooks and fixtures for the suite; the helpers tests import are in tests/helpers/."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.deps import require

from ds_trainer.config import op_cache, rundir, schema
from ds_trainer.launch import sweep

# Engines built in this process load the ops `make ops` built for this environment (and so do the runs it starts).
op_cache.prepare()
schema.register()
sweep.register()
rundir.register_resolvers()


# Module-scoped fixtures that train runs several tests check.
SHARED_RUNS = {"chain", "shared_run", "zero3_run", "runs", "references", "fsdp_run", "check", "tuned", "files",
               "sourced", "damaged"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2`, as `make test` runs) the tests of one local Slurm cluster run one after another
    in one worker, which starts that cluster once: the one-node cluster's tests in one group, the two-node
    cluster's in another (the two clusters run side by side), and both groups start first. So do the tests of a
    module that share its trained runs (a module-scoped fixture is built once per worker: split over both workers,
    the CI run trained test_portable's chain, test_lora's shared run and the others twice)."""
    rank = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        shared = sorted(fixtures & SHARED_RUNS)
        if shared and item.get_closest_marker("xdist_group") is None and "two_nodes" not in fixtures and not (
                "slurm_cluster" in fixtures or "slurm" in item.name):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{shared[0]}"))  # type: ignore[attr-defined]
            rank[item.nodeid] = 1
        elif "two_nodes" in fixtures:
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


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """An empty working directory for a CLI run (outputs/ lands in it)."""
    yield tmp_path


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

