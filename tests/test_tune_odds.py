"""The quality search's odds: the product's sampler, pruner and step budget replayed on a landscape
measured by real trials (benchmarks/cpu-tiny-quality-tune/replay.py, planted.csv: the tiny SDXL's
planted folder, the long test of test_tune_quality.py). One real search is one draw of its seed;
these replay hundreds of draws in seconds, with the training replaced by the measured losses.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu-tiny-quality-tune" / "replay.py"


@pytest.fixture(scope="module")
def replay() -> Any:
    spec = importlib.util.spec_from_file_location("replay", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def _odds(replay: Any, sampler: str, workers: int, budget: int, rungs: int = 1) -> tuple[float, float]:
    """(the share of 40 seeds whose chosen trial is within noise of the grid's best, the mean
    trials a search ran)."""
    land = replay.Landscape(replay.load())
    runs = [replay.search(land, 10 * i, workers, budget, rungs, sampler) for i in range(40)]
    assert all(r["steps"] <= budget for r in runs)  # a step budget is never passed
    return sum(r["within"] for r in runs) / len(runs), sum(r["trials"] for r in runs) / len(runs)


def test_with_twenty_trials_tpe_finds_the_grid_s_best_nine_times_in_ten_on_one_or_two_workers(
        replay: Any) -> None:
    """Half the grid's steps (about 20 trials with the default rung): TPE's chosen trial is within
    the noise of the grid's best in 9 draws of 10 (replay.md: 88% and 90% of 200), on one worker and
    two alike; random search at the same budget in about half (55%): the model earns its keep."""
    half = replay.GRID_STEPS // 2
    for workers in (1, 2):
        tpe, trials = _odds(replay, "tpe", workers, half)
        rand, _ = _odds(replay, "random", workers, half)
        assert trials >= 18, trials
        assert tpe >= 0.8, (workers, tpe)
        assert rand <= tpe - 0.2, (workers, rand, tpe)


def test_a_rung_at_a_ninth_fits_more_trials_in_a_third_of_the_grid_s_steps_and_finds_the_best_more_often(
        replay: Any) -> None:
    """A third of the grid's steps (the long test's budget): one rung (at a third of a trial) fits
    13 trials, a coin flip for TPE (replay.md: 56% and 60%); tune.rungs=2 (a rung at a ninth too)
    fits about 20 and finds the grid's best more often (77% and 85%; the real searches of the
    benchmark, 16 of 16)."""
    third = replay.GRID_STEPS // 3 - 1
    for workers in (1, 2):
        one, one_trials = _odds(replay, "tpe", workers, third, rungs=1)
        two, two_trials = _odds(replay, "tpe", workers, third, rungs=2)
        assert two_trials >= 1.4 * one_trials, (workers, one_trials, two_trials)
        assert two >= one + 0.15, (workers, one, two)
